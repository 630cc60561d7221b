"""Radix cache: a tree over token ids whose nodes hold the KV-pool slots of their tokens.

Token-granular: any prefix of any inserted sequence can be matched, whatever the tokenization of
the text around it, because matching is on the token ids actually fed to the model.

Contract (what callers may rely on):
- `match_prefix(tokens)` returns the slots of the longest prefix in the pool and the node ending exactly
  there (splitting a node if needed). The slots stay valid only while that node is locked.
- `insert(tokens, slots)` hands ownership of `slots[n:]` to the tree, where `n` is the returned
  count of leading tokens the tree already held in the pool; `slots[:n]` stay the caller's (free any of
  them that are not the tree's own).
- `lock(node)` / `unlock(node)` count references on the path from `node` to the root. A node whose
  count is positive, or that has a locked descendant, is never evicted.
- `evict(n)` frees at least `n` slots if it can, least recently used unlocked nodes without children in
  the pool first. Each is dropped with everything below it, unless the hook keeps it (below).
- `salt` (on `match_prefix` / `insert`) names a partition: each salt has its own root, so tokens
  inserted under one salt are never matched under another (tenant isolation; None is the shared
  default partition). An emptied salted root is dropped.

The hook (`hook`, a `TreeHook`; None: none) is how per-node state that is not the tree's lives beside it:
the disk tier's policy (tier_policy.py) keeps each node's place on disk, and state of other kinds (a
recurrent model's snapshots) would be kept the same way. Its owner keys that state by node, and the tree
tells it of every change that concerns it: a node split in two, evicted, dropped, given slots. Only the
hook makes nodes "off the pool": `evict` asks it whether to keep a node (then the node stays in the tree
without slots, its KV held by the hook) or to drop it. `match_prefix` stops before a node off the pool;
`insert` of computed tokens that such a node spells gives it the caller's slots (the pool copy wins); the
hook gives it slots it read back (`restore`).

Invariants (`check_integrity` asserts them):
1. every node but the root holds one slot per token of its key, or none (off the pool: then so does every
   node below it); no slot appears twice;
2. `lock_ref(node) >= sum(lock_ref(child))` (a lock on a node counts on all its ancestors);
3. `total_tokens` (tokens in the pool), `disk_tokens` (tokens off the pool) and `locked_tokens` (the
   tokens of locked nodes; the rest is evictable) are the counts the tree holds; only nodes in the pool
   are locked.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, NamedTuple, Protocol

import torch

_clock = itertools.count()


class Node:
    """`parent` is None only for a root (one per salt). Hashable by identity: a hook keys its state by node."""

    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], slots: torch.Tensor | None, parent: "Node | None"):
        self.key = key
        self.slots = slots  # None: off the pool (the hook holds its KV)
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)


class Match(NamedTuple):
    """`match_prefix`'s answer: the slots of the longest prefix in the pool, and the node that ends it."""

    slots: torch.Tensor
    node: Node


class Walk(NamedTuple):
    """`descend`'s answer: the last node entered (or the start), how many of the tokens the tree spells to its
    end, and the nodes entered, in order."""

    node: Node
    pos: int
    path: list[Node]


class Evicted(NamedTuple):
    """A node `evict` took out of the pool and the hook kept, with the slots it held."""

    node: Node
    slots: torch.Tensor


class TreeHook(Protocol):
    """What the tree tells the owner of per-node state beside it (module doc), and asks it."""

    def split(self, upper: Node, lower: Node) -> None:
        """`upper` was cut from the front of `lower` (its first `len(upper.key)` tokens): give it its share."""

    def keep(self, node: Node) -> bool:
        """`evict` takes `node` out of the pool: whether it stays in the tree off the pool (else it is dropped).
        A node kept here is handed to `evicted` at the end of the same `evict` call."""

    def evicted(self, kept: list[Evicted]) -> None:
        """The nodes `keep` kept in one `evict` call and still in the tree (a parent it did not keep takes its
        children with it), with the slots they held: valid until this returns (the tree frees them then)."""

    def filled(self, node: Node) -> None:
        """`insert` gave `node`, off the pool, the slots of computed tokens: it is in the pool now."""

    def dropped(self, node: Node) -> None:
        """`node` left the tree: let go of its state."""

    def pinned(self, node: Node) -> bool:
        """`node`, off the pool, must stay as it is: never dropped, and its parent never evicted (the hook is
        filling it)."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    # Compare in blocks first: list slice equality runs in C.
    i, step = 0, 64
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _in_pool(node: Node) -> bool:
    return node.slots is not None


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], device: torch.device | str = "cpu"):
        self._free_slots = free_slots
        self.device = torch.device(device)
        self.hook: TreeHook | None = None  # `observe`
        self.roots: dict[str | None, Node] = {}
        self.root = self._root(None)
        self.total_tokens = 0
        self.disk_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0  # tokens that left the pool (kept by the hook or gone)
        self.dropped_tokens = 0  # tokens that left the tree

    def observe(self, hook: TreeHook) -> None:
        """`hook` keeps per-node state beside the tree from now on (module doc): the disk tier's policy registers
        itself when it opens (after the tree exists: a tier may fail to open, and the engine then runs without
        one). One hook per tree; ValueError for a second."""
        if self.hook is not None:
            raise ValueError("this tree already has a hook")
        self.hook = hook

    def _root(self, salt: str | None) -> Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node([], torch.empty(0, dtype=torch.long, device=self.device), None)
            root.lock_ref = 1  # a root is never evicted
        return root

    # -- the walk ------------------------------------------------------------------------------
    def descend(self, tokens: list[int], salt: str | None = None, *, start: Node | None = None, pos: int = 0,
                enter: Callable[[Node], bool] | None = None) -> Walk:
        """Follow `tokens[pos:]` down from `start` (a node that spells `tokens[:pos]`; by default the root of
        `salt`) into each child that continues them and that `enter` accepts (by default every one); the last
        child entered is split where the match ends inside it. No LRU touch: the callers decide."""
        node = self._root(salt) if start is None else start
        path = []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or (enter is not None and not enter(child)):
                break
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        return Walk(node, pos, path)

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after `n` tokens; return the new upper node (same locks, access time and hook state)."""
        slots = child.slots
        upper = Node(child.key[:n], None if slots is None else slots[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.parent = child.key[n:], upper
        child.slots = None if slots is None else slots[n:]
        if self.hook is not None:
            self.hook.split(upper, child)
        return upper

    # -- lookup and insertion ------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], salt: str | None = None) -> Match:
        walk = self.descend(tokens, salt, enter=_in_pool)
        for x in walk.path:
            x.last_access = next(_clock)
        return Match(torch.cat([x.slots for x in walk.path]) if walk.path else self.root.slots, walk.node)

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Insert `tokens` with their `slots`; return how many leading tokens were already in the pool."""
        assert len(tokens) == slots.numel(), "one slot per token"
        walk = self.descend(tokens, salt)
        pos, handed = 0, None
        for x in walk.path:
            n = len(x.key)
            if x.slots is None:  # off the pool (so is all below it): our computed copy is its pool copy now
                handed = pos if handed is None else handed
                x.slots = slots[pos:pos + n].clone()
                self.total_tokens += n
                self.disk_tokens -= n
                self.hook.filled(x)
            x.last_access = next(_clock)
            pos += n
        if pos < len(tokens):
            new = walk.node.children[tokens[pos]] = Node(list(tokens[pos:]), slots[pos:].clone(), walk.node)
            self.total_tokens += len(new.key)
        return walk.pos if handed is None else handed

    def attach(self, parent: Node, key: list[int]) -> Node:
        """A new node off the pool under `parent` (a root, or off the pool too), for the hook to hold."""
        assert key and key[0] not in parent.children and (parent.parent is None or parent.slots is None)
        node = parent.children[key[0]] = Node(list(key), None, parent)
        self.disk_tokens += len(key)
        return node

    def restore(self, node: Node, slots: torch.Tensor) -> None:
        """`node`, off the pool, has its KV in `slots` now (the hook read it back into them): the tree owns them."""
        assert node.slots is None and slots.numel() == len(node.key)
        node.slots = slots
        node.last_access = next(_clock)
        self.total_tokens += len(node.key)
        self.disk_tokens -= len(node.key)

    def touch(self, node: Node) -> None:
        """Make `node` the most recently used (a saved LRU order is replayed oldest first)."""
        node.last_access = next(_clock)

    # -- locking -------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    # -- eviction ------------------------------------------------------------------------------
    def evict(self, n: int, offload: bool = True) -> int:
        """Free at least `n` pool slots from unlocked nodes without children in the pool, least recently used
        first; return the count. Each is kept off the pool if `offload` and the hook keeps it, else dropped."""
        heap = [(x.last_access, id(x), x) for x in self.nodes() if self._evictable(x)]
        heapq.heapify(heap)
        keep = self.hook.keep if offload and self.hook is not None else None
        freed, kept = 0, []
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            parent = node.parent
            if keep is not None and keep(node):
                kept.append(Evicted(node, node.slots))
                node.slots = None
                self.total_tokens -= len(node.key)
                self.disk_tokens += len(node.key)
            else:
                self._free_slots(node.slots)
                self._drop(node)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if kept:
            self.hook.evicted([x for x in kept if self.contains(x.node)])
            for x in kept:
                self._free_slots(x.slots)
        self._drop_empty_roots()
        self.evicted_tokens += freed
        return freed

    def _evictable(self, node: Node) -> bool:
        """In the pool, unlocked, no child in the pool or pinned by the hook (invariant 1)."""
        return (node.parent is not None and node.slots is not None and node.lock_ref == 0
                and not any(c.slots is not None or self.hook.pinned(c) for c in node.children.values()))

    def drop(self, node: Node) -> None:
        """Take `node`, off the pool, and everything below it out of the tree (for the hook: state it lost)."""
        assert node.slots is None
        self._drop(node)
        self._drop_empty_roots()

    def _drop(self, node: Node) -> None:
        """Take `node` and everything below it (off the pool: invariant 1) out of the tree; its slots, if any,
        are the caller's to free."""
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.slots is not None:
                self.total_tokens -= len(x.key)
            else:
                self.disk_tokens -= len(x.key)
            if self.hook is not None:
                assert not self.hook.pinned(x), "a node the hook is filling is dropped"
                self.hook.dropped(x)
            self.dropped_tokens += len(x.key)

    def _drop_empty_roots(self) -> None:
        for salt in [s for s, r in self.roots.items() if s is not None and not r.children]:
            del self.roots[salt]

    def reset(self) -> int:
        """Drop every unlocked node, off the pool too (but the ones the hook pins); return the pool slots freed."""
        freed = self.evict(self.total_tokens, offload=False)
        for node in [x for x in self.nodes() if x.slots is None and x.parent is not None and not self.hook.pinned(x)
                     and (x.parent.parent is None or x.parent.slots is not None)]:
            self._drop(node)
        self._drop_empty_roots()
        return freed

    # -- paths ---------------------------------------------------------------------------------
    def prefix_of(self, node: Node) -> list[int]:
        """The tokens on the path from the root to `node`, without `node`'s own."""
        parts = []
        node = node.parent
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def salt_of(self, node: Node) -> str | None:
        while node.parent is not None:
            node = node.parent
        return next(s for s, r in self.roots.items() if r is node)

    def contains(self, node: Node) -> bool:
        """Still in the tree (not dropped since the caller took it)."""
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                return False
            node = node.parent
        return any(root is node for root in self.roots.values())

    # -- inspection ----------------------------------------------------------------------------
    def nodes(self):
        """Every node, roots included (for inspection and integrity checks)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_nodes(self) -> int:
        return sum(1 for n in self.nodes() if n.parent is not None)

    def num_locked_nodes(self) -> int:
        return sum(1 for n in self.nodes() if n.parent is not None and n.lock_ref > 0)

    def held_slots(self) -> torch.Tensor:
        parts = [n.slots for n in self.nodes() if n.parent is not None and n.slots is not None]
        return torch.cat(parts) if parts else self.root.slots

    def check_integrity(self) -> None:
        total = disk = locked = 0
        for node in self.nodes():
            if node.parent is None:
                assert node.lock_ref == 1 and not node.key, "a root holds tokens or locks"
                continue
            assert len(node.key) > 0, "empty non-root node"
            assert node.parent.children.get(node.key[0]) is node, "node not reachable from parent"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock count below children"
            if node.slots is None:
                assert self.hook is not None, "a node off the pool without a hook to hold it"
                assert node.lock_ref == 0, "a node off the pool is locked"
                assert all(c.slots is None for c in node.children.values()), "a node in the pool below one off it"
                disk += len(node.key)
                continue
            assert node.slots.numel() == len(node.key), "node slots do not match its key"
            total += len(node.key)
            locked += len(node.key) if node.lock_ref > 0 else 0
        assert total == self.total_tokens, f"token count {total} != {self.total_tokens}"
        assert disk == self.disk_tokens, f"disk token count {disk} != {self.disk_tokens}"
        assert locked == self.locked_tokens, f"locked count {locked} != {self.locked_tokens}"
        held = self.held_slots()
        assert held.unique().numel() == held.numel(), "a slot is held twice by the tree"
