"""Command line: `kvql demo`, `kvql run FILE.lmql`, `kvql serve`, `kvql bench`, `kvql generate`.

Parsing arguments imports nothing heavy: torch and transformers are imported only by a command that
loads a model, so `kvql --help` and argument errors return at once. Every argument is checked before
a model loads: its syntax by argparse (sizes, counts, paths, dtypes, workload names: a usage error,
exit 2; the types: `kvql.arguments`), what needs torch (the device) by `kvql.factory.check` before the
"loading" line, and `kvql run` checks the query's inputs before it imports anything heavy.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

from .arguments import (DTYPE_HELP, MODEL_HELP, SPECULATE_HELP, at_least, directory, disk_options, non_negative,
                        output_file, seconds, size, unescape, workload)
from .backends.load_error import ModelLoadError
from .factory import is_remote
from .registry import DEFAULT_MODEL

FEW_SHOT = """Answer each question with one word.
Q: What is the capital of France?
A: Paris
Q: What color is the sky on a clear day?
A: Blue
Q: How many legs does a spider have?
A: Eight
Q: What is the opposite of hot?
A: Cold
Q: Which animal says moo?
A: Cow
"""

# questions SmolLM2-135M answers right with a clear margin (it answers counting questions wrong: a week has 5 days)
QUESTIONS = ["What is the capital of Italy?", "What color is grass?", "What is the capital of Greece?",
             "What is the opposite of up?", "Which animal barks?", "What is frozen water called?",
             "What is the capital of Japan?", "What color is coal?"]


class UsageError(ValueError):
    """A mistake in the command line or its inputs, found before any model is loaded."""


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvql")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def load(spec: str, args):
    """The model for a command, with a loading line and the banner on stderr (see kvql.factory); a server's
    URL connects to it, with `--timeout` and `--api-key` when the command has them."""
    import kvql

    timeout, api_key = getattr(args, "timeout", None), getattr(args, "api_key", None)
    if is_remote(spec):
        if getattr(args, "disk_cache", None):
            raise UsageError("--disk-cache (--cache-dir) is for local models; a server keeps its own cache "
                             "(kvql serve --disk-cache)")
        return kvql.model(spec, timeout=timeout, api_key=api_key, silent=False)
    for flag, value in (("--timeout", timeout), ("--api-key", api_key)):
        if value is not None:
            raise UsageError(f"{flag} is for a server's model (--model http://HOST:PORT/v1), not {spec!r}")
    return kvql.model(spec, device=getattr(args, "device", "cpu"), dtype=getattr(args, "dtype", None),
                      cache_budget=getattr(args, "cache_budget", None), disk_cache=getattr(args, "disk_cache", None), disk_budget=getattr(args, "disk_budget", None),
                      speculate=getattr(args, "speculate", True), weights=getattr(args, "weights", None), silent=False)


def demo(args) -> None:
    m = load(args.model, args)
    prompts = [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS]
    for run in ("cold", "warm"):
        t0 = time.perf_counter()
        out = m.generate(prompts, max_tokens=8, stop="\n")
        wall = time.perf_counter() - t0
        print(f"\n{run} run: {len(prompts)} questions submitted together, {wall:.2f}s")
        for q, c in zip(QUESTIONS, out):
            print(f"  {q:<40} -> {c.text.strip()!r:<12} ({c.cached_tokens}/{c.prompt_tokens} prompt tokens cached)")
    s = m.stats()
    print(f"\nprompt tokens {s['prompt_tokens']}, served from cache {s['cached_tokens']}"
          + (f" ({s['ram_tokens']} from memory, {s['disk_tokens']} read back from disk)" if "tier_bytes" in s else "")
          + f", computed {s['computed_tokens']} (hit rate {s['hit_rate']:.0%}); cache {s['cache_bytes'] / 2**20:.1f} "
          f"MiB of {s['cache_budget_bytes'] / 2**20:.0f} MiB budget"
          + (f"; disk tier {s['tier_bytes'] / 2**20:.1f} MiB of {s['tier_budget_bytes'] / 2**20:.0f} MiB"
             if "tier_bytes" in s else ""))
    m.close()


def generate(args) -> None:
    """Each prompt's completion on stdout; with several prompts, each after a line naming its prompt."""
    m = load(args.model, args)
    out = m.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop or None)
    for k, (prompt, c) in enumerate(zip(args.prompt, out), 1):
        if len(out) > 1:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            print(f"--- prompt {k}/{len(out)}: {shown!r} ---")
        print(c.text)
    m.close()


# --- kvql run -------------------------------------------------------------------------------------

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
    from kvql.output import TerminalWriter

    try:
        q = kvql.Query(source, name=args.file)
    except SyntaxError as e:
        raise UsageError(located(e, args.file)) from None
    check_inputs(q, inputs, args.file)
    clash = sorted(set(inputs) & set(overrides))
    if clash:
        raise UsageError(f"input {clash[0]!r} is also a decoder option given by a flag; rename one of them")
    decoding = q.check(inputs, overrides)  # the decoder and its options, before any model loads
    live = args.stream if args.stream is not None else sys.stderr.isatty() and decoding.runs == 1
    if live and q.output_variables:  # (a query without holes has nothing to watch)
        overrides["output_writer"] = TerminalWriter(sys.stderr)
    if not q.output_variables:
        model = args.model  # no hole: the query never needs its model, so none is loaded
    else:
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
            model = kvql.model(spec, timeout=args.timeout, api_key=args.api_key)
        else:  # a server's URL goes to the registry, which connects once per spec
            model = spec if remote or not spec else load(spec, args)
    result = q.run_sync(model=model, **overrides, **inputs)
    traces = list(getattr(q, "last_traces", None) or [])
    if isinstance(result, list) and len(traces) > 1 and len(result) == len(traces):
        samples = result
    else:
        samples = [result]
    for k, r in enumerate(samples, 1):
        if len(samples) > 1:
            print(f"--- sample {k}/{len(samples)} ---")
        print_result(r)
    if args.trace:
        if not traces or any(t is None for t in traces):
            raise UsageError("no trace: the query never called its model, or ran on a remote model without a "
                             "tokenizer (text prompts)")
        if len(traces) == 1:
            traces[0].save(args.trace)
        else:
            from kvql.runtime.trace import save_all

            save_all(traces, args.trace)  # one file: a section per sample (JSON: {"traces": [...]})
        print(f"trace written to {args.trace}" + (f" ({len(traces)} samples)" if len(traces) > 1 else ""),
              file=sys.stderr)
    if args.stats:
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


def bench(args) -> None:
    from kvql import bench as suite

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    m = load(args.model, args)
    repeats = args.repeats or (1 if args.quick else 3)
    results = suite.run(m, args.workloads or suite.WORKLOADS, (2, 6) if args.quick else (2, 4, 8, 16, 32),
                        args.out, progress=True, repeats=repeats)
    suite.print_table(results)
    print(f"wrote {args.out}/bench.json and {args.out}/bench.png")
    m.close()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default after its help text, unless it has none to show (None, a
    flag's False) or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _model_options(p: argparse.ArgumentParser, model_default: str | None = DEFAULT_MODEL,
                   model_help: str = MODEL_HELP, disk_cache: bool = False) -> None:
    """--model, --device, --dtype, --cache-budget (and --disk-cache): the local model a command loads."""
    from .backends.dtype import DEFAULT, NAMES
    from .backends.weights import HELP as WEIGHTS_HELP, WEIGHTS

    p.add_argument("--model", default=model_default, help=model_help)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...; checked before the model loads")
    p.add_argument("--dtype", choices=NAMES, default=DEFAULT, help=DTYPE_HELP)
    p.add_argument("--weights", choices=WEIGHTS, default=None, help=WEIGHTS_HELP)
    p.add_argument("--cache-budget", type=size, default=None, metavar="SIZE",
                   help="KV cache size, e.g. 512MB or 2GiB (default: a quarter of free memory, at most 4 GiB, on CPU)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True,
                   help=SPECULATE_HELP)
    if disk_cache:
        disk_options(p)


def server_options(p: argparse.ArgumentParser) -> None:
    """--timeout and --api-key: for a server's model (--model http://HOST:PORT/v1)."""
    p.add_argument("--timeout", type=seconds, default=None, metavar="SECONDS",
                   help="with a server's URL as the model: the seconds each request to it may take, its answer "
                        "included (default: 600)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="with a server's URL as the model: the key of a server started with --api-key (default: "
                        "$OPENAI_API_KEY)")


def parser() -> argparse.ArgumentParser:
    p0 = argparse.ArgumentParser(prog="kvql", description=__doc__.split("\n")[0])
    p0.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p0.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)

    p = command("demo", "few-shot questions on the embedded model, cold then warm cache")
    _model_options(p)
    p.set_defaults(func=demo)
    p = command("run", "run an LMQL query file")
    p.add_argument("file", help="the query (.lmql)")
    _model_options(p, None, f"default: the query's own (from ...), else {DEFAULT_MODEL}; {MODEL_HELP}", disk_cache=True)
    p.add_argument("--input", action="append", metavar="NAME=VALUE", help="an input of the query (repeatable)")
    p.add_argument("--decoder", metavar="DECODER",
                   help="override the query's decoder: argmax, 'sample(n=3)', 'beam(n=2)', ...")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same samples)")
    p.add_argument("--temperature", type=non_negative, default=None, help="sampling temperature")
    p.add_argument("--trace", type=output_file, metavar="FILE",
                   help="write the run's trace: FILE.html (self-contained) or FILE.json; several samples go to "
                        "one file, a section per sample")
    p.add_argument("--stats", action="store_true", help="print the run's cached / computed token counts")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="show the prompt on stderr as its holes fill (default: when stderr is a terminal and "
                        "the decoder makes one run)")
    server_options(p)
    p.set_defaults(func=run)
    p = command("serve", "OpenAI-compatible server sharing one model and its cache")
    from .server import launch  # its flags; the server itself is imported only when it starts

    launch.add_arguments(p)
    p.set_defaults(func=launch.serve)
    p = command("bench", "workloads side by side: kvql vs HF generate / generate_batch")
    p.add_argument("workloads", nargs="*", type=workload, metavar="WORKLOAD",
                   help="fewshot chat tot json classify (default: all)")
    _model_options(p)
    p.add_argument("--quick", action="store_true", help="sizes 2 and 6, one repeat: under 2 minutes on 2 quiet cores")
    p.add_argument("--repeats", type=at_least(1), default=None, metavar="N",
                   help="time every point N times; the table shows the best (min) and the median (default: 3, "
                        "1 with --quick)")
    p.add_argument("--out", type=directory, default="bench-results", metavar="DIR",
                   help="where bench.json and bench.png go")
    p.add_argument("--threads", type=at_least(0), default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=bench)
    p = command("generate", "complete prompts")
    p.add_argument("prompt", nargs="+", type=unescape,
                   help="one or more prompts, each completed on its own; backslash escapes as in --stop")
    _model_options(p, disk_cache=True)
    p.add_argument("--max-tokens", type=at_least(1), default=32, help="tokens generated at most per prompt")
    p.add_argument("--temperature", type=non_negative, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--stop", action="append", type=unescape, metavar="TEXT",
                   help="stop before TEXT (repeatable); backslash escapes as in Python, in prompts too: '\\n' is a "
                        "newline, '\\\\' a backslash")
    server_options(p)
    p.set_defaults(func=generate)
    return p0


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except ModelLoadError as e:  # one line, also where it carries a multi-line error of transformers'
        print(f"kvql: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, TypeError, RuntimeError, NameError, SyntaxError) as e:
        print(f"kvql: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvql: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
