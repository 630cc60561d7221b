"""Memory: the one owner of every request's KV memory and of its lifecycle state.

A request holds memory only while RUNNING: `kv_slots`, one pool slot per token it has computed
(`num_computed`) or is computing this step. `kv_slots[:tree_len]` are the radix tree's slots on the
path from its salt's root to `node`, kept valid by one lock on `node`; `kv_slots[tree_len:]` are its
own. `Memory` is the only writer of `state`, `kv_slots`, `node`, `tree_len` and `num_computed`, and
it changes them together:

    WAITING ---admit---> RUNNING ---preempt---> PREEMPTED ---admit---> RUNNING ...
    RUNNING ---release---> FINISHED | FAILED | CANCELLED      (WAITING and PREEMPTED may end too)
    fork: a new sample starts RUNNING on its parent's prompt path (one more lock on the same node)

Contract:
- `admit` and `extend` allocate the slots of a request's next segment and append them to `kv_slots`
  at once, so every pool slot is always free, the tree's, or one running request's, even mid-step.
  `commit(req, n)` marks them computed and hands computed prompt tokens to the tree; `discard(req)` frees
  the ones a step computed but did not keep (a draft's rejected tokens).
- Allocation evicts unlocked least recently used leaves first; it never takes a locked node's slots.
- After `preempt` or `release` a request holds nothing: `kv_slots` empty, `node` None, `tree_len`
  and `num_computed` 0. With `keep` its computed KV stays in the tree, unlocked, for reuse.
- `max_cached` (the request's) bounds what `admit` takes from the tree (invariant 3).
- Disk tier (`tier_policy`, tier_policy.py; None without one, persistence.py opens it): `load_prefix(req)`
  starts reading back the KV on disk that continues a waiting request's cached prefix into newly allocated
  slots (held by the read, not by any request; the pool node above them locked meanwhile) and says the
  request must wait; `install_loads()` (between steps) hands finished reads to the tree, so the request's
  next `admit` matches them. A read that fails its checks drops the nodes it was for: their tokens are
  computed, never wrong. With snapshots, nothing past the deepest one is read back (admission would not serve
  it), and `req.disk_tokens` counts only tokens read back that `admit` served: never more than `tree_len`.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from .tier_items import Load
from .kv_pool import KVPool
from .radix_cache import Node, RadixCache
from .state_snapshots import StateSnapshots
from .tier_policy import TierPolicy
from ..request import Request, State

_NEXT = {
    State.WAITING: {State.RUNNING, State.FAILED, State.CANCELLED},
    State.PREEMPTED: {State.RUNNING, State.FAILED, State.CANCELLED},
    State.RUNNING: {State.PREEMPTED, State.FINISHED, State.FAILED, State.CANCELLED},
}
"""Allowed transitions; a terminal state (FINISHED, FAILED, CANCELLED) has none."""


MIN_LOAD_TOKENS = 16
"""Fewer tokens on disk than this are computed, not read back (a read makes the request wait a step)."""
MAX_LOADS = 4
"""Reads back in flight at most: each holds its slots from its start; a request with more to read waits."""


class ReadBack(NamedTuple):
    """A read back in flight (`load_prefix`): the tier's load, the pool node above the nodes it reads (locked
    until they are installed), and those nodes in path order."""

    load: Load
    node: Node
    path: list[Node]


class Memory:
    def __init__(self, pool: KVPool, tree: RadixCache, snapshots: StateSnapshots | None = None):
        """`snapshots`: a model with recurrent layers' (a prefix is served only up to a snapshot of their state:
        state_snapshots.py)."""
        self.pool, self.tree, self.snapshots = pool, tree, snapshots
        self.loads: list[ReadBack] = []

    @property
    def tier_policy(self) -> TierPolicy | None:
        """The disk tier's policy: the tree's hook once a tier is open (persistence.py), else None."""
        hook = self.tree.hook
        return hook if isinstance(hook, TierPolicy) else None

    # -- transitions -----------------------------------------------------------------------------
    def admit(self, req: Request, budget: int, reserve: int = 0) -> int:
        """WAITING or PREEMPTED -> RUNNING: lock the longest cached prefix of `req.tokens[:max_cached]`
        and allocate slots for its next `n = min(uncached tokens, budget)` tokens, keeping `reserve`
        slots free; return `n`. Return 0 and leave the request as it was if the pool cannot."""
        slots, node, reach = self.cached_prefix(req)
        self.tree.lock(node)  # before allocating: eviction must not take the prefix
        n = min(req.num_tokens - slots.numel(), budget)
        new = self._alloc(n, reserve)
        if new is None:
            self.tree.unlock(node)
            return 0
        self._move(req, State.RUNNING)
        req.kv_slots, req.node = torch.cat([slots, new]), node
        req.tree_len = req.num_computed = slots.numel()
        if self.snapshots is not None:  # it resumes from the state after its cached prefix
            req.carry.state = self.snapshots.get(req.salt, req.tokens[:slots.numel()]) if slots.numel() else None
            req.carry.length = slots.numel()
            if reach > slots.numel():  # the tree's K/V reach further: a snapshot there serves the next one
                req.carry.marks.add(reach)
        if self.tier_policy is not None:
            req.disk_tokens += self.tier_policy.served(node, slots.numel())
        return n

    def cached_prefix(self, req: Request) -> tuple[torch.Tensor, Node, int]:
        """(slots, node, reach): what the tree serves of `req.tokens[:max_cached]`, the node at the end of its
        match and the match's length; with snapshots, the slots only up to the deepest prefix that has a snapshot
        of the recurrent state (the node may lie deeper: locking it holds those slots too)."""
        tokens = req.tokens[:req.max_cached()]
        slots, node = self.tree.match_prefix(tokens, req.salt)
        reach = slots.numel()
        if self.snapshots is not None:
            slots = slots[:self.snapshots.deepest(req.salt, tokens, reach)]
        return slots, node, reach

    # -- the disk tier ---------------------------------------------------------------------------
    def load_prefix(self, req: Request, reserve: int = 0) -> bool:
        """Whether the waiting `req` must wait for KV read back from disk: a read of the nodes on disk that
        continue its cached prefix is in flight (one it starts now, or another request's). False: admit it."""
        tier = self.tier_policy
        tokens = req.tokens[:req.max_cached()]
        if self.snapshots is not None:  # admission serves no K/V past the deepest snapshot: none is read for it
            tokens = tokens[:self.snapshots.deepest(req.salt, tokens, len(tokens))]
        slots, node = self.tree.match_prefix(tokens, req.salt)
        path, busy = tier.disk_path(node, tokens, slots.numel())
        n = sum(len(x.key) for x in path)
        if busy or n < MIN_LOAD_TOKENS:
            return busy
        if len(self.loads) >= MAX_LOADS:
            return True  # wait for a read to finish: reading back is far cheaper than computing
        tier.reading(path, True)  # before allocating: what the allocation evicts must not drop them
        self.tree.lock(node)
        new = self._alloc(n, reserve)
        if new is None:
            tier.reading(path, False)
            self.tree.unlock(node)
            return False
        self.loads.append(ReadBack(tier.read(path, tokens, slots.numel(), req.salt, new), node, path))
        return True

    def install_loads(self) -> None:
        """Hand every finished read back to the tree (module doc); a node a request computed meanwhile keeps
        its computed copy, and the rows read for it are freed."""
        tier = self.tier_policy
        for read in [r for r in self.loads if r.load.done.is_set()]:
            self.loads.remove(read)
            at, dropped = 0, False
            for x, item, ok in zip(read.path, read.load.items, read.load.ok):
                rows, at = read.load.slots[at:at + item.extent.length], at + item.extent.length
                if not dropped and x.slots is None and tier.pinned(x):
                    if ok:  # `x` may have lost leading tokens to a split since (its key is a suffix of theirs)
                        tier.install(x, rows[rows.numel() - len(x.key):])
                        rows = rows[:rows.numel() - len(x.key)]
                    else:  # everything below it goes with it
                        tier.miss(read.path, x)
                        dropped = True
                self.pool.free(rows)
            self.tree.unlock(read.node)

    def wait_loads(self, timeout: float) -> None:
        """Block until a read back in flight finishes (or `timeout` seconds): a step with nothing else to do."""
        if self.loads:
            self.loads[0].load.done.wait(timeout)

    def extend(self, req: Request, n: int) -> bool:
        """Allocate slots for the RUNNING request's next `n` tokens; False (nothing changes) if the
        pool cannot spare them even after evicting."""
        assert req.state is State.RUNNING
        new = self._alloc(n)
        if new is None:
            return False
        req.kv_slots = torch.cat([req.kv_slots, new])
        return True

    def commit(self, req: Request, n: int) -> None:
        """The forward computed the `n` tokens after `num_computed`: their KV is valid. Prompt tokens
        go into the tree at once (concurrent requests hit each other's prompts), locked by `req`."""
        start = req.num_computed
        assert req.state is State.RUNNING and start + n <= req.kv_slots.numel()
        req.num_computed = start + n
        if start < len(req.prompt_ids):
            self._cache_computed(req)

    def discard(self, req: Request) -> None:
        """Free the RUNNING request's slots past `num_computed`: a draft's rejected tokens (speculative
        decoding), whose KV the forward wrote but which are not the request's."""
        assert req.state is State.RUNNING
        self.pool.free(req.kv_slots[req.num_computed:])
        req.kv_slots = req.kv_slots[:req.num_computed]

    def fork(self, parent: Request, child: Request) -> None:
        """Start the new sample `child` RUNNING on `parent`'s computed prompt, which is in the tree."""
        assert parent.state is State.RUNNING and parent.tree_len == parent.num_computed == parent.kv_slots.numel()
        self._move(child, State.RUNNING)
        self.tree.lock(parent.node)
        child.kv_slots, child.node = parent.kv_slots, parent.node
        child.tree_len = child.num_computed = parent.num_computed

    def preempt(self, req: Request) -> None:
        """RUNNING -> PREEMPTED: its computed tokens go into the tree (evictable, reused if they
        survive); it keeps its generated tokens and is admitted again later."""
        self._move(req, State.PREEMPTED)
        self._drop(req, keep=True, held=True)

    def release(self, req: Request, state: State, keep: bool) -> None:
        """End the request in `state` (FINISHED, FAILED or CANCELLED); it holds nothing afterwards.
        `keep`: its computed KV is valid, leave it in the tree for reuse (else its own slots are freed)."""
        held = req.state is State.RUNNING
        self._move(req, state)
        self._drop(req, keep, held)

    # -- internals -------------------------------------------------------------------------------
    def _move(self, req: Request, state: State) -> None:
        assert state in _NEXT.get(req.state, ()), f"request {req.rid}: no transition {req.state.name} -> {state.name}"
        req.state = state

    def _alloc(self, n: int, reserve: int = 0) -> torch.Tensor | None:
        short = n + reserve - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
        if self.pool.num_free < n + reserve:
            return None
        return self.pool.alloc(n)

    def _cache_computed(self, req: Request) -> None:
        """Insert `tokens[:num_computed]` into the tree; lock the new path, unlock the old one."""
        tokens = req.tokens[:req.num_computed]
        existing = self.tree.insert(tokens, req.kv_slots[:req.num_computed], req.salt)
        self.pool.free(req.kv_slots[req.tree_len:existing])  # computed twice: the tree's copy wins
        slots, node = self.tree.match_prefix(tokens, req.salt)
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.kv_slots = torch.cat([slots, req.kv_slots[req.num_computed:]])
        req.node, req.tree_len = node, len(tokens)

    def _drop(self, req: Request, keep: bool, held: bool) -> None:
        carry = req.carry
        if self.snapshots is not None and keep and carry.state is not None and carry.length == req.num_computed:
            self.snapshots.put(req.salt, req.tokens[:carry.length], carry.state)  # its computed path's end
        carry.state, carry.length = None, 0
        if held:
            if keep and req.num_computed > req.tree_len:
                self._cache_computed(req)
            self.pool.free(req.kv_slots[req.tree_len:])  # own slots (with keep: only uncomputed ones)
            self.tree.unlock(req.node)
        req.kv_slots, req.node, req.tree_len, req.num_computed = req.kv_slots[:0], None, 0, 0

    # -- integrity -------------------------------------------------------------------------------
    def check_integrity(self, running: list[Request], waiting, full: bool = True, parked=frozenset()) -> None:
        """Assert the engine's invariants over the pool, the tree and the requests (between steps).
        `full=False`: O(running requests) arithmetic only, for a health probe. `parked`: the requests that
        hold the logits of their last token, waiting for its mask (outputs.py): computed to the end."""
        own = sum(r.kv_slots.numel() - r.tree_len for r in running)
        loading = sum(read.load.slots.numel() for read in self.loads)
        assert self.pool.num_free + self.tree.total_tokens + own + loading == self.pool.num_slots, (
            f"invariant 2: slots leaked or doubled: free {self.pool.num_free} + tree {self.tree.total_tokens} "
            f"+ running {own} + reading back {loading} != pool {self.pool.num_slots}")
        for r in running:
            assert r.state is State.RUNNING, f"request {r.rid} is in the running list but {r.state.name}"
            assert r.node is not None, f"running request {r.rid} locks no node"
            assert r.kv_slots.numel() == r.num_computed, (
                f"request {r.rid}: {r.kv_slots.numel()} slots for {r.num_computed} computed tokens")
            assert r.tree_len <= r.num_computed < r.num_tokens + (r in parked), (
                f"invariant 3: request {r.rid} has computed {r.num_computed} of {r.num_tokens} tokens "
                f"(tree {r.tree_len}): its last token must be left to compute")
            assert r.cached_tokens is not None and r.cached_tokens <= len(r.prompt_ids) - 1, (
                f"invariant 3: request {r.rid} was served {r.cached_tokens} of {len(r.prompt_ids)} prompt tokens")
        if not running and not self.loads:
            assert self.tree.locked_tokens == 0, "invariant 6: a node is locked while no request runs or reads"
        if not full:
            return
        for r in waiting:
            assert r.state in (State.WAITING, State.PREEMPTED), f"request {r.rid} is waiting but {r.state.name}"
            self._check_holds_nothing(r)
        for group in {id(r.group): r.group for r in [*running, *waiting]}.values():
            for r in group.requests:
                if r.state not in _NEXT:
                    self._check_holds_nothing(r)
        self._check_slots(running)
        self._check_locks_and_paths(running)
        if self.tier_policy is not None:
            self.tier_policy.check_integrity()

    @staticmethod
    def _check_holds_nothing(r: Request) -> None:
        assert r.kv_slots.numel() == 0 and r.node is None and r.tree_len == 0 and r.num_computed == 0, (
            f"request {r.rid} ({r.state.name}) still holds memory")

    def _check_slots(self, running: list[Request]) -> None:
        """Invariant 2, slot by slot: free, tree and running requests' own slots partition the pool."""
        free, tree = self.pool.free_slots(), self.tree.held_slots()
        own = [r.kv_slots[r.tree_len:] for r in running] + [read.load.slots for read in self.loads]
        every = torch.cat([free, tree, *own])
        assert every.numel() == self.pool.num_slots, (
            f"invariant 2: free {free.numel()} + tree {tree.numel()} + running {every.numel() - free.numel() - tree.numel()} "
            f"!= pool {self.pool.num_slots}")
        assert torch.equal(every.sort().values, torch.arange(self.pool.num_slots, device=every.device)), \
            "invariant 2: a slot is held twice or out of range"

    def _check_locks_and_paths(self, running: list[Request]) -> None:
        """Invariants 1, 4 and 6: each running request's `kv_slots[:tree_len]` are exactly the slots on
        the tree path from its salt's root to its locked `node`, whose keys are its first `tree_len`
        tokens (so cached K sit at their own positions); every node's lock count is the number of
        running requests and reads back whose paths pass through it (no lock without a live holder)."""
        expected: collections.Counter[int] = collections.Counter()
        for r in running:
            path: list[Node] = []
            node = r.node
            while node.parent is not None:
                path.append(node)
                expected[id(node)] += 1
                node = node.parent
            assert node is self.tree.roots.get(r.salt), f"request {r.rid}: its node is not under its salt's root"
            path.reverse()
            keys = [t for n in path for t in n.key]
            assert len(keys) == r.tree_len, f"request {r.rid}: tree path of {len(keys)} tokens, tree_len {r.tree_len}"
            assert keys == r.tokens[:r.tree_len], f"invariant 4: request {r.rid}: tree path tokens differ from its own"
            slots = torch.cat([n.slots for n in path]) if path else r.kv_slots[:0]
            assert torch.equal(slots, r.kv_slots[:r.tree_len]), (
                f"invariant 1: request {r.rid}: kv_slots[:tree_len] are not the slots of its tree path")
        for read in self.loads:  # a read back locks the pool node above the nodes it reads
            assert all(x.slots is not None or self.tier_policy.pinned(x) for x in read.path), \
                "a node read back is not marked so"
            node = read.node
            while node.parent is not None:
                expected[id(node)] += 1
                node = node.parent
        for node in self.tree.nodes():
            if node.parent is not None:
                assert node.lock_ref == expected[id(node)], (
                    f"invariants 1/6: node locked {node.lock_ref} times, by {expected[id(node)]} running requests")
