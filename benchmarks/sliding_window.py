"""Sliding-window layers cost less than full ones on long contexts: one attention layer of Gemma 3 270M's shape
(4 query heads, 1 KV head of 256 dims) through kvql's paged kernel, with its 512-token window and without,
side by side in one run, at growing contexts. Decode: a batch of B requests, one new token each over its C
cached keys; prefill: one chunk of 256 new tokens after C - 256 cached ones. Prints medians and the ratio
full / windowed (> 1: the window saves time).

    .venv/bin/python benchmarks/sliding_window.py [--dtype bfloat16] [--batch 8] [--contexts 512,1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvql.engine.model.kernels import paged_attention

HEADS, KV_HEADS, DIM, WINDOW = 4, 1, 256, 512


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def case(dtype, batch: int, context: int, q_len: int, repeats: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    slots = batch * context
    k_pool = torch.randn(KV_HEADS, slots, DIM, generator=g).to(dtype)
    v_pool = torch.randn(KV_HEADS, slots, DIM, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)  # scattered slots, as in a long-running cache
    t = batch * q_len
    query = torch.randn(HEADS, t, DIM, generator=g).to(dtype)
    out = torch.empty(t, HEADS, DIM, dtype=dtype)
    segs = paged_attention.Segments([i * q_len for i in range(batch)], [q_len] * batch,
                                    [i * context for i in range(batch)], [context] * batch, perm)
    run = lambda window: paged_attention.attend(query, k_pool, v_pool, out, segs, DIM ** -0.5, window)  # noqa: E731
    full, windowed = [], []
    for _ in range(3):  # interleaved: the machine's noise hits both alike
        full.append(median_ms(lambda: run(None), repeats))
        windowed.append(median_ms(lambda: run(WINDOW), repeats))
    return min(full), min(windowed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_attention.available():
        raise SystemExit(f"the paged kernel is not available here: {paged_attention.LIBRARY.error}")
    dtype = getattr(torch, args.dtype)
    print(f"one layer, {HEADS} heads / {KV_HEADS} KV head x {DIM}, window {WINDOW}, {args.dtype}, "
          f"{args.threads} threads; ms (best of 3 medians)")
    print(f"{'context':>8} | {'decode B=' + str(args.batch) + ' full':>18} {'windowed':>9} {'ratio':>6} | "
          f"{'prefill 256 full':>16} {'windowed':>9} {'ratio':>6}")
    for c in map(int, args.contexts.split(",")):
        df, dw = case(dtype, args.batch, c, 1, args.repeats)
        pf, pw = case(dtype, 1, c, 256, max(3, args.repeats // 3))
        print(f"{c:>8} | {df:>18.3f} {dw:>9.3f} {df / dw:>5.2f}x | {pf:>16.2f} {pw:>9.2f} {pf / pw:>5.2f}x")


if __name__ == "__main__":
    main()
