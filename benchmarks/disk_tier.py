"""Disk tier on vs off (issue 28): a working set several times the RAM cache budget, asked about round-robin.

What is measured (one process, side by side, for each dtype in --dtypes, SmolLM2-135M-Instruct on the CPU)
----------------------------------------------------------------------------------------------------------
- Documents: --docs deterministic texts of ~--doc-tokens tokens each (generated from a seeded word list: reports
  naming people, cities, years and products; no network), each starting with its own title, so no two share
  more than a few leading tokens.
- Passes: three passes over the documents in the same order (round-robin); each request is one document followed
  by a short question (pass 1 asks who wrote it, pass 2 in which city, pass 3 in which year), greedy,
  --new-tokens new tokens, one request at a time (each waits for the one before).
- Two models on the same weights, alternating pass by pass: tier off (`cache_budget` only: LRU eviction drops
  KV) and tier on (the same budget, `disk_cache=` a directory of the checkout's disk: evicted KV is written
  there and read back). The RAM budget holds --ram-docs documents, so round-robin over --docs documents finds
  nothing in RAM after the first pass: without the tier every pass computes every document again.
- Per pass and side: prompt tokens served from RAM / from disk / computed (the engine's `cached_tokens`,
  `disk_tokens`, `computed_tokens` counters over the pass), wall time, and whether the answers are equal to the
  other side's (the same questions: tier on vs off); tier on / off wall time. Beside each wall time, the
  process's CPU seconds (all its threads; other processes on a shared machine inflate them less than the wall
  time) and their ratio, and the 1-minute load average at the end of the pass (over ~2 on 2 cores: other work
  ran meanwhile, the row's times are inflated).
- restart: the tier-on model is closed (the pool's KV is written to the tier too), a new model opens the same
  directory (its start time, the tree rebuilt from the files, is printed) and pass 1's questions are asked
  again: served from disk, answers compared with pass 1's; wall compared with tier off's pass 1.
- What bounds the tier-on passes: of their wall time, the seconds inside the model's forward (the engine's
  `forward_seconds`: the question and the new tokens) and the rest (reading KV back, scheduling, Python), per
  request.
Targets (issue 28): on passes 2 and 3, >= 90% of the prompt tokens from a tier and wall <= 0.3x tier off.
Reads back come from the page cache here (the files were just written), as they would on a machine whose
free memory exceeds the RAM budget; the question tokens (~1% of a prompt) are always computed.
The machine is shared and noisy: only ratios inside one run mean much. Usage:
    .venv/bin/python benchmarks/disk_tier.py [--quick] [--dtypes float32,bfloat16] [--docs 40] [--doc-tokens 1500]
        [--ram-docs 5] [--new-tokens 6] [--threads 2]
--quick: 8 documents of ~500 tokens, a RAM budget of 2, float32 only (~2-3 min on 2 idle cores; bf16, which runs
the plain kernel on an AVX2-only CPU, ~4x longer: --dtypes float32,bfloat16). Results also in
benchmarks/results/disk_tier[_quick].json; the full run takes ~1 h (fp32) and ~2 h (bf16) on 2 busy cores.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

import kvql
from kvql.backends.dtype import resolve
from kvql.backends.loader import load_hf
from kvql.engine.cache.kv_pool import KVPool

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"

FIRST = ["Maria", "Jan", "Akira", "Helen", "Pierre", "Sofia", "Lars", "Amara", "David", "Elena", "Omar", "Ingrid",
         "Kofi", "Mei", "Tomas", "Aisha", "Rafael", "Nina", "Yusuf", "Clara", "Hugo", "Leila", "Viktor", "Ana"]
LAST = ["Lopez", "Kowalski", "Tanaka", "Brooks", "Dubois", "Rossi", "Nilsson", "Okafor", "Cohen", "Petrova",
        "Haddad", "Solberg", "Mensah", "Chen", "Novak", "Rahman", "Silva", "Berg", "Demir", "Fischer"]
CITIES = ["Madrid", "Warsaw", "Osaka", "Chicago", "Lyon", "Milan", "Stockholm", "Lagos", "Boston", "Odessa",
          "Bergen", "Lima", "Accra", "Hanoi", "Porto", "Cairo", "Tromso", "Quito", "Dublin", "Kyoto", "Riga"]
THINGS = ["water pumps", "school buses", "wind turbines", "bicycles", "printing presses", "greenhouses",
          "fishing boats", "solar panels", "bridges", "libraries", "rail cars", "tents", "clocks", "looms"]
ADJ = ["old", "new", "northern", "small", "busy", "quiet", "municipal", "private", "coastal", "regional"]
PLACES = ["harbour", "market", "workshop", "warehouse", "station", "archive", "factory", "museum", "clinic"]
VERBS = ["inspected", "repaired", "counted", "moved", "painted", "measured", "rebuilt", "sold", "bought", "listed"]
TEMPLATES = [
    "In {year}, {who} {verb} {n} {thing} near the {adj} {place} of {city}.",
    "The {adj} {place} in {city} kept {n} {thing}, according to {who}.",
    "{who} wrote that {n} {thing} were {verb} at the {place} before the winter of {year}.",
    "A second team from {city} {verb} the {thing} and found {n} of them in good order.",
    "Prices at the {adj} {place} rose by {pct} percent, and {who} asked the council of {city} to explain why.",
    "Nobody in {city} remembered who had {verb} the {thing} first; the records of {year} were lost.",
    "The report lists {n} {thing}, {m} {thing2} and one {adj} {place} that {who} visited twice.",
]
QUESTIONS = ["Who wrote this report?", "In which city was this report written?", "In which year was this report written?"]


def document(i: int, n_tokens: int, tok) -> str:
    """The i-th document: a title with its author, city and year, then sentences until it has ~n_tokens tokens."""
    rng = random.Random(1000 + i)
    author, city, year = f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.choice(CITIES), rng.randint(1900, 2020)
    head = (f"Report {i + 1}: the {rng.choice(ADJ)} {rng.choice(PLACES)}s of {city}, {year}\n"
            f"Written by {author} in {city} in {year}.\n\n")
    sentences, used = [], len(tok(head)["input_ids"])
    while used < n_tokens:
        s = rng.choice(TEMPLATES).format(
            year=rng.randint(1900, 2020), who=f"{rng.choice(FIRST)} {rng.choice(LAST)}", verb=rng.choice(VERBS),
            n=rng.randint(2, 900), m=rng.randint(2, 90), pct=rng.randint(2, 40), thing=rng.choice(THINGS),
            thing2=rng.choice(THINGS), adj=rng.choice(ADJ), place=rng.choice(PLACES), city=rng.choice(CITIES))
        sentences.append(s + ("\n\n" if rng.random() < 0.15 else " "))
        used += len(tok(s)["input_ids"]) + 1
    return head + "".join(sentences).rstrip()


def prompt(doc: str, p: int) -> str:
    return f"{doc}\n\nQuestion: {QUESTIONS[p % len(QUESTIONS)]}\nAnswer:"


def run_pass(m, prompts: list[list[int]], new_tokens: int):
    """One request at a time; -> (wall seconds, answers, counters over the pass: `cpu` is this process's CPU
    seconds, every thread's, which other processes on a shared machine inflate less than the wall time)."""
    before, t0, c0 = m.stats(), time.perf_counter(), time.process_time()
    answers = [m.generate([ids], max_tokens=new_tokens, temperature=0)[0].token_ids for ids in prompts]
    wall, cpu, after = time.perf_counter() - t0, time.process_time() - c0, m.stats()
    d = {k: after.get(k, 0) - before.get(k, 0)
         for k in ("prompt_tokens", "cached_tokens", "disk_tokens", "forward_seconds", "tier_read_tokens")}
    d["cpu"] = cpu
    d["ram_tokens"] = d["cached_tokens"] - d["disk_tokens"]
    d["computed_tokens"] = d["prompt_tokens"] - d["cached_tokens"]
    return wall, answers, d


def fmt(d: dict) -> str:
    p = d["prompt_tokens"] or 1
    return f"{d['ram_tokens'] / p:5.0%} {d['disk_tokens'] / p:5.0%} {d['computed_tokens'] / p:5.0%}"


def bench_dtype(dtype_name: str, a, directory: Path) -> list[dict]:
    dtype = resolve(dtype_name, "cpu")
    hf, tok = load_hf(MODEL, dtype=dtype)
    docs = [document(i, a.doc_tokens, tok) for i in range(a.docs)]
    passes = [[tok(prompt(d, p))["input_ids"] for d in docs] for p in range(3)]
    doc_len = max(len(tok(d)["input_ids"]) for d in docs)
    slot = KVPool.slot_bytes(num_layers=hf.config.num_hidden_layers, kv_heads=hf.config.num_key_value_heads,
                             head_dim=hf.config.hidden_size // hf.config.num_attention_heads, dtype=hf.dtype)
    budget = a.ram_docs * (doc_len + 32) * slot
    tier = directory / dtype_name
    opts = dict(name=MODEL, cache_budget=budget, max_batch_tokens=a.max_batch_tokens)
    off = kvql.Model(hf, tok, **opts)
    on = kvql.Model(hf, tok, **opts, disk_cache=tier, disk_budget="20GiB")
    print(f"\n{MODEL} {dtype_name}: {a.docs} documents of ~{doc_len} tokens, RAM budget {budget / 2**20:.0f} MiB "
          f"= {budget // slot:,} tokens (~{a.ram_docs} documents), {slot / 1024:.0f} KiB per token, "
          f"{a.new_tokens} new tokens per question", flush=True)
    print(f"{'pass':8} | {'tier off: ram  disk  comp':>25} {'wall s':>7} {'cpu s':>6} | "
          f"{'tier on: ram  disk  comp':>24} {'wall s':>7} {'cpu s':>6} | {'on/off':>6} {'(cpu)':>6} {'equal':>5} "
          f"{'load':>4}", flush=True)
    rows, answers = [], {}
    try:
        for p in range(3):
            w_off, a_off, d_off = run_pass(off, passes[p], a.new_tokens)
            w_on, a_on, d_on = run_pass(on, passes[p], a.new_tokens)
            answers[p] = a_on
            rows.append({"dtype": dtype_name, "pass": p + 1, "off": {"wall": w_off, **d_off},
                         "on": {"wall": w_on, **d_on}, "ratio": w_on / w_off, "equal": a_on == a_off,
                         "equal_count": sum(x == y for x, y in zip(a_on, a_off))})
            r = rows[-1]
            print(f"{p + 1:<8} | {fmt(d_off):>25} {w_off:7.1f} {d_off['cpu']:6.1f} | {fmt(d_on):>24} {w_on:7.1f} "
                  f"{d_on['cpu']:6.1f} | {r['ratio']:5.2f}x {d_on['cpu'] / d_off['cpu']:5.2f}x "
                  f"{r['equal_count']:>2}/{len(a_on)} {os.getloadavg()[0]:4.1f}", flush=True)
        tier_stats = {k: v for k, v in on.stats().items() if k.startswith("tier_")}
        on.engine.tier.flush()
        on.close()
        del on
        gc.collect()
        t0 = time.perf_counter()
        again = kvql.Model(hf, tok, **opts, disk_cache=tier, disk_budget="20GiB")
        start = time.perf_counter() - t0
        try:
            w, a_re, d = run_pass(again, passes[0], a.new_tokens)
        finally:
            again.close()
        off_1 = rows[0]["off"]["wall"]
        eq = sum(x == y for x, y in zip(a_re, answers[0]))
        rows.append({"dtype": dtype_name, "pass": "restart", "on": {"wall": w, **d}, "start_s": start,
                     "ratio": w / off_1, "equal": a_re == answers[0], "equal_count": eq, "tier": tier_stats})
        cpu_1 = rows[0]["off"]["cpu"]
        print(f"{'restart':8} | {'(pass 1 again)':>25} {off_1:7.1f} {cpu_1:6.1f} | {fmt(d):>24} {w:7.1f} "
              f"{d['cpu']:6.1f} | {w / off_1:5.2f}x {d['cpu'] / cpu_1:5.2f}x {eq:>2}/{len(a_re)} "
              f"{os.getloadavg()[0]:4.1f}  (start {start:.1f} s; answers vs pass 1's)", flush=True)
        print(f"tier: {tier_stats.get('tier_bytes', 0) / 2**30:.2f} GiB on disk, written "
              f"{tier_stats.get('tier_written_tokens', 0):,} tokens, read {tier_stats.get('tier_read_tokens', 0):,}, "
              f"failed reads {tier_stats.get('tier_failed_reads', 0)}", flush=True)
    finally:
        off.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 documents of ~500 tokens, RAM for 2, float32 (~2-3 min)")
    ap.add_argument("--dtypes", default=None, help="default float32,bfloat16; --quick float32")
    ap.add_argument("--docs", type=int, default=None, help="documents (default 40; --quick 8)")
    ap.add_argument("--doc-tokens", type=int, default=None, help="tokens per document (default 1500; --quick 500)")
    ap.add_argument("--ram-docs", type=int, default=None, help="documents the RAM budget holds (default 5; --quick 2)")
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    a.docs = a.docs or (8 if a.quick else 40)
    a.doc_tokens = a.doc_tokens or (500 if a.quick else 1500)
    a.ram_docs = a.ram_docs or (2 if a.quick else 5)
    a.dtypes = a.dtypes or ("float32" if a.quick else "float32,bfloat16")
    torch.set_num_threads(a.threads)
    rows, out = [], ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix="disk-tier-") as d:  # the checkout's disk, not a tmpfs
        for dtype_name in a.dtypes.split(","):
            rows += bench_dtype(dtype_name, a, Path(d))
            gc.collect()
    tiered = [r for r in rows if r["pass"] != 1]
    if tiered:
        wall = sum(r["on"]["wall"] for r in tiered)
        forward = sum(r["on"]["forward_seconds"] for r in tiered)
        read = sum(r["on"]["tier_read_tokens"] for r in tiered)
        print(f"\ntier on, passes 2-3 and restart: {forward:.1f} of {wall:.1f} s wall in the model's forward (the question "
              f"and the new tokens); the rest, {wall - forward:.1f} s, is reading back {read:,} tokens' KV, scheduling "
              f"and Python: {1000 * (wall - forward) / len(tiered) / a.docs:.0f} ms per request")
    later = [r for r in rows if r["pass"] in (2, 3)]
    if later:
        served = min((r["on"]["cached_tokens"]) / r["on"]["prompt_tokens"] for r in later)
        ratio = max(r["ratio"] for r in later)
        print(f"\ntargets on passes 2-3 (issue 28): served from a tier >= 90%: {served:.1%} "
              f"({'met' if served >= 0.9 else 'MISSED'}); wall on/off <= 0.3x: {ratio:.2f}x "
              f"({'met' if ratio <= 0.3 else 'MISSED'}); answers equal: "
              f"{all(r['equal'] for r in rows)}")
    (out / f"disk_tier{'_quick' if a.quick else ''}.json").write_text(json.dumps({"args": vars(a), "rows": rows},
                                                                                   indent=1, default=str))


if __name__ == "__main__":
    main()
