"""Cache that survives restarts: snapshot save/load time and size, and first-request latency after a
restart, warm snapshot vs cold (SmolLM2-135M-Instruct, `kvql.model()`'s default model, CPU).

What is measured, in one run:
1. Snapshot of ~N tokens (default 100k): one model with a cache budget that holds them is filled with
   N distinct prompt tokens (prompts of `--prompt-len` random token ids, no shared prefixes, one
   generated token each); then `save_cache(path)` is timed, the file size read, the cache cleared,
   and `load_cache(path)` timed (the same work a start with `cache_dir` does: read, verify the
   checksum, copy the KV into the pool, rebuild the tree). The file was just written, so the load
   reads it from the page cache, as a restart right after a shutdown would. Integrity is checked,
   the K/V of a sample prompt must be bitwise the same after the load, and with `--fill prompts` one
   prompt's greedy output is compared with and without the loaded cache.
   `--fill synthetic` skips the prefill (minutes on a busy 2-core CPU): the same prompts go into the
   tree with random K/V written to their slots. Save and load cost depends only on the token count
   and tree shape, not on the values, so the times are those of a real cache of that shape.
2. Restart on the few-shot workload of benchmarks/fewshot_qa.py (its shared ~300-token prefix and its
   questions, `max_tokens=10`, `stop=["\\n"]`): a model with `cache_dir` answers every question, is
   closed (which saves the snapshot), then a new model is built on the same weights twice: with the
   same `cache_dir` (warm: the snapshot is loaded at start) and without (cold). For each, the time to
   build the model (snapshot load included) and the latency of its first request (the first question)
   are printed side by side, with the answers (they must be equal). Weights are loaded once: a real
   restart adds the same model load time to both.

Usage: python benchmarks/cache_restart.py [--tokens 100000] [--prompt-len 1000] [--fill prompts|synthetic]
       [--questions 24] [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
from kvql.backends.loader import load_hf  # noqa: E402
from kvql import Model  # noqa: E402
from kvql.engine import snapshot  # noqa: E402
from kvql.engine.kv_pool import KVPool  # noqa: E402

spec = importlib.util.spec_from_file_location("fewshot_qa", ROOT / "benchmarks" / "fewshot_qa.py")
fewshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fewshot)

MODEL = "smollm2-135m"


def slot_bytes(hf) -> int:
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVPool.slot_bytes(num_layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=head_dim,
                             dtype=hf.dtype)


class HeldTime:
    """The engine's lock, counting the seconds it is held (the time steps would wait for a save)."""

    def __init__(self, lock):
        self.lock, self.seconds = lock, 0.0

    def __enter__(self):
        self.lock.acquire()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self.t0
        self.lock.release()


def snapshot_numbers(hf, tok, tokens: int, prompt_len: int, directory: Path, synthetic: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    count = -(-tokens // prompt_len)
    specials = set(tok.all_special_ids)
    prompts = []
    for _ in range(count):
        ids = torch.randint(0, len(tok), (prompt_len,), generator=g).tolist()
        prompts.append([t if t not in specials else 1000 for t in ids])
    budget = (count * (prompt_len + 2) + 64) * slot_bytes(hf)
    m = Model(hf, tok, name=MODEL, cache_budget=budget, max_batch_tokens=2048)
    t0 = time.perf_counter()
    if synthetic:
        e = m.engine
        with e._state:  # between steps, as the engine would insert computed prompts
            for ids in prompts:
                slots = e.pool.alloc(len(ids))
                e.pool.k[:, :, slots] = torch.randn(e.pool.k.shape[0], e.pool.k.shape[1], len(ids), e.pool.k.shape[3],
                                                    dtype=e.pool.k.dtype)
                e.pool.v[:, :, slots] = torch.randn_like(e.pool.k[:, :, slots])
                e.tree.insert(ids, slots)
        first = None
    else:
        first = m.generate(prompts, max_tokens=1)
    fill = time.perf_counter() - t0
    cached = m.engine.tree.total_tokens
    sample = prompts[len(prompts) // 2]

    def sample_kv():
        slots, _ = m.engine.tree.match_prefix(sample)
        return m.engine.pool.k[:, :, slots].clone(), m.engine.pool.v[:, :, slots].clone()

    kv_before = sample_kv()
    path = directory / "snapshot.safetensors"
    held = HeldTime(m.engine._state)
    t0 = time.perf_counter()
    saved = snapshot.write(m.engine.tree, m.engine.pool, path, m.engine.fingerprint(), held).commit()
    save_s = time.perf_counter() - t0  # Engine.save_cache, with the time the engine is held counted
    held_s = held.seconds
    m.clear_cache()
    t0 = time.perf_counter()
    loaded = m.load_cache(path)
    load_s = time.perf_counter() - t0
    m.check_integrity()
    kv_after = sample_kv()
    same_kv = all(torch.equal(a, b) for a, b in zip(kv_before, kv_after)) and kv_after[0].shape[2] == len(sample)
    again = None if synthetic else m.generate(prompts[:1], max_tokens=1)
    t0 = time.perf_counter()
    fp = snapshot.fingerprint(hf, tok, m.engine.pool)  # uncached: its cost once per engine
    fp_s = time.perf_counter() - t0
    out = {"tokens": cached, "nodes": saved["nodes"], "bytes": saved["bytes"], "save_s": save_s, "load_s": load_s,
           "save_engine_held_s": held_s,
           "loaded_tokens": loaded["tokens"], "fingerprint_s": fp_s, "fill_s": fill,
           "same_kv": same_kv, "fill": "synthetic" if synthetic else "prompts",
           "same_output": None if synthetic else again[0].token_ids == first[0].token_ids,
           "cached_after_load": None if synthetic else again[0].cached_tokens, "fingerprint": fp}
    m.close()
    del m
    gc.collect()
    path.unlink()
    return out


def restart_numbers(hf, tok, directory: Path, n_questions: int) -> dict:
    prompts = [fewshot.PREFIX + fewshot.qa(q) for q, _ in fewshot.QUESTIONS[:n_questions]]
    opts = dict(max_tokens=10, stop=["\n"])
    budget = 256 * 2**20
    first = Model(hf, tok, name=MODEL, cache_budget=budget, cache_dir=directory, cache_save_interval=0)
    answers = first.generate(prompts, **opts)
    first.close()  # saves the snapshot
    size = first.cache_dir.path.stat().st_size
    rows = {}
    for kind in ("warm", "cold"):
        gc.collect()
        t0 = time.perf_counter()
        m = Model(hf, tok, name=MODEL, cache_budget=budget, cache_dir=directory if kind == "warm" else None,
                  cache_save_interval=0)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        (c,) = m.generate(prompts[:1], **opts)
        latency = time.perf_counter() - t0
        rows[kind] = {"start_s": start_s, "first_request_s": latency, "cached_tokens": c.cached_tokens,
                      "prompt_tokens": c.prompt_tokens, "answer": c.text, "same_as_before": c.text == answers[0].text}
        m.close()
    rows["snapshot_bytes"] = size
    rows["prefix_tokens"] = len(tok(fewshot.PREFIX).input_ids)
    rows["questions"] = n_questions
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="tokens in the snapshot of part 1")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--fill", choices=("prompts", "synthetic"), default="prompts",
                    help="prompts: prefill them (real KV); synthetic: random KV in their slots (module doc)")
    ap.add_argument("--questions", type=int, default=24, help="few-shot questions answered before the restart")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--skip-snapshot", action="store_true", help="only part 2 (restart latency)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    hf, tok = load_hf(MODEL, device="cpu", dtype=getattr(torch, args.dtype))
    results = {"config": {"model": MODEL, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "bytes_per_token": slot_bytes(hf)}}
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as d:  # the checkout's disk, not a tmpfs
        if not args.skip_snapshot:
            s = results["snapshot"] = snapshot_numbers(hf, tok, args.tokens, args.prompt_len, Path(d),
                                                           args.fill == "synthetic")
            print(f"snapshot of {s['tokens']:,} tokens ({s['nodes']} nodes, {args.dtype}): "
                  f"{s['bytes'] / 2**30:.2f} GiB on disk | save {s['save_s']:.2f} s "
                  f"(engine held {s['save_engine_held_s']:.2f} s of it) | load {s['load_s']:.2f} s "
                  f"({s['bytes'] / 2**30 / s['save_s']:.2f} / {s['bytes'] / 2**30 / s['load_s']:.2f} GiB/s) | "
                  f"fingerprint {s['fingerprint_s'] * 1000:.0f} ms | "
                  f"fill: {s['fill']}, {s['fill_s']:.0f} s | K/V bitwise equal after load: {s['same_kv']} | "
                  f"output after load same: {s['same_output']} (cached {s['cached_after_load']})", flush=True)
        r = results["restart"] = restart_numbers(hf, tok, Path(d) / "restart", args.questions)
    print(f"restart on the few-shot workload ({r['questions']} questions answered before; prefix "
          f"{r['prefix_tokens']} tokens; snapshot {r['snapshot_bytes'] / 2**20:.1f} MiB):")
    print(f"  {'':6} {'start (s)':>10} {'first request (s)':>18} {'cached/prompt tokens':>21}  answer")
    for kind in ("warm", "cold"):
        w = r[kind]
        print(f"  {kind:6} {w['start_s']:>10.2f} {w['first_request_s']:>18.3f} "
              f"{w['cached_tokens']:>10}/{w['prompt_tokens']:<10}  {w['answer']!r} (same as before: {w['same_as_before']})")
    print(f"  first request: warm is {r['cold']['first_request_s'] / r['warm']['first_request_s']:.1f}x faster")
    out = ROOT / "benchmarks" / "results" / "cache_restart.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
