"""`kvql run FILE.lmql`: a query file run from the command line. Its inputs and decoder options are checked before
anything heavy is imported or any model loads (a usage error names what is wrong; a syntax error its line and
column)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from .cli_model import UsageError, load
from .factory import is_remote
from .registry import DEFAULT_MODEL


def parse_inputs(items: list[str] | None) -> dict[str, str]:
    inputs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--input takes NAME=VALUE, got {item!r}")
        inputs[key] = value
    return inputs


def parse_decoder(text: str) -> dict:
    """`--decoder argmax` / `sample(n=3, temperature=0.8)` / `beam(3)` -> the run's decoder overrides."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        node = None
    if isinstance(node, ast.Name):
        return {"decoder": node.id}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) <= 1:
        try:
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            if node.args:
                options["n"] = ast.literal_eval(node.args[0])
        except ValueError:
            pass
        else:
            if len(options) == len(node.keywords) + len(node.args):
                return {"decoder": node.func.id, **options}
    raise UsageError(f"--decoder takes a decoder as a query writes it, e.g. argmax, 'sample(n=3, temperature=0.8)' "
                     f"or 'beam(3)' (literal arguments); got {text!r}")


def expected_inputs(q) -> list[str]:
    """The names a query reads that it does not define: the inputs a run must be given."""
    from kvql.query import UnresolvedVariable

    try:
        q.bind((), {})
    except UnresolvedVariable as e:
        return list(e.names)
    return []


def check_inputs(q, inputs: dict, file: str) -> None:
    """UsageError naming the expected inputs when one is missing or not read by the query (a misspelling)."""
    expected = expected_inputs(q)
    missing = [n for n in expected if n not in inputs]
    unknown = [n for n in inputs if n not in expected]
    if not missing and not unknown:
        return
    wanted = ", ".join(expected) if expected else "none"
    problems = []
    if missing:
        problems.append("missing " + ", ".join(f"--input {n}=..." for n in missing))
    if unknown:
        problems.append("unknown input " + ", ".join(repr(n) for n in unknown))
    raise UsageError(f"query {file}: {'; '.join(problems)} (its inputs: {wanted})")


def query_model_spec(q, inputs: dict, given: str | None) -> str | None:
    """The model spec a run will use, when it is known without running anything: `--model`, the query's
    `from "..."` literal, else the default; None when the `from` clause is an expression."""
    if given:
        return given
    compiled = q.compiled_for(inputs)
    if compiled.model is not None:
        return compiled.model
    return None if compiled.model_source else DEFAULT_MODEL


def located(e: SyntaxError, file: str) -> str:
    """A query's syntax error as compilers print one: `FILE:LINE:COLUMN: message`, then the line, a caret
    under the column."""
    message = getattr(e, "msg_only", None) or e.msg
    if not e.lineno:
        return f"{file}: {message}"
    column = max(e.offset or 1, 1)
    shown = f"\n    {e.text.rstrip()}\n    {' ' * (column - 1)}^" if e.text else ""
    return f"{file}:{e.lineno}:{column}: {message}{shown}"


def print_result(r) -> None:
    import kvql

    if isinstance(r, kvql.LMQLResult):
        print(r.prompt)
        for name, value in r.variables.items():
            print(f"{name}: {value!r}")
    else:
        print(r)


def run(args) -> None:
    """`kvql run FILE`: the query's inputs and decoder checked before any model loads, then run, its results
    printed (each sample's), its traces written or summed up when asked."""
    q, inputs, overrides = _query(args)
    decoding = q.check(inputs, overrides)  # the decoder and its options, before any model loads
    live = args.stream if args.stream is not None else sys.stderr.isatty() and decoding.runs == 1
    if live and q.output_variables:  # (a query without holes has nothing to watch)
        from kvql.output import TerminalWriter

        overrides["output_writer"] = TerminalWriter(sys.stderr)
    result = q.run_sync(model=_model(q, inputs, args), **overrides, **inputs)
    traces = list(getattr(q, "last_traces", None) or [])
    samples = result if isinstance(result, list) and len(traces) > 1 and len(result) == len(traces) else [result]
    for k, r in enumerate(samples, 1):
        if len(samples) > 1:
            print(f"--- sample {k}/{len(samples)} ---")
        print_result(r)
    if args.trace:
        _write_traces(traces, args.trace)
    if args.stats:
        _print_stats(traces)


def _query(args):
    """The query of `args.file`, its inputs and the decoder options the flags give; UsageError where any is
    wrong (the query's syntax error at its line and column)."""
    inputs = parse_inputs(args.input)
    overrides = parse_decoder(args.decoder) if args.decoder else {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.temperature is not None:
        overrides["temperature"] = args.temperature
    try:
        source = Path(args.file).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read query file {args.file!r}: {e.strerror or e}") from None
    import kvql

    try:
        q = kvql.Query(source, name=args.file)
    except SyntaxError as e:
        raise UsageError(located(e, args.file)) from None
    check_inputs(q, inputs, args.file)
    clash = sorted(set(inputs) & set(overrides))
    if clash:
        raise UsageError(f"input {clash[0]!r} is also a decoder option given by a flag; rename one of them")
    return q, inputs, overrides


def _model(q, inputs: dict, args):
    """The model the run uses: none for a query without holes (it never needs one), else `--model` or the
    query's own, loaded (a server's URL connects once per spec, through the registry)."""
    if not q.output_variables:
        return args.model
    import kvql

    spec = query_model_spec(q, inputs, args.model)
    remote = is_remote(spec)
    if remote and args.disk_cache:
        raise UsageError("--disk-cache (--cache-dir) is for local models; a server keeps its own cache "
                         "(kvql serve --disk-cache)")
    for flag, value in (("--timeout", args.timeout), ("--api-key", args.api_key)):
        if value is not None and not remote:
            raise UsageError(f"{flag} is for a server's model: give its URL (--model http://HOST:PORT/v1, or "
                             f"the query's from clause)")
    if remote and (args.timeout is not None or args.api_key is not None):
        return kvql.model(spec, timeout=args.timeout, api_key=args.api_key)
    return spec if remote or not spec else load(spec, args)


def _write_traces(traces: list, path) -> None:
    if not traces or any(t is None for t in traces):
        raise UsageError("no trace: the query never called its model, or ran on a remote model without a "
                         "tokenizer (text prompts)")
    if len(traces) == 1:
        traces[0].save(path)
    else:
        from kvql.runtime.trace import save_all

        save_all(traces, path)  # one file: a section per sample (JSON: {"traces": [...]})
    print(f"trace written to {path}" + (f" ({len(traces)} samples)" if len(traces) > 1 else ""), file=sys.stderr)


def _print_stats(traces: list) -> None:
    for k, t in enumerate(traces, 1):
        if t is None:
            continue
        s = t.summary()
        label = f"sample {k}/{len(traces)}: " if len(traces) > 1 else ""
        print(f"{label}tokens {s['tokens']}: cached {s['cached']}, computed {s['computed']}, generated "
              f"{s['generated']}, never sent {s['unsent']}; {s['requests']} requests sent {s['request_tokens']} "
              f"prompt tokens, {s['request_cached']} from the cache"
              + (f", {s['request_disk']} of them read back from disk" if s["request_disk"] else "")
              + f" (hit rate {s['hit_rate']:.0%}); "
              f"{s['seconds']:.2f} s" + (f"; server {t.server}" if t.server else ""), file=sys.stderr)
