"""In reduced precision (bf16), a request's greedy output batched with others equals its output alone on an
empty cache: its arithmetic does not depend on its batch mates or on which of its tokens the cache served
(kvql.engine.model.attention_plan's module doc, kvql.engine.model.cpu_linear). Not the uncached plain-transformers
reference: in bf16 other kernels round differently."""

from __future__ import annotations

import pytest
import torch

import kvql
from conftest import random_prompts, tiny_model
from kvql.engine.model.kernels import paged_attention


def _flat_llama(tokenizer, seed: int):
    """Small init: near-flat logits, so a last-bit difference flips greedy tokens often (the point here)."""
    return tiny_model(tokenizer, "llama", seed, hidden_size=128, intermediate_size=256,
                      initializer_range=0.05).to(torch.bfloat16)


@pytest.mark.parametrize("paged", ["1", "0"], ids=["paged-kernel", "aligned-sdpa"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_batched_greedy_equals_each_request_alone(tokenizer, seed, paged, monkeypatch):
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", paged)  # both attention paths a CPU can take (attention_plan)
    hf = _flat_llama(tokenizer, seed)
    prompts = random_prompts(seed=10 + seed, count=24, vocab=len(tokenizer), prefix_lengths=(0, 5, 17, 40, 90))
    m = kvql.Model(hf, tokenizer, cache_budget="16MB", background=False)
    try:
        assert m.engine.runner.paged is (paged == "1" and paged_attention.available())
        batched = [c.token_ids for c in m.generate(prompts, max_tokens=12)]
        assert m.stats()["cached_tokens"] > 0  # shared prefixes were served from the cache
        alone = []
        for p in prompts:
            m.clear_cache()
            alone.append(m.generate([p], max_tokens=12)[0].token_ids)
        assert [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b] == []
        m.check_integrity()
    finally:
        m.close()
