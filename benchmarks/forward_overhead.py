"""Forward overhead: kvql's `ModelRunner.forward` vs a plain transformers forward of the same batch.

What is measured (SmolLM2-135M, CPU, each dtype in --dtypes; one process, side by side)
-------------------------------------------------------------------------------------
- decode: one batch-B decode step (one new token per request) at C tokens of context each.
  kvql: `ModelRunner.forward` over B segments whose past is in the KV pool; each request's past is a
  prompt of C - D tokens (one contiguous slot run, as a fresh pool hands them out) plus D tokens decoded
  B-at-a-time (their slots interleave with the other requests', as in the engine).
  plain: the model's own forward of `input_ids [B, 1]` over a contiguous `DynamicCache` of `[B, C]`
  (equal lengths: no padding, no mask; the cache is cropped back after each step).
  kvql's side runs its own copy of the model, set up as the engine sets it up (on a CPU: prepacked
  linear weights and, in reduced precision, batch-invariant long reductions: kvql.engine.model.cpu_linear);
  the plain side the model as loaded.
- kvql module path: kvql's side again through the model's own forward (transformers' modules), the lean
  forward (kvql.engine.model.lean_model) off: what the lean forward saves.
- prefill: B prompts of C tokens, no cache, in one forward. kvql: `ModelRunner.forward` over B segments
  (tokens flattened to [1, B*C]); plain: `input_ids [B, C]` (causal SDPA, no mask). Both return the
  logits of each prompt's last token only.
Timings alternate kvql / plain in each repeat; medians are reported, and the ratio kvql / plain of the
medians (targets from issue 12: decode <= 1.2, prefill <= 1.1, i.e. prefill tokens/s >= 1/1.1 of plain).

Per-part timings (kvql, from torch.profiler over a few extra steps, ms per step; the profiler itself
adds some overhead to every op): plan (building the attention plan, a manual timer), gather (K/V
index_select from the pool), cat (torch.cat: rotary's rotate_half, and the plain forward's DynamicCache
update), write (index_copy_ of new K/V into the pool), sdpa (SDPA kernels), linear
(matmuls), rest (everything else inside the forward: norms, rotary, activations, python). The plain
forward is split the same way (its "gather" is the DynamicCache's torch.cat).

Engine thread: the kvql decode step called on a second thread (as kvql's engine thread calls it) while
this thread keeps the OpenMP worker pool its plain forward left, vs after releasing it (kvql.engine.openmp:
with more OpenMP threads alive than CPUs, GNU libgomp's workers sleep between parallel regions).

Batch invariance (--invariance N, default 24): N fuzz prompts (random token ids sharing prefixes of 0,
5, 17 or 40 tokens, as tests/test_exactness.py's; --invariance-prefixes for others) generated greedily (16 tokens) by kvql's engine all at
once, vs each prompt alone on an empty cache, vs the uncached reference (a plain forward of the whole
sequence per token); counted for the batch-invariant attention (default in reduced precision) and the
merging one (default in fp32), with the time of the batched generate of each.

The machine is shared and noisy: only ratios inside one run mean much. Usage:
    .venv/bin/python benchmarks/forward_overhead.py [--dtypes float32,bfloat16] [--batch 24] [--context 330]
        [--decoded 32] [--repeats 15] [--prefill-repeats 3] [--threads 1] [--no-profile]
        [--skip-timing] [--invariance 24] [--invariance-prefixes 0,5,17,40]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from kvql.backends.loader import load_hf
from kvql.engine.model import attention_plan
from kvql.engine import openmp
from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.model.model_runner import ModelRunner, read_geometry, Segment

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def side_by_side(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median and minimum seconds of each function, calls alternating within each repeat."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(seconds(fn))
    return {k: statistics.median(v) for k, v in times.items()}, {k: min(v) for k, v in times.items()}


PARTS = {
    "gather": ("aten::index_select",),
    "cat": ("aten::cat",),
    "write": ("aten::index_copy_",),
    "sdpa": ("aten::scaled_dot_product_attention",),
    "linear": ("aten::linear", "mkldnn::_linear_pointwise"),
}


def profile_parts(fn, steps: int) -> dict:
    """ms per step of each part of PARTS (cpu_time_total of the named ops) and of the whole forward."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        total = time.perf_counter() - t
    avg = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    parts = {k: sum(avg.get(op, 0.0) for op in ops) for k, ops in PARTS.items()}
    parts["total"] = total * 1e3 / steps
    return parts


def fuzz_prompts(seed: int, count: int, vocab: int, prefix_lengths=(0, 5, 17, 40), suffix=(1, 12)):
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randint(100, vocab, (max(prefix_lengths),), generator=g).tolist() for _ in range(3)]
    prompts = []
    for i in range(count):
        k = prefix_lengths[int(torch.randint(len(prefix_lengths), (1,), generator=g))]
        n = int(torch.randint(suffix[0], suffix[1] + 1, (1,), generator=g))
        prompts.append(bases[i % 3][:k] + torch.randint(100, vocab, (n,), generator=g).tolist())
    return prompts


@torch.inference_mode()
def reference_greedy(hf, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        tok = int(torch.argmax(hf(input_ids=torch.tensor([ids])).logits[0, -1]))
        if tok == eos:
            break
        out.append(tok)
        ids.append(tok)
    return out


def invariance(hf, tokenizer, count: int, max_tokens: int = 16, prefixes=(0, 5, 17, 40)) -> dict:
    """Greedy outputs of `count` fuzz prompts (sharing prefixes of `prefixes` tokens) batched vs alone vs the
    uncached reference, per attention mode."""
    import kvql

    prompts = fuzz_prompts(1, count, hf.config.vocab_size, prefix_lengths=prefixes)
    eos = tokenizer.eos_token_id
    ref = [reference_greedy(hf, p, max_tokens, eos) for p in prompts]
    m = kvql.Model(hf, tokenizer, cache_budget="256MB", background=False)
    result = {}
    try:
        for mode in (True, False):
            m.engine.runner.batch_invariant = mode
            m.clear_cache()
            t = time.perf_counter()
            batched = [c.token_ids for c in m.generate(prompts, max_tokens=max_tokens)]
            took = time.perf_counter() - t
            alone = []
            for p in prompts:
                m.clear_cache()
                alone.append(m.generate([p], max_tokens=max_tokens)[0].token_ids)
            result["invariant" if mode else "merging"] = {
                "batched_eq_alone": sum(a == b for a, b in zip(batched, alone)),
                "batched_eq_reference": sum(a == b for a, b in zip(batched, ref)),
                "alone_eq_reference": sum(a == b for a, b in zip(alone, ref)),
                "batched_seconds": took}
    finally:
        m.close()
    return result


@torch.inference_mode()
def run_dtype(name: str, args) -> dict:
    dtype = DTYPES[name]
    hf, tokenizer = load_hf(args.model, dtype=dtype)
    if args.skip_timing:
        return {"dtype": name, "invariance": invariance(hf, tokenizer, args.invariance, prefixes=args.prefixes)}
    cfg = hf.config
    B, C, D = args.batch, args.context, min(args.decoded, args.context - 1)
    engine_model = load_hf(args.model, dtype=dtype)[0]
    geometry = read_geometry(engine_model)  # the model's layers as the engine runs them
    pool = KVPool(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads, head_dim=geometry.head_dim,
                  num_slots=B * (C + 1) + B * (C + 1), dtype=dtype, device="cpu")
    pool.k.zero_(), pool.v.zero_()  # touch the pool's pages once, as a long-running server has
    # its own copy of the model: the runner sets it up as the engine runs it (on a CPU prepacked linear
    # weights, in bf16 long reductions split to be batch-invariant: kvql.engine.model.cpu_linear), which the
    # plain side must not get
    runner = ModelRunner(engine_model, pool, geometry)

    def module_path(fn):  # the same runner through the model's own forward: the lean forward off (lean_model.py)
        def run():
            lean, runner.lean = runner.lean, None
            try:
                return fn()
            finally:
                runner.lean = lean
        return run

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, cfg.vocab_size - 100, (B, C + 1), generator=g)
    empty = torch.empty(0, dtype=torch.long)

    # -- prefill: B prompts of C tokens in one forward ------------------------------------------
    pre_slots = [pool.alloc(C) for _ in range(B)]
    pre_segments = [Segment(tokens[i, :C].tolist(), 0, empty, pre_slots[i], True) for i in range(B)]
    prefill = {
        "kvql": lambda: runner.forward(pre_segments),
        "plain": lambda: hf(input_ids=tokens[:, :C], logits_to_keep=1),
        "kvql module path": module_path(lambda: runner.forward(pre_segments)),
    }
    k = min(B, 4)  # warm-up, and the profiled prefill: the first k prompts
    small = {"kvql": lambda: runner.forward(pre_segments[:k]),
             "plain": lambda: hf(input_ids=tokens[:k, :C], logits_to_keep=1)}
    for fn in small.values():
        fn()
    pre, pre_min = side_by_side(prefill, args.prefill_repeats) if args.prefill_repeats else (None, None)

    # -- decode: the past of request i is a prompt run of C - D slots plus D interleaved decode slots --
    P = C - D
    slots = [pool.alloc(P) for _ in range(B)]
    runner.forward([Segment(tokens[i, :P].tolist(), 0, empty, slots[i], True) for i in range(B)])
    for d in range(D + 1):
        new = [pool.alloc(1) for _ in range(B)]
        step = [Segment([int(tokens[i, P + d])], P + d, slots[i], new[i], True) for i in range(B)]
        if d < D:
            runner.forward(step)
            slots = [torch.cat([slots[i], new[i]]) for i in range(B)]
    decode_segments = step  # token C of each request over its C cached slots
    cache = DynamicCache(config=cfg)
    hf(input_ids=tokens[:, :C], cache=cache, logits_to_keep=1)
    for layer in cache.layers:  # a sliding-window layer keeps its window only: let crop roll a step back
        getattr(layer, "activate_past_recording", lambda: None)()
    step_ids, step_pos = tokens[:, C:C + 1], torch.full((B, 1), C)

    def plain_decode():
        out = hf(input_ids=step_ids, position_ids=step_pos, cache=cache)
        cache.crop(-1)
        return out.logits[:, -1].float()

    decode = {"kvql": lambda: runner.forward(decode_segments), "plain": plain_decode,
              "kvql module path": module_path(lambda: runner.forward(decode_segments))}
    kv_logits = torch.cat(decode["kvql"]())  # kvql's default attention mode for the dtype
    diff = float((kv_logits - plain_decode()).abs().max())
    dec, dec_min = side_by_side(decode, args.repeats)

    # attention modes: unshared (as above) and shared (all requests' pasts share request 0's prompt run)
    shared = [Segment(sg.token_ids, C, torch.cat([slots[0][:P], slots[i][P:]]), sg.new_slots, True)
              for i, sg in enumerate(decode_segments)]
    default = getattr(runner, "batch_invariant", False)  # (a runner without the switch: both modes the same)

    def step(segments, invariant):
        runner.batch_invariant = invariant
        return lambda: runner.forward(segments)

    modes, _ = side_by_side({"unshared merging": step(decode_segments, False),
                          "unshared invariant": step(decode_segments, True),
                          "shared merging": step(shared, False), "shared invariant": step(shared, True)},
                         args.repeats)
    runner.batch_invariant = default
    threads = engine_thread(decode["kvql"], plain_decode, args.repeats)
    result = {"dtype": name, "engine_thread": threads, "prefill": pre, "prefill_min": pre_min, "decode": dec, "decode_min": dec_min,
              "decode_max_abs_logit_diff": diff,
              "prefill_tokens_per_s": pre and {k: B * C / v for k, v in pre.items()}, "modes": modes}
    def plan_of(segments):  # the plan the runner builds (paged on a CPU with the kernel)
        return lambda: attention_plan.plan(segments, runner.groups, pool.device, paged=runner.paged)

    plan_times = [seconds(plan_of(decode_segments)) for _ in range(args.repeats)]
    pre_plan = [seconds(plan_of(pre_segments[:k])) for _ in range(3)]
    if args.profile:
        result["decode_parts"] = {"kvql": profile_parts(decode["kvql"], 5), "plain": profile_parts(plain_decode, 5)}
        result["prefill_parts"] = {"kvql": profile_parts(small["kvql"], 1), "plain": profile_parts(small["plain"], 1)}
        result["decode_parts"]["kvql"]["plan"] = statistics.median(plan_times) * 1e3
        result["prefill_parts"]["kvql"]["plan"] = statistics.median(pre_plan) * 1e3
    if args.invariance:
        result["invariance"] = invariance(hf, tokenizer, args.invariance, prefixes=args.prefixes)
    return result


def engine_thread(step, caller_work, repeats: int) -> dict:
    """The kvql decode step called on a second thread, as the engine thread calls it, while this thread
    keeps the OpenMP worker pool its own work (`caller_work`) left, or after releasing it
    (kvql.engine.openmp): median seconds of each, alternating."""
    def on_thread(release: bool) -> float:
        caller_work()
        if release:
            openmp.release()
        times = []
        t = threading.Thread(target=lambda: times.extend(seconds(step) for _ in range(3)))
        t.start()
        t.join()
        return statistics.median(times)
    runs = {"caller pool kept": [], "caller pool released": []}
    for _ in range(max(3, repeats // 3)):
        for k in runs:
            runs[k].append(on_thread(k.endswith("released")))
    openmp.release()
    return {k: statistics.median(v) for k, v in runs.items()}


def _min_ratio(minima: dict | None) -> str:
    return f"{minima['kvql'] / minima['plain']:.2f}" if minima else "-"


def report(r: dict, args) -> None:
    B, C = args.batch, args.context
    print(f"\n== {r['dtype']} ==  (batch {B}, context {C}, threads {torch.get_num_threads()})")
    d, p = r.get("decode"), r.get("prefill")
    if d:
        print(f"decode step   kvql {d['kvql'] * 1e3:8.1f} ms   plain {d['plain'] * 1e3:8.1f} ms   "
              f"kvql/plain {d['kvql'] / d['plain']:.2f}  (target <= 1.20; of minima {_min_ratio(r.get('decode_min'))})   "
              f"max |logit diff| {r['decode_max_abs_logit_diff']:.2e}")
        print(f"  kvql through the model's own forward (lean forward off) {d['kvql module path'] * 1e3:8.1f} ms   "
              f"lean / module path {d['kvql'] / d['kvql module path']:.2f}")
    if "engine_thread" in r:
        e = r["engine_thread"]
        print("decode step on a second thread (as the engine runs it), this thread's OpenMP pool "
              + "  ".join(f"{k.split()[-1]} {v * 1e3:.1f} ms" for k, v in e.items())
              + f"  kept/released {e['caller pool kept'] / e['caller pool released']:.2f}")
    if "modes" in r:
        m = r["modes"]
        print("decode step by attention mode (ms; 'shared': every past starts with one common run of "
              f"{C - args.decoded} slots): " + "  ".join(f"{k} {v * 1e3:.1f}" for k, v in m.items()))
        print(f"  invariant / merging: unshared {m['unshared invariant'] / m['unshared merging']:.2f}  "
              f"shared {m['shared invariant'] / m['shared merging']:.2f}")
    tps = r.get("prefill_tokens_per_s")
    if tps:
        print(f"prefill       kvql {tps['kvql']:8.0f} tok/s plain {tps['plain']:8.0f} tok/s "
              f"kvql/plain time {p['kvql'] / p['plain']:.2f}  (target <= 1.10; of minima {_min_ratio(r.get('prefill_min'))})")
        print(f"  kvql through the model's own forward (lean forward off) {tps['kvql module path']:8.0f} tok/s   "
              f"lean / module path time {p['kvql'] / p['kvql module path']:.2f}")
    for what in ("decode_parts", "prefill_parts"):
        if what not in r:
            continue
        print(f"  {what.split('_')[0]} parts, ms/step (profiled{'' if what == 'decode_parts' else f', {min(B, 4)} prompts'}):")
        for who, parts in r[what].items():
            named = sum(v for k, v in parts.items() if k != "total")
            cols = "  ".join(f"{k} {parts[k]:7.1f}" for k in ("plan", "gather", "cat", "write", "sdpa", "linear") if k in parts)
            print(f"    {who:5s} total {parts['total']:7.1f}  {cols}  rest {parts['total'] - named:7.1f}")
    if "invariance" in r:
        print(f"  batch invariance ({args.invariance} fuzz prompts sharing prefixes of {args.prefixes} tokens, "
              "16 greedy tokens; attention mode):")
        for mode, c in r["invariance"].items():
            print(f"  {mode:9s} batched==alone {c['batched_eq_alone']:2d}/{args.invariance}  "
                  f"batched==uncached reference {c['batched_eq_reference']:2d}  "
                  f"alone==reference {c['alone_eq_reference']:2d}  batched generate {c['batched_seconds']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--context", type=int, default=330)
    ap.add_argument("--decoded", type=int, default=32, help="tokens of each context decoded step by step")
    ap.add_argument("--repeats", type=int, default=15, help="decode repeats (medians)")
    ap.add_argument("--prefill-repeats", type=int, default=3, help="0: no full-size prefill timing")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine 2 threads stall when the other core is busy)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--skip-timing", action="store_true", help="only the batch-invariance count")
    ap.add_argument("--invariance", type=int, default=24, help="fuzz prompts for the batch-invariance count (0: skip)")
    ap.add_argument("--invariance-prefixes", dest="prefixes", default=(0, 5, 17, 40),
                    type=lambda v: tuple(int(x) for x in v.split(",")),
                    help="lengths of the prefixes the fuzz prompts share, e.g. 0,200,450,700 (default 0,5,17,40)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [run_dtype(name.strip(), args) for name in args.dtypes.split(",")]
    for r in results:
        report(r, args)
    print("\nsummary (kvql / plain time; decode target <= 1.20, prefill <= 1.10):")
    for r in results:
        if "decode" not in r:
            continue
        pre = r["prefill"] and f"{r['prefill']['kvql'] / r['prefill']['plain']:.2f}"
        print(f"  {r['dtype']:9s} decode {r['decode']['kvql'] / r['decode']['plain']:.2f}   prefill {pre or '-'}")


if __name__ == "__main__":
    main()
