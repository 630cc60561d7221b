"""Radix cache: a tree over token ids whose nodes hold the KV-pool slots of their tokens.

Token-granular: any prefix of any inserted sequence can be matched, whatever the tokenization of
the text around it, because matching is on the token ids actually fed to the model.

Contract (what callers may rely on):
- `match_prefix(tokens)` returns the slots of the longest cached prefix and the node ending exactly
  there (splitting a node if needed). The slots stay valid only while that node is locked.
- `insert(tokens, slots)` hands ownership of `slots[n:]` to the tree, where `n` is the returned
  count of leading tokens the tree already held; `slots[:n]` stay the caller's (free any of them
  that are not the tree's own).
- `lock(node)` / `unlock(node)` count references on the path from `node` to the root. A node whose
  count is positive, or that has a locked descendant, is never evicted.
- `evict(n)` frees at least `n` slots if it can, least recently used unlocked leaves first.
- `salt` (on `match_prefix` / `insert`) names a partition: each salt has its own root, so tokens
  inserted under one salt are never matched under another (tenant isolation; None is the shared
  default partition). An emptied salted root is dropped.

Invariants (`check_integrity` asserts them):
1. every node but the root holds one slot per token of its key; no slot appears twice;
2. `lock_ref(node) >= sum(lock_ref(child))` (a lock on a node counts on all its ancestors);
3. `total_tokens` and `locked_tokens` (the tokens of locked nodes; the rest is evictable) are the counts the tree holds.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch

_clock = itertools.count()


class Node:
    """`parent` is None only for a root (one per salt)."""

    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], slots: torch.Tensor, parent: "Node | None"):
        self.key = key
        self.slots = slots
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)


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


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], device: torch.device | str = "cpu"):
        self._free_slots = free_slots
        self.device = torch.device(device)
        self.roots: dict[str | None, Node] = {}
        self.root = self._root(None)
        self.total_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0

    def _root(self, salt: str | None) -> Node:
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node([], torch.empty(0, dtype=torch.long, device=self.device), None)
            root.lock_ref = 1  # a root is never evicted
        return root

    # -- lookup and insertion ------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[torch.Tensor, Node]:
        node, pos, parts = self._root(salt), 0, []
        node.last_access = next(_clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            parts.append(child.slots)
            pos += n
            node = child
        slots = torch.cat(parts) if parts else self.root.slots
        return slots, node

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Insert `tokens` with their `slots`; return how many leading tokens were already cached."""
        assert len(tokens) == slots.numel(), "one slot per token"
        node, pos = self._root(salt), 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(list(tokens[pos:]), slots[pos:].clone(), node)
                node.children[tokens[pos]] = new
                self.total_tokens += len(new.key)
                return pos
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(_clock)
            pos += n
            node = child
        return pos

    def add_child(self, parent: Node | None, key: list[int], slots: torch.Tensor, salt: str | None = None) -> Node:
        """Attach a new unlocked node under `parent` (None: the root of `salt`) and give the tree
        `slots`, one per token of `key`; no child of `parent` may start with `key[0]`. For rebuilding a
        saved tree (snapshot.py); `insert` is the way in for computed requests."""
        parent = self._root(salt) if parent is None else parent
        assert key and len(key) == slots.numel() and key[0] not in parent.children, "not a new edge"
        node = parent.children[key[0]] = Node(list(key), slots, parent)
        self.total_tokens += len(key)
        return node

    def touch(self, node: Node) -> None:
        """Make `node` the most recently used (a saved LRU order is replayed oldest first)."""
        node.last_access = next(_clock)

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after `n` tokens; return the new upper node (same locks as `child`)."""
        upper = Node(child.key[:n], child.slots[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

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
    def evict(self, n: int) -> int:
        """Free at least `n` slots from unlocked leaves, least recently used first; return count."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            self._free_slots(leaf.slots)
            freed += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        for salt in [s for s, r in self.roots.items() if s is not None and not r.children]:
            del self.roots[salt]
        self.evicted_tokens += freed
        return freed

    def reset(self) -> int:
        """Evict every unlocked node; return the number of slots freed."""
        return self.evict(self.total_tokens)

    # -- inspection ----------------------------------------------------------------------------
    def nodes(self):
        """Every node, roots included (for inspection and integrity checks)."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self):
        return (n for n in self.nodes() if not n.children and n.parent is not None)

    def num_nodes(self) -> int:
        return sum(1 for n in self.nodes() if n.parent is not None)

    def num_locked_nodes(self) -> int:
        return sum(1 for n in self.nodes() if n.parent is not None and n.lock_ref > 0)

    def held_slots(self) -> torch.Tensor:
        parts = [n.slots for n in self.nodes() if n.parent is not None]
        return torch.cat(parts) if parts else self.root.slots

    def check_integrity(self) -> None:
        total = locked = 0
        for node in self.nodes():
            if node.parent is None:
                assert node.lock_ref == 1 and not node.key, "a root holds tokens or locks"
                continue
            assert len(node.key) > 0, "empty non-root node"
            assert node.slots.numel() == len(node.key), "node slots do not match its key"
            assert node.parent.children.get(node.key[0]) is node, "node not reachable from parent"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock count below children"
            total += len(node.key)
            locked += len(node.key) if node.lock_ref > 0 else 0
        assert total == self.total_tokens, f"token count {total} != {self.total_tokens}"
        assert locked == self.locked_tokens, f"locked count {locked} != {self.locked_tokens}"
        held = self.held_slots()
        assert held.unique().numel() == held.numel(), "a slot is held twice by the tree"
