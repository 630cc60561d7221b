"""Cache that survives restarts, in the disk tier's format: write and read-back time and size, and first-request
latency after a restart, warm (`disk_cache=DIR`) vs cold (SmolLM2-135M-Instruct, `kvql.model()`'s default
model, CPU).

What is measured, in one run:
1. A cache of ~N tokens (default 100k): one model with a memory budget that holds them and a disk tier is
   filled with N distinct prompt tokens (prompts of `--prompt-len` random token ids, no shared prefixes, one
   generated token each); then `save_cache()` is timed (what `close` and the idle autosave do: every node only
   memory holds is written as a tier file), with the time it holds the engine (steps wait that long), and
   the files' size read. The model is closed and a new one opened on the directory (start: scan the files,
   rebuild the tree, every node on disk) and every prompt asked again with `max_tokens=1`: each request reads
   its KV back (checksums verified) instead of computing it; that read-back wall time is printed beside the
   time the same prompts took to compute (the fill). The files were just written, so they are read from the
   page cache, as a restart right after a shutdown would. Integrity is checked, and the K/V of a sample
   prompt (all but its last token, which is computed) must be bitwise the same after the read-back.
   `--fill synthetic` skips the prefill (minutes on a busy 2-core CPU): the same prompts go into the tree
   with random K/V written to their slots (no compute time to compare with then).
2. Restart on the few-shot workload of benchmarks/fewshot_qa.py (its shared ~300-token prefix and its
   questions, `max_tokens=10`, `stop=["\\n"]`): a model with `disk_cache` answers every question, is closed
   (which writes the pool's nodes to the tier), then a new model is built on the same weights twice: on the
   same directory (warm: its KV is read back when the first request needs it) and without (cold). For each,
   the time to build the model (the tier's scan included) and the latency of its first request are printed
   side by side, with the answers (they must be equal). Weights are loaded once: a real restart adds the
   same model load time to both.

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
from kvql.engine.cache.fingerprint import fingerprint
from kvql.engine.cache.tier_file import FORMAT
from kvql.engine.cache.kv_pool import KVPool

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


def tier_numbers(hf, tok, tokens: int, prompt_len: int, directory: Path, synthetic: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    count = -(-tokens // prompt_len)
    specials = set(tok.all_special_ids)
    prompts = []
    for _ in range(count):
        ids = torch.randint(0, len(tok), (prompt_len,), generator=g).tolist()
        prompts.append([t if t not in specials else 1000 for t in ids])
    budget = (count * (prompt_len + 2) + 64) * slot_bytes(hf)
    m = Model(hf, tok, name=MODEL, cache_budget=budget, max_batch_tokens=2048, disk_cache=directory,
              cache_save_interval=0)
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

    def sample_kv(model):
        with model.engine._state:
            slots, _ = model.engine.tree.match_prefix(sample)
            return model.engine.pool.k[:, :, slots].clone(), model.engine.pool.v[:, :, slots].clone()

    kv_before = sample_kv(m)
    held = HeldTime(m.engine._state)
    m.engine._state = held  # counts the time save_cache holds the engine
    t0 = time.perf_counter()
    saved = m.save_cache()
    save_s = time.perf_counter() - t0
    m.engine._state = held.lock
    files = [p for p in m.engine.tier.path.iterdir() if p.name.endswith(".safetensors")]
    nbytes = sum(p.stat().st_size for p in files)
    m.close()
    del m
    gc.collect()
    t0 = time.perf_counter()
    b = Model(hf, tok, name=MODEL, cache_budget=budget, max_batch_tokens=2048, disk_cache=directory,
              cache_save_interval=0)
    start_s = time.perf_counter() - t0
    on_disk = b.stats()["tier_tokens"]
    t0 = time.perf_counter()
    again = b.generate(prompts, max_tokens=1)
    read_s = time.perf_counter() - t0
    b.check_integrity()
    kv_after = sample_kv(b)
    read = len(sample) - 1  # the last prompt token is always computed (its K/V, random before, is recomputed)
    same_kv = all(torch.equal(x[:, :, :read], y[:, :, :read]) for x, y in zip(kv_before, kv_after))
    t0 = time.perf_counter()
    fp = fingerprint(hf, tok, b.engine.pool, FORMAT)  # uncached: its cost once per engine
    fp_s = time.perf_counter() - t0
    out = {"tokens": cached, "files": len(files), "bytes": nbytes, "save_s": save_s, "written_tokens": saved["tokens"],
           "save_engine_held_s": held.seconds, "start_s": start_s, "tokens_on_disk_at_start": on_disk,
           "read_back_s": read_s, "read_back_tokens": b.stats()["disk_tokens"], "fingerprint_s": fp_s, "fill_s": fill,
           "same_kv": same_kv, "fill": "synthetic" if synthetic else "prompts",
           "same_output": None if synthetic else [c.token_ids for c in again] == [c.token_ids for c in first]}
    b.close()
    return out


def restart_numbers(hf, tok, directory: Path, n_questions: int) -> dict:
    prompts = [fewshot.PREFIX + fewshot.qa(q) for q, _ in fewshot.QUESTIONS[:n_questions]]
    opts = dict(max_tokens=10, stop=["\n"])
    budget = 256 * 2**20
    first = Model(hf, tok, name=MODEL, cache_budget=budget, disk_cache=directory, cache_save_interval=0)
    answers = first.generate(prompts, **opts)
    first.close()  # writes the pool's nodes to the tier
    size = sum(p.stat().st_size for p in first.engine.tier.path.iterdir())
    rows = {}
    for kind in ("warm", "cold"):
        gc.collect()
        t0 = time.perf_counter()
        m = Model(hf, tok, name=MODEL, cache_budget=budget, disk_cache=directory if kind == "warm" else None,
                  cache_save_interval=0)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        (c,) = m.generate(prompts[:1], **opts)
        latency = time.perf_counter() - t0
        rows[kind] = {"start_s": start_s, "first_request_s": latency, "cached_tokens": c.cached_tokens,
                      "prompt_tokens": c.prompt_tokens, "answer": c.text, "same_as_before": c.text == answers[0].text}
        m.close()
    rows["tier_bytes"] = size
    rows["prefix_tokens"] = len(tok(fewshot.PREFIX).input_ids)
    rows["questions"] = n_questions
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="tokens in the cache of part 1")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--fill", choices=("prompts", "synthetic"), default="prompts",
                    help="prompts: prefill them (real KV); synthetic: random KV in their slots (module doc)")
    ap.add_argument("--questions", type=int, default=24, help="few-shot questions answered before the restart")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--skip-write", action="store_true", help="only part 2 (restart latency)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    hf, tok = load_hf(MODEL, device="cpu", dtype=getattr(torch, args.dtype))
    results = {"config": {"model": MODEL, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "bytes_per_token": slot_bytes(hf)}}
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as d:  # the checkout's disk, not a tmpfs
        if not args.skip_write:
            s = results["tier"] = tier_numbers(hf, tok, args.tokens, args.prompt_len, Path(d) / "write",
                                               args.fill == "synthetic")
            gib = s["bytes"] / 2**30
            compute = f"; computing them took {s['fill_s']:.1f} s" if s["fill"] == "prompts" else ""
            print(f"disk tier, {s['tokens']:,} tokens ({s['files']} files, {args.dtype}): {gib:.2f} GiB on disk | "
                  f"save_cache {s['save_s']:.2f} s ({gib / s['save_s']:.2f} GiB/s; engine held "
                  f"{s['save_engine_held_s']:.2f} s of it) | restart: start {s['start_s']:.2f} s "
                  f"({s['tokens_on_disk_at_start']:,} tokens on disk), every prompt asked again "
                  f"{s['read_back_s']:.2f} s ({s['read_back_tokens']:,} tokens read back{compute}) | "
                  f"fingerprint {s['fingerprint_s'] * 1000:.0f} ms | fill: {s['fill']} | K/V bitwise equal after "
                  f"read-back: {s['same_kv']} | outputs same: {s['same_output']}", flush=True)
        r = results["restart"] = restart_numbers(hf, tok, Path(d) / "restart", args.questions)
    print(f"restart on the few-shot workload ({r['questions']} questions answered before; prefix "
          f"{r['prefix_tokens']} tokens; disk tier {r['tier_bytes'] / 2**20:.1f} MiB):")
    print(f"  {'':6} {'start (s)':>10} {'first request (s)':>18} {'cached/prompt tokens':>21}  answer")
    for kind in ("warm", "cold"):
        w = r[kind]
        print(f"  {kind:6} {w['start_s']:>10.2f} {w['first_request_s']:>18.3f} "
              f"{w['cached_tokens']:>10}/{w['prompt_tokens']:<10}  {w['answer']!r} (same as before: {w['same_as_before']})")
    print(f"  first request: warm is {r['cold']['first_request_s'] / r['warm']['first_request_s']:.1f}x faster")
    out = ROOT / "benchmarks" / "results" / "cache_restart.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
