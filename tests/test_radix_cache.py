"""Radix cache and KV pool: contract tests and randomized invariant checks (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.cache.radix_cache import RadixCache


def make(num_slots=64):
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=2, num_slots=num_slots, dtype=torch.float32, device="cpu")
    return pool, RadixCache(pool.free)


def test_match_returns_the_longest_cached_prefix_at_token_granularity():
    pool, tree = make()
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    slots, node = tree.match_prefix([1, 2, 9])
    assert slots.numel() == 2 and node.key == [1, 2]  # the node was split at the divergence
    assert tree.match_prefix([7])[0].numel() == 0
    assert tree.match_prefix([1, 2, 3, 4, 5])[0].numel() == 4
    tree.check_integrity()


def test_insert_reports_tokens_already_cached_and_keeps_the_trees_slots():
    pool, tree = make()
    first = pool.alloc(3)
    tree.insert([1, 2, 3], first)
    second = pool.alloc(5)
    assert tree.insert([1, 2, 3, 4, 5], second) == 3
    slots, _ = tree.match_prefix([1, 2, 3, 4, 5])
    assert slots[:3].tolist() == first.tolist() and slots[3:].tolist() == second[3:].tolist()


def test_locked_paths_survive_eviction_and_lru_goes_first():
    pool, tree = make()
    tree.insert([1, 2], pool.alloc(2))
    tree.insert([3, 4], pool.alloc(2))
    tree.insert([5, 6], pool.alloc(2))
    _, locked = tree.match_prefix([1, 2])
    tree.lock(locked)
    tree.match_prefix([5, 6])  # touch: [3, 4] is now least recently used
    assert tree.evict(1) == 2
    assert tree.match_prefix([3, 4])[0].numel() == 0
    assert tree.match_prefix([5, 6])[0].numel() == 2
    assert tree.evict(100) == 2  # only [5, 6] could go
    assert tree.match_prefix([1, 2])[0].numel() == 2
    tree.unlock(locked)
    assert tree.evict(100) == 2 and tree.total_tokens == 0
    tree.check_integrity()


def test_pool_never_grows_past_its_slots():
    pool, _ = make(num_slots=8)
    assert pool.alloc(9) is None
    a = pool.alloc(8)
    assert pool.alloc(1) is None and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 8


def test_pool_hands_out_slots_first_freed_first_taken_across_the_wrap():
    pool, _ = make(num_slots=8)
    assert pool.alloc(3).tolist() == [0, 1, 2] and pool.alloc(4).tolist() == [3, 4, 5, 6]
    pool.free(torch.tensor([2, 0]))
    pool.free(torch.tensor([5]))
    assert pool.free_slots().tolist() == [7, 2, 0, 5] and pool.num_free == 4
    assert pool.alloc(3).tolist() == [7, 2, 0]  # wraps past the ring's end
    pool.free(torch.tensor([6, 4, 3, 1]))
    assert pool.free_slots().tolist() == [5, 6, 4, 3, 1]
    taken = pool.alloc(5)
    assert taken.tolist() == [5, 6, 4, 3, 1] and pool.num_free == 0
    pool.free(taken[:0])  # nothing
    assert pool.num_free == 0
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(torch.arange(9))


class CacheMachine(RuleBasedStateMachine):
    """Requests start (match + lock + allocate), finish (insert + unlock) or are cancelled (free + unlock)
    in random order with random evictions; slot accounting must always add up."""

    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.pool, self.tree = make(num_slots=48)
        self.live = {}

    @rule(target=requests, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def start(self, tokens):
        cached, node = self.tree.match_prefix(tokens[:-1] if len(tokens) > 1 else [])
        self.tree.lock(node)
        need = len(tokens) - cached.numel()
        if self.pool.num_free < need:
            self.tree.evict(need - self.pool.num_free)
        new = self.pool.alloc(need)
        if new is None:
            self.tree.unlock(node)
            return None
        key = object()
        self.live[key] = (tokens, cached, node, new)
        return key

    @rule(key=consumes(requests))
    def finish(self, key):
        if key is None or key not in self.live:
            return
        tokens, cached, node, new = self.live.pop(key)
        slots = torch.cat([cached, new])
        existing = self.tree.insert(tokens, slots)
        self.pool.free(slots[cached.numel():existing])
        self.tree.unlock(node)

    @rule(key=consumes(requests))
    def cancel(self, key):
        if key is None or key not in self.live:
            return
        _, _, node, new = self.live.pop(key)
        self.pool.free(new)
        self.tree.unlock(node)

    @rule(n=st.integers(1, 20))
    def evict(self, n):
        self.tree.evict(n)

    @invariant()
    def slots_add_up(self):
        self.tree.check_integrity()
        held = [new for *_, new in self.live.values()]
        every = torch.cat([self.pool.free_slots(), self.tree.held_slots(), *held])
        assert sorted(every.tolist()) == list(range(self.pool.num_slots))
        for tokens, cached, node, _ in self.live.values():
            assert node.lock_ref > 0
            # a locked prefix still maps to the very slots the request was given
            assert torch.equal(self.tree.match_prefix(tokens[:cached.numel()])[0], cached)
        if not self.live:
            assert self.tree.locked_tokens == 0


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestCacheMachine = CacheMachine.TestCase
