"""A slow constraint slows its own request only (kvql.engine.decode.mask_worker, outputs.py's parked requests).

Each test blocks a misbehaving request's mask on an event that the test sets only once the innocent request
beside it has finished: an engine that waited for that mask could not finish the innocent one first (the mask
gives up after `HOLD` seconds, so such an engine fails the test instead of hanging it). The innocent answer
must equal its answer alone, and the slow request must still get its own exact answer afterwards.
"""

from __future__ import annotations

import threading

from conftest import random_prompts, reference_greedy

HOLD = 120  # seconds a blocked mask waits for the test at most (only an engine that waits for it reaches this)


class Blocking:
    """A mask (no restriction) that blocks at the `at`-th generated token until `release` is set."""

    jump_forward = True  # a function of the ids alone: the engine may ask it off its thread

    def __init__(self, at: int = 2):
        self.at, self.asked, self.release = at, threading.Event(), threading.Event()
        self.gave_up = False  # it waited `HOLD` seconds: the engine waited for it

    def __call__(self, ids):
        if len(ids) >= self.at and not self.release.is_set():
            self.asked.set()
            self.gave_up |= not self.release.wait(HOLD)
        return None


def test_an_innocent_request_finishes_exactly_while_its_neighbours_mask_is_stuck(make_model, llama, tokenizer):
    prompts = random_prompts(seed=51, count=3, vocab=len(tokenizer))
    m = make_model()  # the engine on its own thread, as under a server
    mask = Blocking()
    (slow,) = m._submit([prompts[0]], max_tokens=8, mask=mask)
    assert mask.asked.wait(HOLD)
    innocent = m._submit(prompts[1:], max_tokens=8)
    got = [g.future.result()[0].token_ids for g in innocent]
    finished_first = not mask.release.is_set() and not mask.gave_up
    mask.release.set()
    assert finished_first
    for p, ids in zip(prompts[1:], got):
        assert ids == reference_greedy(llama, p, 8, tokenizer.eos_token_id)
    assert slow.future.result()[0].token_ids == reference_greedy(llama, prompts[0], 8, tokenizer.eos_token_id)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_many_samples_of_a_stuck_mask_hold_one_worker_not_all(make_model, llama, tokenizer):
    """n samples share one mask function: their calls wait in line for one worker, so another request's
    grammar mask is still computed at once."""
    prompts = random_prompts(seed=52, count=2, vocab=len(tokenizer))
    alone = make_model(background=False)
    (ref,) = alone._submit([prompts[1]], max_tokens=6, regex="[a-z ]{1,12}")
    alone.engine.run_until_idle()
    m = make_model()
    mask = Blocking(at=1)
    (slow,) = m._submit([prompts[0]], max_tokens=4, n=8, temperature=0.8, seed=3, mask=mask)
    assert mask.asked.wait(HOLD)
    (innocent,) = m._submit([prompts[1]], max_tokens=6, regex="[a-z ]{1,12}")
    got = innocent.future.result()[0].token_ids
    finished_first = not mask.release.is_set() and not mask.gave_up
    mask.release.set()
    assert finished_first and got == ref.future.result()[0].token_ids
    assert len(slow.future.result()) == 8
    m.check_integrity()


def test_a_stuck_mask_that_fails_fails_its_own_request_only(make_model, llama, tokenizer):
    prompts = random_prompts(seed=53, count=2, vocab=len(tokenizer))
    m = make_model()
    mask = Blocking()

    def failing(ids):
        mask(ids)
        if len(ids) >= 2:
            raise RuntimeError("constraint bug")
        return None
    failing.jump_forward = True
    (bad,) = m._submit([prompts[0]], max_tokens=8, mask=failing)
    assert mask.asked.wait(HOLD)
    (innocent,) = m._submit([prompts[1]], max_tokens=8)
    got = innocent.future.result()[0].token_ids
    finished_first = not mask.release.is_set() and not mask.gave_up
    mask.release.set()
    assert finished_first and got == reference_greedy(llama, prompts[1], 8, tokenizer.eos_token_id)
    try:
        bad.future.result()
        raise AssertionError("the failing mask's request succeeded")
    except RuntimeError as e:
        assert "constraint bug" in str(e)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0
