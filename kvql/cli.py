"""Command line: `kvql demo`, `kvql run FILE.lmql`, `kvql serve`, `kvql bench`, `kvql generate`.

Parsing arguments imports nothing heavy: torch and transformers are imported only by a command that
loads a model, so `kvql --help` and argument errors return at once. Every argument is checked before
a model loads: its syntax by argparse (sizes, counts, paths, dtypes, workload names: a usage error,
exit 2; the types: `kvql.arguments`), what needs torch (the device) by `kvql.factory.check` before the
"loading" line, and `kvql run` checks the query's inputs before it imports anything heavy.
"""

from __future__ import annotations

import argparse
import sys
import time

from .arguments import (DTYPE_HELP, MODEL_HELP, SPECULATE_HELP, at_least, directory, disk_options, non_negative,
                        output_file, seconds, size, unescape, workload)
from .backends.load_error import ModelLoadError
from .cli_model import load
from .cli_run import run
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


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvql")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


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


def bench(args) -> None:
    from kvql import bench as suite
    from kvql.bench_report import print_table

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    m = load(args.model, args)
    repeats = args.repeats or (1 if args.quick else 3)
    results = suite.run(m, args.workloads or suite.WORKLOADS, (2, 6) if args.quick else (2, 4, 8, 16, 32),
                        args.out, progress=True, repeats=repeats)
    print_table(results)
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
