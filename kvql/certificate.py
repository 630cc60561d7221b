"""Inference certificates (LMQL's `certificate=`): a JSON record of a query run's model calls.

`certificate=True` prints it, a path string writes it to that file, a callable receives the
`InferenceCertificate`, and `"return_dict"` makes the call return `{"result": ..., "certificate": ...}`
per result. kvql fills it from each run's trace (`kvql.runtime.trace`): the model and decoder, every
hole's generation (value, constraints, tokens generated, time) and the exact token ids of the final
prompt with how the engine served each (cached / computed).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict


class InferenceCertificate:
    """`str(cert)` / `cert.to_json()` is the JSON text; `cert.data` the dict."""

    def __init__(self, data: dict):
        self.data = data

    def to_json(self) -> str:
        return json.dumps(self.data, indent=4, default=str)

    def __str__(self) -> str:
        return self.to_json()

    __repr__ = __str__


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvql")
    except PackageNotFoundError:
        return "dev"


def check(certificate) -> None:
    """Refuse, before a query runs, a `certificate=` value that is none of the accepted kinds."""
    if certificate in (None, False, True) or isinstance(certificate, str) or callable(certificate):
        return
    raise TypeError(f"certificate must be True, a file path, a callable or 'return_dict', got {certificate!r}")


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value) if not hasattr(value, "__dataclass_fields__") else \
            {k: _jsonable(v) for k, v in asdict(value).items() if k != "trace"}


def make(name: str, model, decoding, traces: list, results: list) -> InferenceCertificate:
    """The certificate of one query call: its runs' `traces` (one per sample) and `results`."""
    config = getattr(getattr(model, "hf_model", None), "config", None)
    events = []
    for run, trace in enumerate(traces):
        if trace is None:  # a remote model without a tokenizer keeps no token trace
            continue
        for hole in trace.holes:
            events.append({"name": "kvql.generate", "data": {"run": run, **asdict(hole)}})
    events.append({"name": "lmql.LMQLResult", "data": [_jsonable(r) for r in results]})
    summaries = [t.summary() for t in traces if t is not None]
    data = {
        "name": name,
        "type": "lmql.InferenceCertificate",
        "lmql.version": f"kvql {_version()}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "model": {"name": getattr(model, "name", str(model)),
                  "config": config.to_diff_dict() if config is not None else None},
        "decoder": {k: v for k, v in vars(decoding).items() if k != "shared"},
        "events": events,
        "prompts": [{"token_ids": [t.id for t in trace.tokens], **trace.summary()}
                    for trace in traces if trace is not None],
        "metrics": {"kvql": {"requests": sum(len(t.holes) for t in traces if t is not None),
                             "generated_tokens": sum(s["generated"] for s in summaries),
                             "cached_tokens": sum(s["cached"] for s in summaries),
                             "computed_tokens": sum(s["computed"] for s in summaries)}},
    }
    return InferenceCertificate(data)


def deliver(certificate, cert: InferenceCertificate, results: list):
    """Hand `cert` to where `certificate=` says; returns the results (wrapped for "return_dict")."""
    if certificate == "return_dict":
        return [{"result": r, "certificate": cert} for r in results]
    if callable(certificate):
        certificate(cert)
    elif isinstance(certificate, str):
        with open(certificate, "w", encoding="utf-8") as f:
            f.write(str(cert))
    elif certificate is True:
        print(str(cert), flush=True)
    return results
