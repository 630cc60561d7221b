"""Tiny random models of every decoder-only family the tests try, built from a config in code, and the checks
that tests/test_families.py asserts and scripts/family_table.py reports in docs/models.md.

`FAMILIES`: family name -> (transformers model type, config fields besides the common tiny sizes). Windowed
families get a window of `WINDOW` keys, so that the test prompts run past it. `OWN`: the families admission runs
on the model's own forward. `REFUSED`: families the engine refuses, with the words its error must contain.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0)
SLIDING = ["sliding_attention", "full_attention"]
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {**MOE, "sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen2_moe": ("qwen2_moe", {**MOE, "decoder_sparse_step": 1}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "head_dim": 16}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": WINDOW, "layer_types": SLIDING,
                          "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": WINDOW, "layer_types": SLIDING,
                               "query_pre_attn_scalar": 16}),
    "phi": ("phi", {"num_key_value_heads": 4}),
    "phi3": ("phi3", {}),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "olmoe": ("olmoe", {**MOE}),
    "granite": ("granite", {}),
    "granitemoe": ("granitemoe", {**MOE}),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW, "layer_types": SLIDING}),
    "starcoder2": ("starcoder2", {"sliding_window": WINDOW}),
    "gpt2": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "n_positions": 512}),
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": 4}),
    "gptj": ("gptj", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_positions": 512}),
    "smollm3": ("smollm3", {}),
    "glm": ("glm", {"head_dim": 16}),
    "glm4": ("glm4", {"head_dim": 16}),
    # attention sinks (a logit per head in each softmax's denominator), alternating sliding windows, MoE
    "gpt_oss": ("gpt_oss", {**MOE, "head_dim": 16, "sliding_window": WINDOW, "layer_types": SLIDING}),
    # the model's own forward over the pool's K/V (admission: `own`): attention the ragged path does not compute
    "falcon": ("falcon", {"new_decoder_architecture": True}),  # attention outside the AttentionInterface
    "bloom": ("bloom", {"n_embed": 64, "n_layer": 2, "n_head": 4}),  # ALiBi
    "mpt": ("mpt", {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 512}),  # ALiBi
    "stablelm": ("stablelm", {}),
    "nemotron": ("nemotron", {}),
    "xglm": ("xglm", {"d_model": 64, "num_layers": 2, "attention_heads": 4, "ffn_dim": 128}),
    "jetmoe": ("jetmoe", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16}),  # K/V repeated
    # chunked attention (a token attends within its chunk only) on its RoPE layer, a NoPE layer of full attention
    "llama4": ("llama4_text", {**MOE, "attention_chunk_size": WINDOW, "no_rope_layers": [1, 0],
                               "attn_temperature_tuning": False}),
    # the same with the NoPE layer's attention temperature (scaled by the cache's length: own forward)
    "llama4_tuned": ("llama4_text", {**MOE, "attention_chunk_size": WINDOW, "no_rope_layers": [1, 0],
                                     "floor_scale": 4}),
    # MLA in its absorbed form: the pool holds the latent and rotary key part as one key (latent_attention.py)
    "deepseek_v3": ("deepseek_v3", {**MOE, **MLA, "n_routed_experts": 4, "n_shared_experts": 1,
                                    "first_k_dense_replace": 1, "q_lora_rank": 24, "n_group": 1, "topk_group": 1}),
    "deepseek_v2": ("deepseek_v2", {**MOE, **MLA, "n_routed_experts": 4, "n_shared_experts": 1,
                                    "first_k_dense_replace": 1, "q_lora_rank": None}),
    "minicpm3": ("minicpm3", {**MLA, "q_lora_rank": 24}),
    "glm4_moe_lite": ("glm4_moe_lite", {**MOE, **MLA, "n_routed_experts": 4, "n_shared_experts": 1,
                                        "first_k_dense_replace": 1, "q_lora_rank": 24, "n_group": 1,
                                        "topk_group": 1}),
}

# recurrent layers (the ragged path, their mixers per request: recurrent_mixers.py; states carried per request,
# snapshots of them serve prefixes)
HYBRID = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)
DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, head_dim=16, layer_types=["linear_attention", "full_attention"])
FAMILIES.update({
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128}),
    "lfm2_moe": ("lfm2_moe", {**MOE, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1}),
    "qwen3_5": ("qwen3_5_text", DELTANET),
    "qwen3_next": ("qwen3_next", {**MOE, **DELTANET}),
    "granitemoehybrid": ("granitemoehybrid", {**MOE, **HYBRID, "layer_types": ["mamba", "attention"]}),
    "nemotron_h": ("nemotron_h", {"hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 32,
                                  "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16, "head_dim": 16}),
    "falcon_h1": ("falcon_h1", {**HYBRID, "mamba_d_ssm": 128, "head_dim": 16}),
    "zamba2": ("zamba2", {"mamba_d_state": 8, "mamba_headdim": 16, "n_mamba_heads": 8,
                          "layers_block_type": ["mamba", "hybrid"], "num_mem_blocks": 1}),
    "mamba": ("mamba", {"state_size": 4}),
    "jamba": ("jamba", {**MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                        "mamba_d_state": 4}),
    "bamba": ("bamba", {**HYBRID, "attn_layer_indices": [1]}),  # positions passed: its own default is wrong
    # Kimi Delta Attention beside MLA
    "kimi_linear": ("kimi_linear", {**MLA, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                                    "mlp_layer_types": ["dense", "sparse"], "linear_head_dim": 16,
                                    "linear_num_heads": 4, "layer_types": ["linear_attention", "full_attention"]}),
})

REFUSED = {
    # its own forward continues a state by a chunk, or by one token per forward, otherwise than its generate
    "recurrent_gemma": ("recurrent_gemma", {"block_types": ["recurrent", "attention"], "lru_width": 64,
                                            "attention_window_size": WINDOW}, "continuing a state by a chunk"),
}

# the families admission runs on their own forward (the others: the ragged path)
OWN = {"falcon", "stablelm", "nemotron", "xglm", "jetmoe", "llama4_tuned"}

def build(model_type: str, overrides: dict, vocab_size: int, eos_token_id: int, seed: int = 0,
          attn_implementation: str | None = None):
    """A random 2-layer model of `model_type`: the common tiny sizes, then `overrides` (names as the family's
    config spells them); the same arguments give the same weights."""
    fields = {**COMMON, "vocab_size": vocab_size, "eos_token_id": eos_token_id, "bos_token_id": 0, **overrides}
    config = CONFIG_MAPPING[model_type](**fields)
    torch.manual_seed(seed)
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(config, **kw).eval()


def prompts(vocab: int, seed: int, count: int = 6, long: bool = False) -> list[list[int]]:
    """Prompts sharing prefixes (three families of them); `long`: all past the tiny window."""
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randint(1, vocab, (40,), generator=g).tolist() for _ in range(3)]
    out = []
    for i in range(count):
        k = [0, 5, 17, 40][i % 4] if not long else [12, 24, 40][i % 3]
        n = int(torch.randint(1, 12, (1,), generator=g))
        out.append(bases[i % 3][:k] + torch.randint(1, vocab, (n,), generator=g).tolist())
    return out


@torch.inference_mode()
def reference(model_type: str, overrides: dict, tokenizer, prompt_list, max_tokens: int) -> list[list[int]]:
    """Greedy tokens from `transformers.generate` on a fresh copy of the family's model with transformers'
    eager attention (no kvql code on its path), one prompt at a time, ending at EOS."""
    hf = build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id, attn_implementation="eager")
    out = []
    for p in prompt_list:
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist()
        out.append(gen[:gen.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in gen else gen)
    return out


def staggered(m, prompt_list, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of `prompt_list` submitted two at a time while earlier ones decode, in small prefill
    chunks (`m`: a Model with `background=False`), so that batches mix prefill chunks and decode steps."""
    groups = []
    for i in range(0, len(prompt_list), 2):
        groups += m._submit(prompt_list[i:i + 2], max_tokens=max_tokens, stop=None, temperature=0.0, top_p=1.0, n=1,
                            seed=None, logprobs=None, mask=None)
        m.engine.step()
        m.engine.step()
    m.engine.run_until_idle()
    return [g.future.result()[0].token_ids for g in groups]


def windowed(m) -> bool:
    """Whether the model's attention spans are shorter than the test prompts could be (windows, chunks)."""
    chunk = getattr(m.hf_model.config.get_text_config(), "attention_chunk_size", None)
    return bool(chunk) or any(layer.window for layer in m.engine.runner.geometry.layers)


def check_exact(name: str, tokenizer, max_tokens: int = 8) -> dict:
    """fp32: greedy tokens of the family's tiny model on the engine against `reference`: cold (all prompts in
    one batch, sharing prefixes), warm (every prompt then served from the cache but its last token), and
    staggered (`staggered`, on a fresh engine). Returns what each gave, the reference, and the engine."""
    import kvql

    model_type, overrides = FAMILIES[name]
    hf = build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20)
    try:
        ps = prompts(len(tokenizer), seed=2, long=windowed(m))
        out = {"reference": reference(model_type, overrides, tokenizer, ps, max_tokens),
               "prompts": ps, "geometry": m.engine.runner.geometry, "fused": _fused(hf)}
        out["cold"] = [c.token_ids for c in m.generate(ps, max_tokens=max_tokens)]
        warm = m.generate(ps, max_tokens=max_tokens)
        out["warm"] = [c.token_ids for c in warm]
        out["warm_cached"] = [c.cached_tokens == c.prompt_tokens - 1 for c in warm]
        m.check_integrity()
    finally:
        m.close()
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20, background=False, max_batch_tokens=16)
    try:
        out["staggered"] = staggered(m, ps, max_tokens)
        out["mixed_steps"] = m.stats()["mixed_steps"]
        m.check_integrity()
    finally:
        m.close()
    return out


def fallback(name: str, tokenizer, long: bool = False, cache_budget: int = 1 << 20, max_tokens: int = 8):
    """The family's tiny model on an engine whose ragged path the caller has made wrong: (why admission runs it on its
    own forward, the greedy tokens the engine gave, the reference's)."""
    import kvql

    model_type, overrides = FAMILIES[name]
    hf = build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf, tokenizer, cache_budget=cache_budget)
    try:
        ps = prompts(len(tokenizer), seed=2, long=long)
        got = [c.token_ids for c in m.generate(ps, max_tokens=max_tokens)]
        return m.engine.runner.geometry.own, got, reference(model_type, overrides, tokenizer, ps, max_tokens)
    finally:
        m.close()


def check_bf16_invariant(name: str, tokenizer, max_tokens: int = 10) -> list[int]:
    """bf16, near-flat logits (small init: a last-bit difference flips greedy tokens often): the indices of
    prompts whose greedy tokens batched (sharing prefixes) differ from the same prompt alone on an empty cache."""
    import kvql

    model_type, overrides = FAMILIES[name]
    hf = build(model_type, {**overrides, "initializer_range": 0.05}, len(tokenizer), tokenizer.eos_token_id)
    m = kvql.Model(hf.to(torch.bfloat16), tokenizer, cache_budget=8 << 20, background=False)
    try:
        ps = prompts(len(tokenizer), seed=3, count=12, long=windowed(m))
        batched = [c.token_ids for c in m.generate(ps, max_tokens=max_tokens)]
        alone = []
        for p in ps:
            m.clear_cache()
            alone.append(m.generate([p], max_tokens=max_tokens)[0].token_ids)
    finally:
        m.close()
    return [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b]


def _fused(hf) -> int:
    """How many of the model's modules run kvql's fused layers (kvql.engine.model.fused_layers)."""
    return sum(hasattr(type(mod), "kvql_original") for mod in hf.modules())


def check_refused(name: str, tokenizer) -> str:
    """The error text of building the engine over a refused family's tiny model."""
    import kvql

    model_type, overrides, _ = REFUSED[name]
    hf = build(model_type, overrides, len(tokenizer), tokenizer.eos_token_id)
    try:
        kvql.Model(hf, tokenizer, cache_budget=8 << 20).close()
    except ValueError as e:
        return str(e)
    return ""
