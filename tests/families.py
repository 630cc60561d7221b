"""Tiny random models of every decoder-only family the tests try, built from a config in code, and the checks
that tests/test_families.py asserts and scripts/family_table.py reports in the README.

`FAMILIES`: family name -> (transformers model type, config fields besides the common tiny sizes). Windowed
families get a window of `WINDOW` keys, so that the test prompts run past it. `REFUSED`: families the engine
refuses, with the words its error must contain.
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
}

REFUSED = {
    "falcon": ("falcon", {"new_decoder_architecture": True}, "AttentionInterface"),
    "mamba": ("mamba", {"state_size": 4}, "recurrent"),
    "jamba": ("jamba", {**MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                        "mamba_d_state": 4}, "recurrent"),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"], "block_ff_dim": 128}, "recurrent"),
}


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
