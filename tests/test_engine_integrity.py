"""Each check of `check_integrity` fires when the state it guards is corrupted on purpose, and passes
again once the corruption is undone (so no check is always true, and none always false)."""

from __future__ import annotations

import pytest

from conftest import random_prompts
from kvql.engine.request import SamplingParams, State


@pytest.fixture
def busy(make_model, tokenizer):
    """An engine between steps with two running requests sharing a 20-token prefix (both decoding),
    a two-sample group, and one waiting request."""
    base = random_prompts(seed=81, count=1, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(20, 20))[0]
    m = make_model(background=False, max_running=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    groups = [m.engine.submit(base + [5, 6], params), m.engine.submit(base + [7], params),
              m.engine.submit(base[:3] + [9, 9], SamplingParams(max_tokens=20, ignore_eos=True, n=2, temperature=1.0,
                                                                   seed=1))]
    m.engine.step()  # the second request waits for the first to compute the shared prefix; the third forks
    m.engine.step()
    groups.append(m.engine.submit(base[:4], params))  # four running: this one waits
    m.engine.step()
    m.engine.step()
    running = m.engine.scheduler.running
    assert len(running) == 4 and all(len(r.output_ids) >= 2 for r in running)
    assert list(m.engine.scheduler.waiting) == groups[3].requests
    m.check_integrity()
    return m, groups


def fires(m, match, full=True):
    with pytest.raises(AssertionError, match=match):
        m.check_integrity(full=full)


def test_a_path_slot_swapped_for_a_free_one(busy):
    m, groups = busy
    r = groups[0].requests[0]
    good = r.kv_slots
    bad = good.clone()
    bad[3] = m.engine.pool.free_slots()[0]
    r.kv_slots = bad
    fires(m, "invariant 1: .* not the slots of its tree path")
    m.check_integrity(full=False)  # counts alone cannot see it
    r.kv_slots = good
    m.check_integrity()


def test_two_path_slots_swapped_with_each_other(busy):
    m, groups = busy
    r = groups[1].requests[0]
    good = r.kv_slots
    r.kv_slots = good.clone()
    r.kv_slots[[0, 1]] = good[[1, 0]]
    fires(m, "invariant 1")
    r.kv_slots = good
    m.check_integrity()


def test_a_lock_without_a_holder(busy):
    m, groups = busy
    node = groups[0].requests[0].node
    m.engine.tree.lock(node)
    fires(m, r"invariants 1/6: node locked \d+ times, by \d+ running")
    m.engine.tree.unlock(node)
    m.check_integrity()


def test_a_missing_lock_on_a_shared_prefix(busy):
    m, groups = busy
    # the shared prefix node: locked through both requests' paths, so the tree's own check still holds
    shared = groups[0].requests[0].node.parent
    while shared.parent is not None and len(shared.children) < 2:
        shared = shared.parent
    m.engine.tree.lock(shared)
    m.engine.tree.unlock(groups[0].requests[0].node)  # a lock moved from a request's node to its ancestor
    m.engine.tree.check_integrity()
    fires(m, "invariants 1/6")
    m.engine.tree.lock(groups[0].requests[0].node)
    m.engine.tree.unlock(shared)
    m.check_integrity()


def test_more_prompt_tokens_served_from_the_cache_than_allowed(busy):
    m, groups = busy
    r = groups[0].requests[0]
    was = r.cached_tokens
    r.cached_tokens = len(r.prompt_ids)
    fires(m, "invariant 3: .* served", full=False)
    r.cached_tokens = was
    m.check_integrity()


def test_a_running_request_with_no_token_left_to_compute(busy):
    m, groups = busy
    r = groups[0].requests[0]
    last = r.output_ids.pop()
    fires(m, "invariant 3: .* last token", full=False)
    r.output_ids.append(last)
    m.check_integrity()


def test_a_tree_path_spelling_other_tokens(busy):
    m, groups = busy
    r = groups[1].requests[0]
    good = r.prompt_ids
    r.prompt_ids = [good[0] + 1] + good[1:]
    fires(m, "invariant 4")
    r.prompt_ids = good
    m.check_integrity()


def test_slots_and_computed_count_disagree(busy):
    m, groups = busy
    r = groups[0].requests[0]
    r.num_computed -= 1
    fires(m, "slots for .* computed tokens", full=False)
    r.num_computed += 1
    m.check_integrity()


def test_a_request_listed_as_running_in_another_state(busy):
    m, groups = busy
    r = groups[0].requests[0]
    r.state = State.WAITING
    fires(m, "in the running list but WAITING", full=False)
    r.state = State.RUNNING
    m.check_integrity()


def test_a_waiting_request_holding_a_node(busy):
    m, groups = busy
    (w,) = m.engine.scheduler.waiting
    w.node = m.engine.tree.root
    fires(m, "WAITING.* still holds memory")
    w.node = None
    m.check_integrity()


def test_an_ended_sample_holding_slots(busy):
    m, groups = busy
    first, second = groups[2].requests
    m.engine.scheduler.finish(second, State.FINISHED, keep=True)
    m.check_integrity()
    second.kv_slots = first.kv_slots[:first.tree_len]
    fires(m, "FINISHED.* still holds memory")
    second.kv_slots = second.kv_slots[:0]
    m.check_integrity()


def test_a_request_whose_path_is_under_another_salt(busy):
    m, groups = busy
    r = groups[0].requests[0]
    r.salt = "tenant"
    fires(m, "not under its salt's root")
    r.salt = None
    m.check_integrity()


def test_a_lock_left_when_nothing_runs(make_model, tokenizer):
    m = make_model(background=False)
    m.generate([[5, 6, 7, 8]], max_tokens=2)
    node = next(iter(m.engine.tree.root.children.values()))
    m.engine.tree.lock(node)
    fires(m, "invariant 6", full=False)
    m.engine.tree.unlock(node)
    m.check_integrity()
