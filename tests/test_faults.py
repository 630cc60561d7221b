"""A cancelled request or one whose mask raises fails alone; its batch-mates are unchanged."""

from __future__ import annotations

import concurrent.futures

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_prompts, reference_greedy


def submit(m, prompts, **kw):
    params = dict(max_tokens=10, stop=None, temperature=0.0, top_p=1.0, n=1, seed=None, logprobs=None, mask=None)
    params.update(kw)
    return m._submit(prompts, **params)


def test_cancelled_request_does_not_change_its_batch_mates(make_model, llama, tokenizer):
    prompts = random_prompts(seed=21, count=6, vocab=len(tokenizer))
    m = make_model(background=False)
    groups = submit(m, prompts)
    m.engine.step()
    m.engine.step()
    m.engine.cancel(groups[2])
    m.engine.run_until_idle()
    with pytest.raises(concurrent.futures.CancelledError):
        groups[2].future.result()
    for i, g in enumerate(groups):
        if i != 2:
            assert g.future.result()[0].token_ids == reference_greedy(llama, prompts[i], 10, tokenizer.eos_token_id)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_raising_mask_fails_only_its_own_request(make_model, llama, tokenizer):
    prompts = random_prompts(seed=22, count=5, vocab=len(tokenizer))

    def explode(ids):
        if len(ids) == 3:
            raise RuntimeError("constraint bug")
        return None

    m = make_model(background=False)
    good = submit(m, prompts[:2])
    bad = submit(m, prompts[2:3], mask=explode)
    rest = submit(m, prompts[3:])
    m.engine.run_until_idle()
    with pytest.raises(RuntimeError, match="constraint bug"):
        bad[0].future.result()
    for p, g in zip(prompts[:2] + prompts[3:], good + rest):
        assert g.future.result()[0].token_ids == reference_greedy(llama, p, 10, tokenizer.eos_token_id)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_mask_allowing_nothing_is_a_clear_error(make_model, tokenizer):
    import torch
    m = make_model()
    with pytest.raises(ValueError, match="allows no token"):
        m.generate(["hello"], max_tokens=3, mask=lambda ids: torch.zeros(len(tokenizer), dtype=torch.bool))
    assert m.generate(["hello"], max_tokens=3)[0].token_ids  # the engine keeps serving


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), cancel_at=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 6)), max_size=5),
       budget=st.sampled_from([48, 96, 4096]))
def test_random_submit_cancel_schedules_stay_exact_and_consistent(make_model, llama, tokenizer, seed, cancel_at, budget):
    prompts = random_prompts(seed=seed, count=12, vocab=len(tokenizer), prefix_lengths=(0, 6, 20), suffix=(1, 10))
    m = make_model(background=False, cache_tokens=budget, max_batch_tokens=24)
    groups = submit(m, prompts[:6], max_tokens=6)
    cancelled = set()
    for step in range(7):
        if step == 2:
            groups += submit(m, prompts[6:], max_tokens=6)
        for i, when in cancel_at:
            if when == step and i < len(groups):
                m.engine.cancel(groups[i])
                cancelled.add(i)
        m.engine.step()
        m.check_integrity()
    m.engine.run_until_idle()
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0
    for i, g in enumerate(groups):
        if i not in cancelled or not g.future.exception():
            assert g.future.result()[0].token_ids == reference_greedy(llama, prompts[i], 6, tokenizer.eos_token_id)
