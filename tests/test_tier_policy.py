"""The tier policy as the radix tree's hook (kvql/engine/cache/tier_policy.py), over a disk tier that keeps
nothing but references: which nodes eviction keeps off the pool and which it drops, how a node off the pool
comes back, and that the tree's and the policy's invariants hold after each step (the engine-level tests with
real files are tests/test_disk_tier.py and tests/test_cache_persistence.py)."""

from __future__ import annotations

import torch

from kvql.engine.cache.tier_items import Extent
from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.cache.radix_cache import RadixCache
from kvql.engine.cache.tier_policy import TierPolicy


class File:
    def __init__(self):
        self.refs = 1


class Disk:
    """DiskTier's engine-thread side, without threads or files: `room` for `room_tokens` staged tokens."""

    def __init__(self, room_tokens: int = 1 << 20, budget_files: int = 1 << 20):
        self.room_tokens, self.budget_files = room_tokens, budget_files
        self.spilled: list[list[int]] = []  # prefix + tokens of each file written
        self.live: set[File] = set()

    def room(self, n: int) -> bool:
        return n <= self.room_tokens

    def spill(self, items) -> list[Extent]:
        extents = []
        for item in items:
            file = File()
            self.live.add(file)
            self.spilled.append(item.prefix + item.tokens)
            extents.append(Extent(file, 0, len(item.tokens)))
        return extents

    def release(self, extent: Extent) -> None:
        extent.file.refs -= 1
        if extent.file.refs == 0:
            self.live.remove(extent.file)

    def over_budget(self) -> bool:
        return len(self.live) > self.budget_files


def make(num_slots: int = 32, **disk):
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=2, num_slots=num_slots, dtype=torch.float32, device="cpu")
    tree = RadixCache(pool.free)
    policy = TierPolicy(Disk(**disk), tree)
    return pool, tree, policy


def check(pool, tree, policy) -> None:
    tree.check_integrity()
    policy.check_integrity()
    assert pool.num_free + tree.total_tokens == pool.num_slots


def test_an_evicted_node_stays_off_the_pool_and_its_computed_copy_returns_it():
    pool, tree, policy = make()
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    assert tree.evict(1) == 4
    assert policy.disk.spilled == [[1, 2, 3, 4]] and tree.disk_tokens == 4 and tree.total_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4]).slots.numel() == 0  # off the pool: not matched
    check(pool, tree, policy)
    slots = pool.alloc(6)
    assert tree.insert([1, 2, 3, 4, 5, 6], slots) == 0  # the node took the computed copy: nothing was in the pool
    assert tree.disk_tokens == 0 and torch.equal(tree.match_prefix([1, 2, 3, 4, 5, 6]).slots, slots)
    check(pool, tree, policy)
    assert tree.evict(100) == 6
    assert policy.disk.spilled == [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]  # the clean copy of [1..4] is not written again
    check(pool, tree, policy)


def test_without_room_for_the_writer_eviction_drops_and_over_budget_the_oldest_extents_go():
    pool, tree, policy = make(room_tokens=3)
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    tree.evict(1)
    assert tree.num_nodes() == 0 and tree.dropped_tokens == 4 and policy.disk.spilled == []
    check(pool, tree, policy)
    pool, tree, policy = make(budget_files=1)
    tree.insert([1, 2], pool.alloc(2))
    tree.insert([7, 8], pool.alloc(2))
    tree.evict(100)  # [1, 2] is older: its file goes, with its node
    assert tree.num_nodes() == 1 and tree.disk_tokens == 2 and len(policy.disk.live) == 1
    check(pool, tree, policy)


def test_a_split_node_off_the_pool_shares_its_file_and_a_read_back_installs_each_half():
    pool, tree, policy = make()
    tree.insert([1, 2, 3, 4, 5], pool.alloc(5))
    tree.evict(100)
    _, root = tree.match_prefix([])
    path, busy = policy.disk_path(root, [1, 2, 9], 0)  # the match ends inside the node: it is split there
    assert not busy and [x.key for x in path] == [[1, 2]]
    (upper,) = path
    (lower,) = upper.children.values()
    assert policy.extent(upper).file is policy.extent(lower).file and policy.extent(lower).file.refs == 2
    assert (policy.extent(upper).offset, policy.extent(lower).offset, policy.extent(lower).length) == (0, 2, 3)
    check(pool, tree, policy)
    policy.reading(path, True)
    assert policy.disk_path(root, [1, 2], 0).busy
    tree.reset()  # a node being read back stays
    assert tree.disk_tokens == 5
    policy.install(upper, pool.alloc(2))
    assert tree.match_prefix([1, 2, 3]).slots.numel() == 2 and policy.served(upper) == 2 and policy.served(upper) == 0
    check(pool, tree, policy)
    policy.miss([lower], lower)  # a read that failed drops the node
    assert tree.disk_tokens == 0 and policy.disk.live == {policy.extent(upper).file}
    check(pool, tree, policy)


def test_write_back_gives_the_pool_nodes_clean_copies_in_batches_the_writer_takes():
    pool, tree, policy = make(room_tokens=4)
    tree.insert([1, 2, 3], pool.alloc(3))
    tree.insert([7, 8, 9], pool.alloc(3))
    todo = policy.unwritten()
    batch = policy.write_back(todo)
    assert batch.tokens == 3 and len(batch.todo) == 1  # a second node would pass the writer's room
    assert policy.write_back(batch.todo) == (3, [])
    assert policy.unwritten() == [] and tree.total_tokens == 6  # nothing left the pool
    check(pool, tree, policy)


def test_nodes_kept_off_the_pool_then_dropped_with_their_parent_in_the_same_eviction_write_nothing():
    pool, tree, policy = make(room_tokens=4)
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    slots = pool.alloc(4)
    assert tree.insert([1, 2, 5, 6], slots) == 2
    pool.free(slots[:2])  # computed twice: the tree's copy wins
    assert tree.evict(100) == 6  # [3, 4] and [5, 6] fit the writer's room, then [1, 2] does not: all three go
    assert tree.num_nodes() == 0 and policy.disk.spilled == [] and policy.disk.live == set()
    check(pool, tree, policy)
