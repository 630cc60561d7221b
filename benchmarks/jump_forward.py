"""Jump-forward decoding on vs off: the JSON-schema workload of vs_vllm.py, in this process, side by side.

24 requests (the few-shot prefix, a question, " As JSON:", a two-field schema, <= 48 tokens, greedy) are
submitted together to `kvql.model("smollm2-135m", dtype=D)`, once with the engine's jump-forward on and
once off, alternating, the cache cleared before each run (each run pays the shared prefix once). Printed per
dtype: the median wall seconds of each, off / on (> 1: jump-forward faster), engine steps, the share of
tokens that were forced, and whether both produced the same texts (they must: tests/test_engine_jump_forward.py).

Usage: python benchmarks/jump_forward.py [--dtypes float32,bfloat16] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from vs_vllm import NAME, requests  # noqa: E402


def run(m, bodies, jump: bool) -> tuple[float, list[str], dict]:
    m.engine.jump_forward = jump
    m.clear_cache()
    before = m.stats()
    t = time.perf_counter()
    out = m.generate([b["prompt"] for b in bodies], max_tokens=bodies[0]["max_tokens"],
                     json_schema=bodies[0]["structured_outputs"]["json"])
    wall = time.perf_counter() - t
    after = m.stats()
    counts = {k: after[k] - before[k] for k in ("steps", "forced_tokens")}
    counts["generated"] = sum(len(c.token_ids) for c in out)
    return wall, [c.text for c in out], counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    import kvql

    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        m = kvql.model(NAME, dtype=dtype)
        bodies = requests(m.tokenizer, 24)["json"]
        run(m, bodies[:4], True)  # warm-up
        times, texts, stats = {True: [], False: []}, {}, {}
        for _ in range(args.repeats):
            for jump in (True, False):
                wall, texts[jump], stats[jump] = run(m, bodies, jump)
                times[jump].append(wall)
        m.close()
        on, off = statistics.median(times[True]), statistics.median(times[False])
        s = stats[True]
        print(f"== {dtype} ({args.threads} threads, 24 JSON requests, {args.repeats} runs each) ==")
        print(f"jump-forward on  {on:6.2f} s  steps {s['steps']:4d}  forced tokens {s['forced_tokens']}")
        print(f"jump-forward off {off:6.2f} s  steps {stats[False]['steps']:4d}")
        print(f"off / on: {off / on:.2f}x   texts equal: {sum(a == b for a, b in zip(texts[True], texts[False]))}/24"
              f"   forced: {s['forced_tokens'] / max(s['generated'], 1):.0%} of {s['generated']} generated tokens")


if __name__ == "__main__":
    main()
