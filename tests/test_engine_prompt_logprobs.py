"""Prompt logprobs (vLLM's `prompt_logprobs`): every prompt token's logprob under the raw model, with
the k most likely alternatives, equal to a plain transformers forward over the same ids."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import random_prompts, reference_greedy


@torch.inference_mode()
def reference_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]`: row i is the log-softmax of the logits at position i (predicts token i + 1)."""
    return torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_reference(hf_model, ids, entries, k):
    ref = reference_logprobs(hf_model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e = entries[i]
        assert e.token_id == ids[i]
        assert e.logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4), f"position {i}"
        top = torch.topk(ref[i - 1], k)
        assert set(e.top) == set(top.indices.tolist()), f"position {i}: top-{k} ids differ"
        for tok, lp in e.top.items():
            assert lp == pytest.approx(float(ref[i - 1, tok]), abs=1e-4)


def submit(m, prompts, **kw):
    params = dict(max_tokens=4, stop=None, temperature=0.0, top_p=1.0, n=1, seed=None, logprobs=None, mask=None)
    params.update(kw)
    return m._submit(prompts, **params)


def test_prompt_logprobs_equal_a_plain_forward(make_model, llama, tokenizer):
    ids = random_prompts(seed=61, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(30, 30))[0]
    m = make_model()
    (c,) = m.generate([ids], max_tokens=3, prompt_logprobs=5)
    assert_matches_reference(llama, ids, c.prompt_logprobs, 5)
    assert c.token_ids == reference_greedy(llama, ids, 3, tokenizer.eos_token_id)
    m.check_integrity()


def test_prompt_logprobs_are_off_by_default_and_k0_gives_no_alternatives(make_model, llama, tokenizer):
    ids = random_prompts(seed=62, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(12, 12))[0]
    m = make_model()
    assert m.generate([ids], max_tokens=2)[0].prompt_logprobs is None
    (c,) = m.generate([ids], max_tokens=2, prompt_logprobs=0)
    assert all(e.top == {} for e in c.prompt_logprobs[1:])
    ref = reference_logprobs(llama, ids)
    assert [e.logprob for e in c.prompt_logprobs[1:]] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)


def test_a_warm_cache_is_not_used_for_positions_that_need_logits(make_model, llama, tokenizer):
    ids = random_prompts(seed=63, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(40, 40))[0]
    m = make_model()
    m.generate([ids], max_tokens=2)  # the whole prompt is now cached
    (c,) = m.generate([ids], max_tokens=2, prompt_logprobs=3)
    assert c.cached_tokens == 0
    assert_matches_reference(llama, ids, c.prompt_logprobs, 3)
    m.check_integrity()


def test_a_request_with_prompt_logprobs_still_feeds_the_cache(make_model, llama, tokenizer):
    ids = random_prompts(seed=64, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(40, 40))[0]
    m = make_model()
    m.generate([ids], max_tokens=2, prompt_logprobs=1)
    (again,) = m.generate([ids], max_tokens=2)
    assert again.cached_tokens == len(ids) - 1
    assert again.token_ids == reference_greedy(llama, ids, 2, tokenizer.eos_token_id)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(make_model, llama, tokenizer):
    ids = random_prompts(seed=65, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(100, 100))[0]
    m = make_model(max_batch_tokens=16)
    (c,) = m.generate([ids], max_tokens=4, prompt_logprobs=2)
    assert m.stats()["steps"] >= 100 // 16
    assert_matches_reference(llama, ids, c.prompt_logprobs, 2)
    assert c.token_ids == reference_greedy(llama, ids, 4, tokenizer.eos_token_id)


def test_prompt_logprobs_in_a_batch_with_other_requests(make_model, llama, tokenizer):
    prompts = random_prompts(seed=66, count=6, vocab=len(tokenizer), prefix_lengths=(0, 17, 40), suffix=(3, 20))
    m = make_model(background=False, max_batch_tokens=48)
    plain = submit(m, prompts[:3])
    scored = submit(m, prompts[3:], prompt_logprobs=4)
    m.engine.step()
    more = submit(m, prompts[:2], prompt_logprobs=4)  # their prompts are in the tree by now
    m.engine.run_until_idle()
    m.check_integrity()
    for p, g in zip(prompts[:3], plain):
        (c,) = g.future.result()
        assert c.prompt_logprobs is None
        assert c.token_ids == reference_greedy(llama, p, 4, tokenizer.eos_token_id)
    for p, g in zip(prompts[3:] + prompts[:2], scored + more):
        (c,) = g.future.result()
        assert_matches_reference(llama, p, c.prompt_logprobs, 4)
        assert c.token_ids == reference_greedy(llama, p, 4, tokenizer.eos_token_id)
    assert m.stats()["locked_nodes"] == 0


def test_every_sample_carries_the_same_prompt_logprobs(make_model, llama, tokenizer):
    ids = random_prompts(seed=67, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(20, 20))[0]
    m = make_model()
    out = m.generate([ids], max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=2)
    assert len(out) == 3
    assert out[0].prompt_logprobs == out[1].prompt_logprobs == out[2].prompt_logprobs
    assert_matches_reference(llama, ids, out[2].prompt_logprobs, 2)
    m.check_integrity()


def test_a_one_token_prompt_has_one_empty_entry(make_model):
    m = make_model()
    (c,) = m.generate([[7]], max_tokens=2, prompt_logprobs=3)
    assert c.prompt_logprobs == [None]


def test_prompt_logprobs_survive_preemption_under_a_small_cache(make_model, llama, tokenizer):
    prompts = random_prompts(seed=55, count=8, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(20, 24))
    m = make_model(cache_tokens=60, max_batch_tokens=8)  # prompts take several steps; decodes must preempt
    out = m.generate(prompts, max_tokens=30, prompt_logprobs=1)
    assert m.stats()["preemptions"] > 0
    for p, c in zip(prompts, out):
        assert_matches_reference(llama, p, c.prompt_logprobs, 1)
        assert c.token_ids == reference_greedy(llama, p, 30, tokenizer.eos_token_id)
    m.check_integrity()


@pytest.mark.parametrize("bad", [-1, 21, 2.0, "3", True])
def test_prompt_logprobs_out_of_range_is_refused(make_model, bad):
    m = make_model()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        m.generate(["hello"], max_tokens=2, prompt_logprobs=bad)


def test_agenerate_passes_prompt_logprobs(make_model, llama, tokenizer):
    ids = random_prompts(seed=68, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(10, 10))[0]
    m = make_model()
    (c,) = asyncio.run(m.agenerate([ids], max_tokens=2, prompt_logprobs=2))
    assert_matches_reference(llama, ids, c.prompt_logprobs, 2)
