"""Scheduling: in-batch dedup, cache-aware order, chunked prefill, preemption under memory pressure."""

from __future__ import annotations

from conftest import random_prompts, reference_greedy


def run(m, prompts, max_tokens=6):
    groups = m._submit(prompts, max_tokens=max_tokens, stop=None, temperature=0.0, top_p=1.0, n=1, seed=None,
                       logprobs=None, mask=None)
    return groups


def test_requests_sharing_an_uncached_prefix_compute_it_once(make_model, llama, tokenizer):
    shared = random_prompts(seed=51, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(60, 60))[0]
    tails = random_prompts(seed=52, count=6, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(3, 3))
    prompts = [shared + t for t in tails]
    m = make_model(background=False)  # all six are waiting before the first step
    out = m.generate(prompts, max_tokens=4)
    s = m.stats()
    # one request computed the 60 shared tokens; the other five were served them from the cache
    assert s["cached_tokens"] >= 5 * 60
    assert s["computed_tokens"] <= 60 + 6 * 3
    assert [c.token_ids for c in out] == [reference_greedy(llama, p, 4, tokenizer.eos_token_id) for p in prompts]


def test_longest_cached_prefix_is_admitted_first(make_model, tokenizer):
    warm, cold = random_prompts(seed=53, count=2, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(30, 30))
    m = make_model(background=False, max_running=1)
    m.generate([warm], max_tokens=2)
    groups = run(m, [cold, warm + [5, 6]])  # the cold one was submitted first
    m.engine.step()
    (admitted,) = m.engine.scheduler.running
    assert admitted.group is groups[1] and admitted.cached_tokens == 30
    m.engine.run_until_idle()
    m.check_integrity()


def test_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(make_model, llama, tokenizer):
    prompts = random_prompts(seed=54, count=3, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(90, 100))
    m = make_model(max_batch_tokens=16)
    out = m.generate(prompts, max_tokens=5)
    assert [c.token_ids for c in out] == [reference_greedy(llama, p, 5, tokenizer.eos_token_id) for p in prompts]
    assert m.stats()["steps"] >= sum(len(p) for p in prompts) // 16


def test_preempted_requests_resume_and_stay_exact(make_model, llama, tokenizer):
    prompts = random_prompts(seed=55, count=8, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(20, 24))
    m = make_model(cache_tokens=60)  # room for about two requests at a time: decodes must preempt
    out = m.generate(prompts, max_tokens=30)
    assert [c.token_ids for c in out] == [reference_greedy(llama, p, 30, tokenizer.eos_token_id) for p in prompts]
    assert m.stats()["preemptions"] > 0
    m.check_integrity()
