"""The registry queries use: `get_model(spec)` is one model per spec, loaded on first use and shared by every
query of the process; `set_default_model` names the model of queries that name none (`DEFAULT_MODEL` until then).

It loads a spec with `load`, a function spec -> model that the package sets when it is imported
(`kvql/__init__`: `kvql.model`), rather than importing the factory: the factory's models carry LMQL's methods,
which run queries, which ask this registry for their models, so that import would close a circle through the
whole API layer (docs/architecture.md). A script may replace `load` (scripts/lmql_tests.py maps the hosted
models LMQL's tests name to ones this machine has)."""

from __future__ import annotations

from typing import Callable

DEFAULT_MODEL = "smollm2-135m"  # the embedded model (kvql.backends.loader): every machine with kvql has it

load: Callable | None = None  # spec -> model; set by kvql/__init__
_models: dict = {}
_default = None


def set_default_model(model) -> None:
    """Model used by queries that name none (default: the embedded SmolLM2-135M); a model or a spec."""
    global _default
    _default = model


def get_model(model=None):
    """A loaded model: the object itself (any `kvql.backends.base.Backend`), or one loaded once per spec and
    shared by all queries."""
    from .backends.base import Backend

    model = model if model is not None else (_default or DEFAULT_MODEL)
    if isinstance(model, Backend):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a kvql.Model or a spec string, got {type(model).__name__}")
    if model not in _models:
        _models[model] = load(model)
    return _models[model]
