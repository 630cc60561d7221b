"""Greedy output with the cache is token-identical to the uncached reference (fp32), on both attention paths
a CPU can take: the paged kernel and, without it (CUDA, no C compiler), gather + SDPA."""

from __future__ import annotations

import pytest

from conftest import random_prompts, reference_greedy, tiny_model


@pytest.fixture(autouse=True, params=["paged-kernel", "gather-sdpa"])
def attention_path(request, monkeypatch):
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", "1" if request.param == "paged-kernel" else "0")
    return request.param


def expected(hf_model, tokenizer, prompts, max_tokens):
    return [reference_greedy(hf_model, p, max_tokens, tokenizer.eos_token_id) for p in prompts]


def test_prompts_sharing_prefixes_submitted_together(make_model, llama, tokenizer):
    prompts = random_prompts(seed=1, count=24, vocab=len(tokenizer))
    m = make_model()
    out = m.generate(prompts, max_tokens=10)
    assert [c.token_ids for c in out] == expected(llama, tokenizer, prompts, 10)
    assert m.stats()["cached_tokens"] > 0
    m.check_integrity()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_each_supported_family_is_exact(make_model, tokenizer, family):
    hf = tiny_model(tokenizer, family, seed=3)
    prompts = random_prompts(seed=2, count=8, vocab=len(tokenizer))
    m = make_model(hf)
    assert [c.token_ids for c in m.generate(prompts, max_tokens=8)] == expected(hf, tokenizer, prompts, 8)
    # second pass: every prompt is now served from the cache except its last token
    again = m.generate(prompts, max_tokens=8)
    assert [c.token_ids for c in again] == expected(hf, tokenizer, prompts, 8)
    assert all(c.cached_tokens == c.prompt_tokens - 1 for c in again)


def test_staggered_submissions_mix_prefill_and_decode(make_model, llama, tokenizer):
    """Requests arrive while others decode, so batches hold prefill chunks next to decode steps."""
    prompts = random_prompts(seed=4, count=18, vocab=len(tokenizer))
    m = make_model(background=False, max_batch_tokens=32)  # small chunks: long prompts span steps
    eng = m.engine
    groups = []
    for i in range(0, len(prompts), 3):
        groups += m._submit(prompts[i:i + 3], max_tokens=12, stop=None, temperature=0.0, top_p=1.0, n=1,
                            seed=None, logprobs=None, mask=None)
        for _ in range(2):
            eng.step()
            m.check_integrity()
    eng.run_until_idle()
    got = [g.future.result()[0].token_ids for g in groups]
    assert got == expected(llama, tokenizer, prompts, 12)
    assert m.stats()["mixed_steps"] > 0
    m.check_integrity()


def test_forks_share_the_prompt_and_match_the_reference(make_model, llama, tokenizer):
    prompt = random_prompts(seed=5, count=1, vocab=len(tokenizer), prefix_lengths=(40,))[0]
    m = make_model()
    out = m.generate([prompt], max_tokens=9, n=4)
    ref = expected(llama, tokenizer, [prompt], 9)[0]
    assert [c.sample for c in out] == [0, 1, 2, 3]
    assert all(c.token_ids == ref for c in out)
    s = m.stats()
    # the prompt was computed once for all four samples; each sample computed its own tokens
    per_sample = sum(len(c.token_ids) - (c.finish_reason == "length") for c in out)
    assert s["forward_tokens"] == len(prompt) + per_sample
    assert s["prompt_tokens"] == len(prompt)
    m.check_integrity()


def test_exact_after_evictions_forced_by_a_tiny_budget(make_model, llama, tokenizer):
    prompts = random_prompts(seed=6, count=16, vocab=len(tokenizer))
    m = make_model(cache_tokens=64)
    out = m.generate(prompts, max_tokens=10)
    assert [c.token_ids for c in out] == expected(llama, tokenizer, prompts, 10)
    assert m.stats()["evictions"] > 0
    m.check_integrity()


def test_sampled_forks_are_seeded_and_reproducible(make_model, tokenizer):
    prompt = random_prompts(seed=7, count=1, vocab=len(tokenizer))[0]
    m = make_model()
    a = m.generate([prompt], max_tokens=12, n=3, temperature=1.5, seed=11)
    m.clear_cache()
    b = m.generate([prompt], max_tokens=12, n=3, temperature=1.5, seed=11)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1  # samples differ from each other
