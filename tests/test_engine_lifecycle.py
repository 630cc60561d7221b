"""A request's life: explicit states, memory held only while RUNNING, released on every way out;
`check_integrity` holds after every step of every path (finish, cancel, failure, preemption, forks,
salts), and under random submit / cancel / fail sequences."""

from __future__ import annotations

import concurrent.futures

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_prompts, reference_greedy
from kvql.engine.request import SamplingParams, State


def holds_nothing(r) -> bool:
    return r.kv_slots.numel() == 0 and r.node is None and r.tree_len == 0 and r.num_computed == 0


def submit(m, prompt, *, cache_salt=None, **kw):
    params = SamplingParams(**{"max_tokens": 5, **kw})
    return m.engine.submit(prompt, params, cache_salt=cache_salt)


def step(m, times=1):
    for _ in range(times):
        m.engine.step()
        m.check_integrity()
        m.check_integrity(full=False)


def prompts(tokenizer, seed, count=1, length=(20, 20)):
    return random_prompts(seed=seed, count=count, vocab=len(tokenizer), prefix_lengths=(0,), suffix=length)


def test_a_request_goes_waiting_running_finished(make_model, llama, tokenizer):
    (p,) = prompts(tokenizer, 71)
    m = make_model(background=False)
    g = submit(m, p)
    m.engine._take_inbox()
    (r,) = g.requests
    assert r.state is State.WAITING and holds_nothing(r)
    step(m)
    assert r.state is State.RUNNING and r.num_computed == len(p) and r.tree_len == len(p)
    m.engine.run_until_idle()
    assert r.state is State.FINISHED and holds_nothing(r)
    assert g.future.result()[0].token_ids == reference_greedy(llama, p, 5, tokenizer.eos_token_id)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_cancel_while_waiting_never_takes_memory(make_model, tokenizer):
    a, b = prompts(tokenizer, 72, count=2)
    m = make_model(background=False, max_running=1)
    ga, gb = submit(m, a), submit(m, b)
    step(m)
    (rb,) = gb.requests
    assert rb.state is State.WAITING
    m.engine.cancel(gb)
    step(m)
    assert rb.state is State.CANCELLED and holds_nothing(rb)
    with pytest.raises(concurrent.futures.CancelledError):
        gb.future.result()
    m.engine.run_until_idle()
    assert ga.requests[0].state is State.FINISHED


def test_cancel_mid_prefill_leaves_the_computed_chunk_cached(make_model, tokenizer):
    (p,) = prompts(tokenizer, 73, length=(60, 60))
    m = make_model(background=False, max_batch_tokens=16)
    g = submit(m, p)
    step(m)
    (r,) = g.requests
    assert r.state is State.RUNNING and r.num_computed == 16
    m.engine.cancel(g)
    step(m)
    assert r.state is State.CANCELLED and holds_nothing(r)
    assert m.stats()["cache_tokens"] == 16 and m.stats()["locked_nodes"] == 0
    again = submit(m, p)
    m.engine.run_until_idle()
    assert again.future.result()[0].cached_tokens == 16


def test_cancel_mid_decode(make_model, tokenizer):
    (p,) = prompts(tokenizer, 74)
    m = make_model(background=False)
    g = submit(m, p, max_tokens=20, ignore_eos=True)
    step(m, 3)
    (r,) = g.requests
    assert r.state is State.RUNNING and len(r.output_ids) == 3
    m.engine.cancel(g)
    step(m)
    assert r.state is State.CANCELLED and holds_nothing(r)
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0


def test_a_raising_mask_mid_decode_fails_its_request_alone(make_model, llama, tokenizer):
    a, b = prompts(tokenizer, 75, count=2)

    def explode(ids):
        if len(ids) == 2:
            raise RuntimeError("constraint bug")
        return None

    m = make_model(background=False)
    good, bad = submit(m, a), submit(m, b, mask=explode)
    step(m, 2)
    assert bad.requests[0].state is State.RUNNING
    step(m)
    assert bad.requests[0].state is State.FAILED and holds_nothing(bad.requests[0])
    with pytest.raises(RuntimeError, match="constraint bug"):
        bad.future.result()
    m.engine.run_until_idle()
    assert good.requests[0].state is State.FINISHED
    assert good.future.result()[0].token_ids == reference_greedy(llama, a, 5, tokenizer.eos_token_id)
    m.check_integrity()


def test_a_failed_forward_mid_prefill_frees_the_batchs_slots(make_model, llama, tokenizer):
    (p,) = prompts(tokenizer, 76, length=(60, 60))
    m = make_model(background=False, max_batch_tokens=32)
    long = submit(m, p)
    step(m)  # 32 of 60 prompt tokens computed and in the tree
    broken = submit(m, [len(tokenizer) + 5] * 4)  # a token id past the embedding table: the forward raises
    m.engine.step()
    for g in (long, broken):
        (r,) = g.requests
        assert r.state is State.FAILED and holds_nothing(r)
        with pytest.raises(IndexError):
            g.future.result()
    m.check_integrity()
    assert m.engine.pool.num_free == m.engine.pool.num_slots - 32  # the second chunk's slots were freed
    again = submit(m, p)
    m.engine.run_until_idle()
    assert again.future.result()[0].token_ids == reference_greedy(llama, p, 5, tokenizer.eos_token_id)


def test_preempted_requests_hold_nothing_until_admitted_again(make_model, llama, tokenizer):
    ps = random_prompts(seed=55, count=8, vocab=len(tokenizer), prefix_lengths=(0,), suffix=(20, 24))
    m = make_model(background=False, cache_tokens=60)
    groups = [submit(m, p, max_tokens=30) for p in ps]
    seen: dict[int, list[State]] = {}
    while not m.engine.idle():
        step(m)
        for g in groups:
            for r in g.requests:
                if not seen.get(r.rid) or seen[r.rid][-1] is not r.state:
                    seen.setdefault(r.rid, []).append(r.state)
                if r.state is State.PREEMPTED:
                    assert holds_nothing(r) and r in m.engine.scheduler.waiting
    preempted = [s for s in seen.values() if State.PREEMPTED in s]
    assert preempted and all(s[-1] is State.FINISHED for s in seen.values())
    assert any(s[s.index(State.PREEMPTED) + 1] is State.RUNNING for s in preempted)
    for p, g in zip(ps, groups):
        assert g.future.result()[0].token_ids == reference_greedy(llama, p, 30, tokenizer.eos_token_id)


def test_forks_each_lock_the_shared_prompt(make_model, tokenizer):
    (p,) = prompts(tokenizer, 77)
    m = make_model(background=False)
    g = submit(m, p, n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    step(m)
    assert [r.state for r in g.requests] == [State.RUNNING] * 3
    node = g.requests[0].node
    assert all(r.node is node and r.tree_len == len(p) for r in g.requests)
    assert node.lock_ref == 3
    m.engine.scheduler.finish(g.requests[1], State.FINISHED, keep=True)  # one sample ends early
    assert node.lock_ref == 2 and holds_nothing(g.requests[1])
    m.check_integrity()
    m.engine.run_until_idle()
    assert [r.state for r in g.requests] == [State.FINISHED] * 3
    assert m.stats()["locked_nodes"] == 0


def test_salted_requests_lock_paths_under_their_own_root(make_model, tokenizer):
    (p,) = prompts(tokenizer, 78)
    m = make_model(background=False)
    ga, gb, gc = submit(m, p, cache_salt="a"), submit(m, p, cache_salt="b"), submit(m, p)
    step(m)
    roots = m.engine.tree.roots
    for g, salt in ((ga, "a"), (gb, "b"), (gc, None)):
        node = g.requests[0].node
        while node.parent is not None:
            node = node.parent
        assert node is roots[salt]
    m.engine.run_until_idle()
    m.check_integrity()


def test_transitions_outside_the_state_machine_are_refused(make_model, tokenizer):
    (p,) = prompts(tokenizer, 79)
    m = make_model(background=False)
    g = submit(m, p)
    m.engine.run_until_idle()
    (r,) = g.requests
    assert r.state is State.FINISHED
    with pytest.raises(AssertionError, match="FINISHED -> FAILED"):
        m.engine.memory.release(r, State.FAILED, keep=False)
    w = submit(m, p)
    m.engine._take_inbox()
    with pytest.raises(AssertionError, match="WAITING -> PREEMPTED"):
        m.engine.memory.preempt(w.requests[0])
    m.engine.run_until_idle()
    m.check_integrity()


# -- random sequences ----------------------------------------------------------------------------
_REFERENCE: dict[tuple, list[int]] = {}

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 7), st.integers(1, 3), st.booleans(), st.sampled_from([None, "s"]),
              st.one_of(st.none(), st.integers(0, 3))),
    st.tuples(st.just("cancel"), st.integers(0, 15)),
    st.tuples(st.just("step"), st.integers(1, 3)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), ops=st.lists(op, min_size=1, max_size=14), budget=st.sampled_from([48, 96, 4096]))
def test_random_submit_cancel_fail_sequences_keep_every_invariant(make_model, llama, tokenizer, seed, ops, budget):
    ps = random_prompts(seed=seed, count=8, vocab=len(tokenizer), prefix_lengths=(0, 6, 20), suffix=(1, 10))
    m = make_model(background=False, cache_tokens=budget, max_batch_tokens=16)
    submitted = []  # (group, prompt, fail_at)

    def failing_at(k):
        def mask(ids):
            if len(ids) == k:
                raise RuntimeError("planted failure")
            return None
        return mask

    for o in ops:
        if o[0] == "submit":
            _, i, n, plp, salt, fail_at = o
            kw = dict(n=n, max_tokens=5, prompt_logprobs=2 if plp else None)
            if fail_at is not None:
                kw["mask"] = failing_at(fail_at)
            submitted.append((submit(m, ps[i], cache_salt=salt, **kw), ps[i], fail_at))
        elif o[0] == "cancel":
            if o[1] < len(submitted):
                m.engine.cancel(submitted[o[1]][0])
        else:
            step(m, o[1])
    m.engine.run_until_idle()
    m.check_integrity()
    assert m.stats()["locked_nodes"] == 0
    assert m.engine.pool.num_free + m.engine.tree.total_tokens == m.engine.pool.num_slots
    for g, p, fail_at in submitted:
        assert all(holds_nothing(r) for r in g.requests)
        if g.future.cancelled() or isinstance(g.future.exception(), concurrent.futures.CancelledError):
            assert g.cancelled and all(r.state in (State.CANCELLED, State.FINISHED) for r in g.requests)
            continue
        err = g.future.exception()  # a group cancelled after it ended keeps its outcome
        if err is not None:
            assert fail_at is not None and "planted failure" in str(err)
            assert all(r.state in (State.FAILED, State.FINISHED) for r in g.requests)
            assert any(r.state is State.FAILED for r in g.requests)
            continue
        assert [r.state for r in g.requests] == [State.FINISHED] * g.params.n
        key = tuple(p)
        if key not in _REFERENCE:
            _REFERENCE[key] = reference_greedy(llama, p, 5, tokenizer.eos_token_id)
        assert all(c.token_ids == _REFERENCE[key] for c in g.future.result())
