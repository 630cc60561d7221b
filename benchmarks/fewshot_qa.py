"""Few-shot QA benchmark: kvql vs Hugging Face generation on SmolLM2-135M-Instruct (CPU, fp32 or bf16, greedy).

What is measured
----------------
Workload "shared": one few-shot prefix (~300 tokens of "Q: ...\\nA: ...\\n" pairs) followed by N different
questions (prompt = prefix + "Q: <question>\\nA:"), at most 10 new tokens, greedy, stop at the first token that
contains a newline. The answer of a prompt is the generated text before the first "\\n", stripped.

Systems, run side by side in one process (every HF system uses the same loaded weights):
  1. hf_one_at_a_time  HF `generate`, one prompt at a time. Its answers are the reference.
  2. hf_padded         HF `generate`, all prompts in one left-padded batch with an attention mask.
  3. hf_generate_batch HF continuous batching (`model.generate_batch`, paged attention, block-level prefix
                       sharing), on its own copy of the model; its "hit rate" is the share of prompt tokens
                       that its prefix matcher reused.
  4. oracle            hand-written prefix sharing: the prefix is prefilled once into a DynamicCache, the cache
                       is repeated to N rows, the suffixes are left-padded right after the prefix (2-D mask over
                       prefix + padding + suffix, positions from the mask), then one batched `generate`.
  5. kvql              `kvql.model(...).generate(prompts, max_tokens=10, stop=["\\n"])`, all prompts at once,
                       cold (after `clear_cache()`), then a warm second run of the same prompts.

Workload "no sharing": N prompts of about the same length built from differently shuffled facts, so that
they share no long token prefix (the mean longest common prefix is printed); kvql vs HF padded batch, both
checked against HF one-at-a-time answers.

Reported: wall time, questions/s, speed-up vs one-at-a-time, answers equal to the one-at-a-time answers,
kvql's cache hit rate and overhead ratio (wall time / time inside the model forward). Every system does one
untimed warm-up generate on a tiny prompt first. The machine is noisy: only ratios from one run mean much;
torch runs on 1 thread by default (--threads), because on a shared 2-core machine 2 threads stall badly
whenever the other core is busy (single prefills were seen to take 0.5 s or 8 s).
Results are also written to benchmarks/results/fewshot_qa.json.

With --dtype bfloat16 every system computes in bf16 (the reference is then the uncached bf16 one-at-a-time
answers), and kvql in float32 runs the shared workload cold too: bf16/fp32 speed and answers agreement.

Usage: python benchmarks/fewshot_qa.py [--questions 24] [--quick] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
import kvql  # noqa: E402
from kvql.backends.loader import load_hf  # noqa: E402

MODEL = "smollm2-135m"
MAX_NEW = 10
SEED = 0

HEADER = "Answer each question with a short factual answer.\n\n"
# Few-shot examples (all of them form the shared prefix).
SHOTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many legs does a spider have?", "Eight"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare"),
    ("What is the chemical symbol for gold?", "Au"),
    ("How many days are there in a leap year?", "366"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("Which ocean is the largest on Earth?", "The Pacific Ocean"),
    ("What gas do plants absorb from the air?", "Carbon dioxide"),
    ("What is the capital of Italy?", "Rome"),
    ("How many continents are there?", "Seven"),
    ("What color do you get by mixing blue and yellow?", "Green"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("What is the square root of 81?", "9"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the longest river in Africa?", "The Nile"),
]
# Test questions (answers only used to build the no-sharing prompts).
QUESTIONS = [
    ("What is the capital of Germany?", "Berlin"),
    ("How many sides does a triangle have?", "Three"),
    ("What is the capital of Spain?", "Madrid"),
    ("Which planet is closest to the Sun?", "Mercury"),
    ("What is the largest mammal?", "The blue whale"),
    ("How many hours are there in a day?", "24"),
    ("What is the chemical symbol for water?", "H2O"),
    ("Who was the first president of the United States?", "George Washington"),
    ("What is the capital of Canada?", "Ottawa"),
    ("How many wheels does a bicycle have?", "Two"),
    ("What is the tallest mountain in the world?", "Mount Everest"),
    ("What is the currency of Japan?", "The yen"),
    ("How many weeks are there in a year?", "52"),
    ("Which bird is a symbol of peace?", "The dove"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What do bees make?", "Honey"),
    ("What is 7 times 8?", "56"),
    ("Which element has the chemical symbol O?", "Oxygen"),
    ("What is the smallest prime number?", "2"),
    ("What is the capital of Australia?", "Canberra"),
    ("How many strings does a standard guitar have?", "Six"),
    ("Who discovered penicillin?", "Alexander Fleming"),
    ("What is the largest desert in the world?", "The Sahara"),
    ("In which country are the pyramids of Giza?", "Egypt"),
]


def qa(q: str, a: str | None = None) -> str:
    return f"Q: {q}\nA: {a}\n" if a is not None else f"Q: {q}\nA:"


PREFIX = HEADER + "".join(qa(q, a) for q, a in SHOTS)  # ends with "\n": a clean token boundary


# ----------------------------------------------------------------------------------------------- helpers
def answer(text: str) -> str:
    return text.split("\n", 1)[0].strip()


def newline_token_ids(tok) -> list[int]:
    """Every token whose text contains a newline: generation stops right after one (= stop=["\\n"])."""
    return [i for i in range(len(tok)) if "\n" in tok.decode([i])]


def gen_kwargs(tok, stop_ids):
    return dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[tok.eos_token_id, *stop_ids],
                pad_token_id=tok.pad_token_id)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


# ----------------------------------------------------------------------------------------------- systems
@torch.inference_mode()
def hf_one_at_a_time(model, tok, prompts, kw):
    outs = []
    for p in prompts:
        enc = tok(p, return_tensors="pt")
        seq = model.generate(**enc, **kw)[0, enc.input_ids.shape[1]:]
        outs.append(tok.decode(seq, skip_special_tokens=True))
    return outs


@torch.inference_mode()
def hf_padded(model, tok, prompts, kw):
    enc = tok(prompts, return_tensors="pt", padding=True)  # tokenizer padding_side is "left"
    seqs = model.generate(**enc, **kw)[:, enc.input_ids.shape[1]:]
    return [tok.decode(s, skip_special_tokens=True) for s in seqs]


@torch.inference_mode()
def hf_generate_batch(model, tok, prompts, kw):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = [tok(p).input_ids for p in prompts]
    # On CPU nothing can be inferred from GPU memory: size the paged cache explicitly. Its block-level
    # prefix sharing (allow_block_sharing, on by default) only matches blocks written by an earlier step,
    # so a small token budget per step (~2 prompts) lets later prompts reuse the prefix of earlier ones.
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=1024, max_batch_tokens=512)
    out = model.generate_batch(ids, generation_config=GenerationConfig(**kw), continuous_batching_config=cb)
    res = list(out.values())
    if len(res) != len(prompts) or any(r.error for r in res):
        raise RuntimeError(f"generate_batch: {len(res)}/{len(prompts)} results, errors: "
                           f"{[r.error for r in res if r.error][:2]}")
    return [tok.decode(r.generated_tokens, skip_special_tokens=True) for r in res]


def count_cb_prefix_hits():
    """Wrap HF's paged-cache prefix matcher to count reused prompt tokens (a diagnostic; None if unavailable)."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError:
        return None
    counter, match = [0], PagedAttentionCache.search_prefix_match

    def counting(self, request_id, prompt_ids):
        n = match(self, request_id, prompt_ids)
        counter[0] += n
        return n

    PagedAttentionCache.search_prefix_match = counting
    return counter


@torch.inference_mode()
def oracle(model, tok, prefix, suffixes, kw):
    from transformers import DynamicCache

    n = len(suffixes)
    pre = tok(prefix, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    model(input_ids=pre, cache=cache, use_cache=True)  # prefill the shared prefix once
    cache.batch_repeat_interleave(n)
    suf = tok(suffixes, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded
    ids = torch.cat([pre.expand(n, -1), suf.input_ids], dim=1)
    mask = torch.cat([torch.ones(n, pre.shape[1], dtype=suf.attention_mask.dtype), suf.attention_mask], dim=1)
    # generate() feeds only the uncached tail and derives position_ids from the mask (cumsum), so the
    # suffix tokens get positions P, P+1, ... despite the padding between prefix and suffix.
    seqs = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kw)[:, ids.shape[1]:]
    return [tok.decode(s, skip_special_tokens=True) for s in seqs]


def kvql_run(m, prompts):
    """Generate and return (texts, wall seconds, stats delta over this call)."""
    before = m.stats()
    t = time.perf_counter()
    comps = m.generate(prompts, max_tokens=MAX_NEW, stop=["\n"])
    wall = time.perf_counter() - t
    after = m.stats()
    d = {k: after[k] - before.get(k, 0) for k in ("prompt_tokens", "cached_tokens", "computed_tokens",
                                                   "forward_seconds") if isinstance(after.get(k), (int, float))}
    pt = d.get("prompt_tokens", 0)
    d["hit_rate"] = d.get("cached_tokens", 0) / pt if pt else after.get("hit_rate")
    d["completion_cached_tokens"] = sum(c.cached_tokens for c in comps)
    return [c.text for c in comps], wall, d


# ----------------------------------------------------------------------------------------------- workloads
def no_sharing_prompts(tok, n: int, target_len: int) -> list[str]:
    """n prompts of ~target_len tokens, each a differently shuffled set of facts, then one question."""
    pool = SHOTS + QUESTIONS
    prompts = []
    for i in range(n):
        q, first = QUESTIONS[i % len(QUESTIONS)], QUESTIONS[(i + 1) % len(QUESTIONS)]  # distinct openings
        facts = [f for f in pool if f not in (q, first)]
        random.Random(1000 + i).shuffle(facts)
        facts.insert(0, first)
        text = ""
        for f in facts:
            if len(tok(text + qa(q[0])).input_ids) >= target_len:
                break
            text += qa(*f)
        prompts.append(text + qa(q[0]))
    return prompts


def row(name, texts, wall, ref, base_wall, extra=None):
    eq = sum(answer(a) == answer(b) for a, b in zip(texts, ref)) if texts is not None else None
    r = {"system": name, "wall_s": wall, "questions_per_s": len(ref) / wall if wall else None,
         "speedup_vs_one_at_a_time": base_wall / wall if wall else None, "answers_equal": eq, "n": len(ref)}
    r.update(extra or {})
    return r


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0]))


def print_table(title, rows):
    print(f"\n{title}")
    print(f"{'system':<22}{'wall s':>8}{'q/s':>8}{'speed-up':>10}{'equal':>8}{'hit rate':>10}{'overhead':>10}")
    for r in rows:
        if r.get("error"):
            print(f"{r['system']:<22}  FAILED: {r['error']}")
            continue
        eq = f"{r['answers_equal']}/{r['n']}"
        print(f"{r['system']:<22}{fmt(r['wall_s'], '8.2f')}{fmt(r['questions_per_s'], '8.2f')}"
              f"{fmt(r['speedup_vs_one_at_a_time'], '9.2f')}x{eq:>8}{fmt(r.get('hit_rate'), '10.2f')}"
              f"{fmt(r.get('overhead_ratio'), '10.2f')}")


def fp32_comparison(prompts, cold_texts, cold_wall, ref, base) -> dict:
    """kvql cold in float32 on the same prompts (its own model, loaded here and dropped after): its row, with
    the speed-up of the bf16 cold run over it and how many bf16 answers equal its answers."""
    m32 = kvql.model(MODEL, device="cpu", dtype=torch.float32)
    m32.generate(["Q: What is 1+1?\nA:"], max_tokens=MAX_NEW, stop=["\n"])
    m32.clear_cache()
    out, w, st = kvql_run(m32, prompts)
    m32.close()
    r = row("kvql_cold_float32", out, w, ref, base, {"hit_rate": st.get("hit_rate")})
    r["bf16_speedup"] = w / cold_wall
    r["bf16_equal_fp32"] = [sum(answer(a) == answer(b) for a, b in zip(cold_texts, out)), len(out)]
    return r


# ----------------------------------------------------------------------------------------------- main
def main():
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL, help="a built-in model: smollm2-135m or gemma3-270m")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="8 questions")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine 2 threads stall badly "
                         "whenever the other core is busy; 0 = torch's default)")
    ap.add_argument("--skip-kvql", action="store_true", help="HF baselines only")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="every system computes in this dtype, so the reference is the uncached one-at-a-time "
                         "answers in it; with bfloat16, kvql in float32 runs too, for bf16/fp32 speed and agreement")
    args = ap.parse_args()
    MODEL = args.model
    dtype = getattr(torch, args.dtype)
    n = min(8 if args.quick else args.questions, len(QUESTIONS))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    t_start = time.perf_counter()

    model, tok = load_hf(MODEL, device="cpu", dtype=dtype)  # the HF baselines' copy
    model.eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    kw = gen_kwargs(tok, newline_token_ids(tok))

    suffixes = [qa(q) for q, _ in QUESTIONS[:n]]
    prompts = [PREFIX + s for s in suffixes]
    pre_ids = tok(PREFIX).input_ids
    boundary_ok = all(pre_ids + tok(s, add_special_tokens=False).input_ids == tok(p).input_ids
                      for s, p in zip(suffixes, prompts))
    plens = [len(tok(p).input_ids) for p in prompts]
    print(f"shared workload: {n} questions, prefix {len(pre_ids)} tokens, prompts {min(plens)}-{max(plens)} "
          f"tokens, tok(prefix)+tok(suffix)==tok(prompt): {boundary_ok}; torch threads {torch.get_num_threads()}")

    tiny = ["Q: What is 1+1?\nA:"]
    results = {"config": {"model": MODEL, "questions": n, "max_new_tokens": MAX_NEW, "dtype": args.dtype,
                          "prefix_tokens": len(pre_ids), "boundary_ok": boundary_ok,
                          "torch_threads": torch.get_num_threads()}}
    rows = []

    # 1. one at a time (reference)
    hf_one_at_a_time(model, tok, tiny, kw)
    ref, base = timed(hf_one_at_a_time, model, tok, prompts, kw)
    rows.append(row("hf_one_at_a_time", ref, base, ref, base))
    # 2. padded batch
    hf_padded(model, tok, tiny, kw)
    out, w = timed(hf_padded, model, tok, prompts, kw)
    rows.append(row("hf_padded", out, w, ref, base))
    # 3. continuous batching (on its own copy, so nothing it sets on the model leaks into the others)
    try:
        cb_model, hits = copy.deepcopy(model), count_cb_prefix_hits()
        hf_generate_batch(cb_model, tok, tiny, kw)
        if hits:
            hits[0] = 0
        out, w = timed(hf_generate_batch, cb_model, tok, prompts, kw)
        rate = hits[0] / sum(plens) if hits else None
        rows.append(row("hf_generate_batch", out, w, ref, base, {"hit_rate": rate}))
    except Exception as e:  # report, don't crash
        rows.append({"system": "hf_generate_batch", "error": f"{type(e).__name__}: {e}"[:300]})
    finally:
        cb_model = None
    # 4. oracle prefix sharing
    oracle(model, tok, "Q: What is 1+1?\n", ["A:"], kw)
    out, w = timed(oracle, model, tok, PREFIX, suffixes, kw)
    rows.append(row("oracle_prefix_cache", out, w, ref, base,
                    {"note": "" if boundary_ok else "prefix/suffix tokenization differs from whole prompt"}))

    # 5. kvql
    m, kvql_error = None, None
    if not args.skip_kvql:
        try:
            m = kvql.model(MODEL, device="cpu", dtype=dtype)
            m.generate(tiny, max_tokens=MAX_NEW, stop=["\n"])
            m.clear_cache()
            for label in ("kvql_cold", "kvql_warm"):
                out, w, st = kvql_run(m, prompts)
                if label == "kvql_cold":
                    cold = out, w
                fs = st.get("forward_seconds")
                rows.append(row(label, out, w, ref, base, {"hit_rate": st.get("hit_rate"), "stats": st,
                                                           "overhead_ratio": w / fs if fs else None}))
        except Exception as e:
            kvql_error = f"{type(e).__name__}: {e}"[:300]
            rows.append({"system": "kvql", "error": kvql_error})
    if m is not None and kvql_error is None and dtype != torch.float32:
        rows.append(fp32_comparison(prompts, *cold, ref, base))
    results["shared"] = rows
    print_table(f"Shared few-shot prefix ({n} questions, {args.dtype}; reference = hf_one_at_a_time answers)", rows)
    if rows[-1]["system"] == "kvql_cold_float32":
        f = rows[-1]
        print(f"  kvql {args.dtype} cold is {f['bf16_speedup']:.2f}x kvql float32 cold; its answers equal float32's on "
              f"{f['bf16_equal_fp32'][0]}/{f['bf16_equal_fp32'][1]}")
    for r in rows:
        if r.get("stats"):
            print(f"  {r['system']} stats: {r['stats']}")

    # No-sharing workload
    ns_prompts = no_sharing_prompts(tok, n, len(pre_ids) + 10)
    ns_ids = [tok(p).input_ids for p in ns_prompts]
    lcps = [max(lcp(a, b) for j, b in enumerate(ns_ids) if j != i) for i, a in enumerate(ns_ids)]
    mean_pair = sum(lcp(ns_ids[i], ns_ids[j]) for i in range(n) for j in range(i + 1, n)) / max(1, n * (n - 1) // 2)
    print(f"\nno-sharing workload: {n} prompts, {min(map(len, ns_ids))}-{max(map(len, ns_ids))} tokens; "
          f"longest common prefix with any other prompt: mean {sum(lcps) / n:.1f}, max {max(lcps)} tokens; "
          f"mean pairwise LCP {mean_pair:.1f} tokens")
    ns_ref, ns_base = timed(hf_one_at_a_time, model, tok, ns_prompts, kw)
    ns_rows = [row("hf_one_at_a_time", ns_ref, ns_base, ns_ref, ns_base)]
    out, w = timed(hf_padded, model, tok, ns_prompts, kw)
    ns_rows.append(row("hf_padded", out, w, ns_ref, ns_base))
    if m is not None and kvql_error is None:
        try:
            m.clear_cache()
            out, w, st = kvql_run(m, ns_prompts)
            fs = st.get("forward_seconds")
            ns_rows.append(row("kvql_cold", out, w, ns_ref, ns_base, {"hit_rate": st.get("hit_rate"), "stats": st,
                                                                      "overhead_ratio": w / fs if fs else None}))
            ns_rows[-1]["wall_vs_hf_padded"] = w / ns_rows[1]["wall_s"]
        except Exception as e:
            ns_rows.append({"system": "kvql_cold", "error": f"{type(e).__name__}: {e}"[:300]})
    results["no_sharing"] = {"mean_max_lcp_tokens": sum(lcps) / n, "max_lcp_tokens": max(lcps),
                             "mean_pairwise_lcp_tokens": mean_pair, "rows": ns_rows}
    print_table("No sharing (reference = hf_one_at_a_time answers)", ns_rows)
    if "wall_vs_hf_padded" in ns_rows[-1]:
        print(f"  kvql wall / hf_padded wall = {ns_rows[-1]['wall_vs_hf_padded']:.2f} "
              f"(<1: kvql faster)")

    results["total_seconds"] = time.perf_counter() - t_start
    results["answers"] = {"reference": [answer(a) for a in ref]}
    out_path = Path(__file__).resolve().parent / "results" / "fewshot_qa.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out_path} (total {results['total_seconds']:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
