"""Batch-invariant linear layers (kvql.engine.batch_invariant): in bf16 on a CPU, each output row of a layer
with a long reduction is computed exactly as the row alone, whatever the rows beside it."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvql
from kvql.engine.batch_invariant import MAX_REDUCTION, split_reductions


def _layer(in_features: int, bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, 96, bias=bias).to(torch.bfloat16)


def test_every_row_equals_the_row_alone_in_bf16():
    layer = _layer(1536, bias=True)
    assert split_reductions(layer) == 1 and layer.kvql_slice == 768
    x = torch.randn(700, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for rows in (2, 8, 24, 64, 200, 700):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_the_split_layer_computes_the_same_linear_map():
    layer = _layer(3000, bias=True)
    x = torch.randn(5, 3000).to(torch.bfloat16)
    with torch.inference_mode():
        plain = layer(x).float()
        split_reductions(layer)
        split = layer(x).float()
    assert layer.kvql_slice == 1000  # three equal slices, none over MAX_REDUCTION
    assert torch.allclose(split, plain, rtol=0.02, atol=0.02)


def test_short_reductions_are_left_alone_and_splitting_twice_changes_nothing():
    model = torch.nn.Sequential(_layer(MAX_REDUCTION, bias=False), torch.nn.ReLU(), _layer(MAX_REDUCTION + 1, bias=False))
    assert split_reductions(model) == 1
    assert getattr(model[0], "kvql_slice", None) is None and model[2].kvql_slice == 513
    assert split_reductions(model) == 0


def _wide_llama(tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_the_engine_splits_in_reduced_precision_on_cpu_only(tokenizer):
    bf16 = kvql.Model(_wide_llama(tokenizer).to(torch.bfloat16), tokenizer, cache_budget="4MB")
    fp32 = kvql.Model(_wide_llama(tokenizer), tokenizer, cache_budget="4MB")
    try:
        assert all(layer.mlp.down_proj.kvql_slice == 768 for layer in bf16.hf_model.model.layers)
        assert not any(hasattr(m, "kvql_slice") for m in fp32.hf_model.modules())  # fp32 keeps the model's layers
        [c] = bf16.generate("hello", max_tokens=3, ignore_eos=True)
        assert len(c.token_ids) == 3
    finally:
        bf16.close()
        fp32.close()
