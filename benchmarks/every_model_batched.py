"""Every model batched: the tax of a family's layers on the engine, against a plain attention model (issue 52).

Random models of ~105-130M parameters built in code (no download), with SmolLM2's tokenizer, all of hidden size
768 and 12 layers: a Qwen3-shaped attention model (the reference), Qwen3.5-shaped (Gated DeltaNet on 3 of every 4
layers), LFM2-shaped (short convolutions on 2 of every 3), Granite-4-shaped (Mamba2 on 3 of every 4),
DeepSeek-V3-shaped (MLA: a cached latent) and
Bloom-shaped (ALiBi). The workload: 24 few-shot questions (~290 shared prompt tokens) submitted at once, --tokens
new tokens each, greedy, on a cleared cache, --repeats times (the best time is shown). Printed per model: the path
the engine runs it on (`ragged`: one forward per step for the whole batch; `own`: the model's own forward, one
request per forward), its wall time, the tax (its time over the attention model's), the prompt tokens served
from the cache. Usage:
    .venv/bin/python benchmarks/every_model_batched.py [--tokens 16] [--repeats 2] [--dtype bfloat16] [--only NAME]
        [--shots 1]
(`--shots 6 --tokens 64`: a decode-heavy run over a ~1,760-token shared context (Bloom's context is 2,048), where attention's cost per token
grows with the context and a recurrent layer's does not.)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import kvql
from hybrid_prefix import FACTS, QUESTIONS  # the same few-shot workload (benchmarks/ is on the path of a script)
from kvql.backends.loader import load_tokenizer

BASE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
MODELS = {
    "Qwen3-shaped attention": ("qwen3", BASE),
    "Qwen3.5-shaped (Gated DeltaNet)": ("qwen3_5_text", {
        **BASE, "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "LFM2-shaped (short convolutions)": ("lfm2", {
        **BASE, "block_ff_dim": 2048, "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "conv", "full_attention"]}),
    "Granite-4-shaped (Mamba2)": ("granitemoehybrid", {
        **BASE, "shared_intermediate_size": 2048, "num_local_experts": 0, "mamba_n_heads": 24, "mamba_d_head": 64,
        "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_chunk_size": 256,
        "layer_types": ["mamba"] * 3 + ["attention"]}),
    "DeepSeek-V3-shaped (MLA)": ("deepseek_v3", {
        **BASE, "num_key_value_heads": 12, "head_dim": 32, "kv_lora_rank": 256, "q_lora_rank": 384,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "first_k_dense_replace": 12, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 512, "n_group": 1, "topk_group": 1}),
    "Bloom-shaped (ALiBi)": ("bloom", {"hidden_size": 768, "n_layer": 12, "n_head": 12, "tie_word_embeddings": True}),
}



def build(model_type: str, fields: dict, vocab: int, dtype: torch.dtype):
    layers = fields.get("num_hidden_layers")
    if "layer_types" in fields:
        fields = {**fields, "layer_types": (fields["layer_types"] * layers)[:layers]}
    config = CONFIG_MAPPING[model_type](**fields, vocab_size=vocab)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(dtype)


def measure(m, prompts: list[str], tokens: int, repeats: int) -> tuple[float, float]:
    """(the best wall time of the batch on a cleared cache, the share of prompt tokens served from the cache)."""
    best, cached = float("inf"), 0.0
    for _ in range(repeats):
        m.clear_cache()
        started = time.perf_counter()
        out = m.generate(prompts, max_tokens=tokens, temperature=0.0)
        best = min(best, time.perf_counter() - started)
        cached = sum(o.cached_tokens for o in out) / sum(o.prompt_tokens for o in out)
    return best, cached


def main(args) -> None:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer("smollm2-135m")
    shots = "".join(f"Q: What is the capital of {c}?\nA: {a}\n" for c, a in FACTS) * args.shots
    prompts = [f"{shots}Q: What is the capital of {q}?\nA:" for q in QUESTIONS]
    print(f"{len(prompts)} questions, {len(tokenizer.encode(shots))} shared prompt tokens, {args.tokens} new tokens "
          f"each, greedy, {args.dtype}, {torch.get_num_threads()} threads")
    print("| model (random, built in code) | params | path | wall time | tax vs attention | prompt tokens cached |")
    print("|---|---|---|---|---|---|")
    reference = None
    for name, (model_type, fields) in MODELS.items():
        if args.only and args.only.lower() not in name.lower() and name != next(iter(MODELS)):
            continue
        hf = build(model_type, fields, len(tokenizer), dtype)
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        m = kvql.Model(hf, tokenizer, speculate=False)
        try:
            path = "own" if m.engine.runner.geometry.own else "ragged"
            seconds, cached = measure(m, prompts, args.tokens, args.repeats)
        finally:
            m.close()
        reference = reference or seconds
        print(f"| {name} | {params:.0f}M | {path} | {seconds:.2f} s | {seconds / reference:.2f}x | {cached:.0%} |",
              flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shots", type=int, default=1, help="the few-shot block this many times (a longer shared context)")
    p.add_argument("--only", default=None, help="only the models whose name holds this (and the reference)")
    main(p.parse_args())
