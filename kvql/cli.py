"""Command line: `kvql demo`, `kvql run FILE.lmql`, `kvql serve`, `kvql bench`, `kvql generate`."""

from __future__ import annotations

import argparse
import sys
import time

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

QUESTIONS = ["What is the capital of Italy?", "What color is grass?", "How many days are in a week?",
             "What is the opposite of up?", "Which animal barks?", "What is frozen water called?",
             "What is the capital of Japan?", "How many wheels does a bicycle have?"]


def demo(args) -> None:
    import kvql

    t0 = time.perf_counter()
    m = kvql.model(args.model, device=args.device)
    print(f"loaded {m!r} in {time.perf_counter() - t0:.1f}s")
    prompts = [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS]
    for run in ("cold", "warm"):
        t0 = time.perf_counter()
        out = m.generate(prompts, max_tokens=8, stop="\n")
        wall = time.perf_counter() - t0
        print(f"\n{run} run: {len(prompts)} questions submitted together, {wall:.2f}s")
        for q, c in zip(QUESTIONS, out):
            print(f"  {q:<40} -> {c.text.strip()!r:<12} ({c.cached_tokens}/{c.prompt_tokens} prompt tokens cached)")
    s = m.stats()
    print(f"\nprompt tokens {s['prompt_tokens']}, served from cache {s['cached_tokens']}, computed "
          f"{s['computed_tokens']} (hit rate {s['hit_rate']:.0%}); cache {s['cache_bytes'] / 2**20:.1f} MiB "
          f"of {s['cache_budget_bytes'] / 2**20:.0f} MiB budget")
    m.close()


def generate(args) -> None:
    import kvql

    m = kvql.model(args.model, device=args.device)
    for c in m.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                        stop=args.stop or None):
        print(c.text)
    m.close()


def run(args) -> None:
    import kvql

    with open(args.file) as f:
        source = f.read()
    inputs = {}
    for item in args.input or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--input takes KEY=VALUE, got {item!r}")
        inputs[key] = value
    q = kvql.Query(source, name=args.file)
    result = q.run_sync(model=args.model, **inputs)
    for r in result if isinstance(result, list) else [result]:
        if isinstance(r, kvql.LMQLResult):
            print(r.prompt)
            for name, value in r.variables.items():
                print(f"{name}: {value!r}")
        else:
            print(r)
    trace = q.last_trace
    if args.trace:
        if trace is None:
            raise ValueError("no trace: the query ran on a remote model without a tokenizer (text prompts)")
        trace.save(args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    if args.stats and trace is not None:
        s = trace.summary()
        print(f"tokens {s['tokens']}: cached {s['cached']}, computed {s['computed']}, generated {s['generated']}, "
              f"never sent {s['unsent']}; hit rate {s['hit_rate']:.0%}; {s['seconds']:.2f} s", file=sys.stderr)


def bench(args) -> None:
    import kvql
    from kvql import bench as suite

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    m = kvql.model(args.model)
    results = suite.run(m, args.workloads or suite.WORKLOADS, (2, 6) if args.quick else (2, 4, 8, 16, 32),
                        args.out, progress=True)
    suite.print_table(results)
    print(f"wrote {args.out}/bench.json and {args.out}/bench.png")
    m.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvql", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="few-shot questions on the embedded model, cold then warm cache")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=demo)
    p = sub.add_parser("run", help="run an LMQL query file")
    p.add_argument("file")
    p.add_argument("--model", default=None, help="model spec (default: the query's own, else smollm2-135m)")
    p.add_argument("--input", action="append", metavar="KEY=VALUE", help="an input of the query (repeatable)")
    p.add_argument("--trace", metavar="FILE", help="write the run's trace: FILE.html (self-contained) or FILE.json")
    p.add_argument("--stats", action="store_true", help="print the run's cached / computed token counts")
    p.set_defaults(func=run)
    p = sub.add_parser("serve", help="OpenAI-compatible server sharing one model and its cache")
    from .server import launch  # its flags; the server itself is imported only when it starts

    launch.add_arguments(p)
    p.set_defaults(func=launch.serve)
    p = sub.add_parser("bench", help="workloads side by side: kvql vs HF generate / generate_batch")
    p.add_argument("workloads", nargs="*", help="fewshot chat tot json classify (default: all)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="sizes 2 and 6 only: under 2 minutes on 2 cores")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(func=bench)
    p = sub.add_parser("generate", help="complete prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stop", action="append")
    p.set_defaults(func=generate)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError, RuntimeError, NameError, SyntaxError) as e:
        print(f"kvql: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
