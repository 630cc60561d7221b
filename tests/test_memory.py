"""Memory: the pool is sized from the budget and never grows; a tiny budget still completes, exact."""

from __future__ import annotations

import pytest

import kvql
from conftest import random_prompts, reference_greedy


def test_budget_ten_times_smaller_than_the_working_set(make_model, llama, tokenizer):
    prompts = random_prompts(seed=31, count=20, vocab=len(tokenizer), prefix_lengths=(0, 30), suffix=(20, 30))
    max_tokens = 12
    working_set = sum(len(p) + max_tokens for p in prompts)
    m = make_model(cache_tokens=working_set // 10)
    budget = m.engine.pool.bytes
    out = m.generate(prompts, max_tokens=max_tokens)
    assert [c.token_ids for c in out] == [reference_greedy(llama, p, max_tokens, tokenizer.eos_token_id)
                                         for p in prompts]
    s = m.stats()
    assert s["cache_budget_bytes"] == budget and m.engine.pool.bytes == budget
    assert s["cache_bytes"] <= budget
    assert m.engine.pool.num_slots <= working_set // 10
    assert s["evictions"] > 0
    m.check_integrity()


def test_budget_bytes_bound_the_pool(tokenizer, llama):
    m = kvql.Model(llama, tokenizer, cache_budget="100KB")
    assert m.stats()["cache_budget_bytes"] <= 100_000
    m.close()


def test_budget_too_small_for_one_request_is_refused_at_submit(make_model):
    m = make_model(cache_tokens=16)
    with pytest.raises(ValueError, match="cache_budget too small"):
        m.generate([list(range(1, 15))], max_tokens=8)
    assert m.generate([[1, 2, 3]], max_tokens=4)[0].prompt_tokens == 3  # still serving


def test_budget_that_holds_no_token_is_refused(tokenizer, llama):
    with pytest.raises(ValueError, match="holds no token"):
        kvql.Model(llama, tokenizer, cache_budget=10)


def test_clear_cache_frees_everything_unlocked(make_model):
    m = make_model()
    m.generate([[5, 6, 7, 8, 9]], max_tokens=4)
    assert m.stats()["cache_tokens"] > 0
    m.clear_cache()
    s = m.stats()
    assert s["cache_tokens"] == 0 and s["free_slots"] == s["pool_slots"]
    assert m.generate([[5, 6, 7, 8, 9]], max_tokens=4)[0].cached_tokens == 0
