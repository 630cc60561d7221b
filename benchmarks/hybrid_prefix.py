"""A model with recurrent layers and its prefix cache: a few-shot query asked 24 times with new inputs (issue 42).

The model: a random Qwen3.5-shaped text model built in code (Gated DeltaNet layers, one full-attention layer in
four, ~150M parameters; no download), with SmolLM2's tokenizer. kvql runs it on its own forward (admission:
`own`), each request's recurrent state carried between its steps and snapshots of it in the cache
(cache/state_snapshots.py). The workload: a few-shot prefix (~300 tokens) followed by 24 different questions,
submitted at once from 24 threads (the engine batches them), greedy, --tokens new tokens each:
- cache on: every request in one cache partition: the prefix's K/V come from the pool and its recurrent state
  from a snapshot (taken where the first requests' prompts diverged);
- cache off: the same requests, each in a partition of its own (`cache_salt`): nothing shared, everything
  computed.
Both on a cleared cache, alternating, --repeats times; the best time of each is reported, with the prompt tokens
served from the cache, the snapshots taken and resumed from, and the bytes per snapshot. The answers of both runs
are compared (equal: the cache changes no output). Usage:
    .venv/bin/python benchmarks/hybrid_prefix.py [--tokens 8] [--repeats 2] [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import kvql
from kvql.backends.loader import load_tokenizer

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
             tie_word_embeddings=True)
FACTS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"),
         ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Chile", "Santiago"), ("Spain", "Madrid"), ("India", "New Delhi"),
         ("Ghana", "Accra"), ("Cuba", "Havana"), ("Italy", "Rome"), ("Iran", "Tehran"), ("Mali", "Bamako"),
         ("Laos", "Vientiane"), ("Fiji", "Suva"), ("Oman", "Muscat"), ("Chad", "N'Djamena"), ("Togo", "Lome")]
QUESTIONS = ["Brazil", "Germany", "Mexico", "Sweden", "Poland", "Greece", "Turkey", "Vietnam", "Nigeria", "Morocco",
             "Austria", "Finland", "Ireland", "Portugal", "Thailand", "Ukraine", "Uganda", "Zambia", "Bolivia",
             "Nepal", "Qatar", "Jordan", "Latvia", "Serbia"]


def build(vocab: int, dtype: torch.dtype):
    layers = SHAPE["num_hidden_layers"]
    config = CONFIG_MAPPING["qwen3_5_text"](**{**SHAPE, "layer_types": (SHAPE["layer_types"] * layers)[:layers]},
                                             vocab_size=vocab)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(dtype)


def run(m, prompts, tokens: int, salts: list[str | None]) -> tuple[float, list]:
    m.clear_cache()
    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda ps: m.generate([ps[0]], max_tokens=tokens, cache_salt=ps[1])[0],
                            zip(prompts, salts)))
    return time.perf_counter() - started, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer("smollm2-135m")
    hf = build(len(tok), getattr(torch, a.dtype))
    params = sum(p.numel() for p in hf.parameters())
    m = kvql.Model(hf, tok, cache_budget="512MB")
    prefix = "".join(f"Q: What is the capital of {c}?\nA: {x}\n" for c, x in FACTS)
    prompts = [prefix + f"Q: What is the capital of {q}?\nA:" for q in QUESTIONS]
    n_prefix = len(tok(prefix)["input_ids"])
    print(f"random Qwen3.5-shaped model: {params / 1e6:.0f}M parameters, {hf.config.num_hidden_layers} layers "
          f"({hf.config.layer_types.count('linear_attention')} Gated DeltaNet), {a.dtype}, {a.threads} threads; "
          f"{len(prompts)} prompts of ~{n_prefix} shared + ~10 own tokens, {a.tokens} new tokens each")
    best = {"on": float("inf"), "off": float("inf")}
    answers = {}
    for _ in range(a.repeats):
        for side in ("on", "off"):
            before = m.stats()
            salts = [None] * len(prompts) if side == "on" else [f"own-{i}" for i in range(len(prompts))]
            seconds, out = run(m, prompts, a.tokens, salts)
            best[side] = min(best[side], seconds)
            answers[side] = [c.token_ids for c in out]
            after = m.stats()
            served = sum(c.cached_tokens for c in out)
            total = sum(c.prompt_tokens for c in out)
            print(f"cache {side:3}: {seconds:6.2f} s, prompt tokens served from the cache {served} of {total} "
                  f"({served / total:.0%}); snapshots taken {after['snapshots_taken'] - before['snapshots_taken']}, "
                  f"resumed from {after['snapshot_resumes'] - before['snapshot_resumes']}")
    s = m.stats()
    per = s["snapshot_bytes"] / max(s["snapshots"], 1)
    print(f"cache on vs off: {best['off'] / best['on']:.2f}x faster (best of {a.repeats}); answers equal: "
          f"{answers['on'] == answers['off']}; one snapshot {per / 2**20:.2f} MiB (all recurrent layers' states), "
          f"K/V per token {m.engine.pool.token_bytes / 1024:.1f} KiB ({len(m.engine.pool.k)} attention layers)")
    m.close()


if __name__ == "__main__":
    main()
