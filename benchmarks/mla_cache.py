"""MLA: what the KV cache holds per token, and decode speed, on a ~100M random DeepSeek-V3-shaped model (issue 42).

DeepSeek's multi-head latent attention caches, per token and layer, a compressed latent (`kv_lora_rank`) and the
rotary part of the key (`qk_rope_head_dim`), and expands them to every head's keys and values after the cache
(transformers 5.25 caches exactly that). kvql runs the model on the ragged path in MLA's absorbed form
(kvql/engine/model/latent_attention.py), its pool holding the latent and the rotary key part once per token. This
prints
- KV bytes per token: the latent as the pool holds it (`KVPool.token_bytes`) vs the expanded K/V an attention
  over every head's keys and values would cache (heads x (qk_nope + qk_rope + v_head_dim) per layer);
- single-stream decode tok/s of kvql (greedy, `ignore_eos`, N and 1 new tokens: (N - 1) / (t_N - t_1)) and of
  transformers' `generate` on a plain copy of the model (the same subtraction), best of --repeats, alternating;
- a few-shot prompt asked again with a new question: prompt tokens served from the cache, and the time of the
  second request vs the first (the cache's saving on this path).
The model is random (built in code; no download): speed and bytes, not quality. Usage:
    .venv/bin/python benchmarks/mla_cache.py [--tokens 48] [--repeats 3] [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import kvql
from kvql.backends.loader import load_tokenizer

SHAPE = dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=12, num_key_value_heads=12, kv_lora_rank=512, q_lora_rank=384, qk_nope_head_dim=64,
             qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096, tie_word_embeddings=False)
FEW_SHOT = "".join(f"Q: What is {a} plus {b}?\nA: {a + b}\n" for a, b in [(2, 3), (7, 5), (11, 4), (6, 9), (8, 8)])


def build(vocab: int, dtype: torch.dtype):
    config = CONFIG_MAPPING["deepseek_v3"](**SHAPE, vocab_size=vocab)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(dtype)


def decode_rate(run, n: int, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        run(1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        run(n)
        best = max(best, (n - 1) / (time.perf_counter() - t - one))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    tok = load_tokenizer("smollm2-135m")
    hf = build(len(tok), dtype)
    plain = copy.deepcopy(hf)
    params = sum(p.numel() for p in hf.parameters())
    m = kvql.Model(hf, tok, cache_budget="256MB", speculate=False)
    geometry = m.engine.runner.geometry
    c = hf.config
    expanded = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    latent = m.engine.pool.token_bytes
    elem = torch.empty((), dtype=dtype).element_size()
    print(f"random DeepSeek-V3-shaped model: {params / 1e6:.0f}M parameters, {c.num_hidden_layers} layers, "
          f"{a.dtype}, {a.threads} threads; kvql runs it on "
          f"{'its own forward (' + geometry.own + ')' if geometry.own else 'the ragged path, absorbed'}")
    print(f"KV bytes per token: latent (kvql's pool) {latent:,} vs expanded K/V {expanded * elem:,} "
          f"({expanded * elem / latent:.1f}x)")

    prompt = "Once upon a time, a robot"
    ids = torch.tensor([tok(prompt)["input_ids"]])

    def kvql_run(n):
        m.clear_cache()
        m.generate([prompt], max_tokens=n, ignore_eos=True)

    def hf_run(n):
        with torch.inference_mode():
            plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    rates = {"kvql": 0.0, "transformers": 0.0}
    for _ in range(a.repeats):  # alternating sides
        rates["kvql"] = max(rates["kvql"], decode_rate(kvql_run, a.tokens, 1))
        rates["transformers"] = max(rates["transformers"], decode_rate(hf_run, a.tokens, 1))
    print(f"single-stream decode: kvql {rates['kvql']:.1f} tok/s, transformers {rates['transformers']:.1f} tok/s "
          f"({rates['kvql'] / rates['transformers']:.2f}x)")

    m.clear_cache()
    times, served = [], []
    for q in ["What is 3 plus 4?", "What is 12 plus 9?"]:
        t = time.perf_counter()
        out = m.generate([FEW_SHOT + f"Q: {q}\nA:"], max_tokens=4)[0]
        times.append(time.perf_counter() - t)
        served.append((out.cached_tokens, out.prompt_tokens))
    print(f"few-shot, asked twice: second request {served[1][0]} of {served[1][1]} prompt tokens from the cache, "
          f"{times[1]:.3f} s vs {times[0]:.3f} s cold ({times[0] / times[1]:.1f}x)")
    m.close()


if __name__ == "__main__":
    main()
