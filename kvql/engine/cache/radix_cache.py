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
- `evict(n)` frees at least `n` slots if it can, least recently used unlocked nodes without children in
  the pool first. With a disk tier (`tier`, disk_tier.py) an evicted node keeps its place in the tree and
  its KV goes to the tier (a node that has a clean copy there already writes nothing); without one, or
  while the tier's writer is behind, it is dropped with everything below it.
- Tiers: a node holds `slots` (its KV in the pool), an `extent` (its KV in a tier file) or both. A node
  without slots is "on disk": `match_prefix` stops before it; `disk_path` continues through such nodes,
  whose KV `Memory` reads back (`install` then gives them slots); `insert` of computed tokens that a disk
  node also holds gives the node the caller's slots (computed twice: the pool copy wins). When the tier is
  over its byte budget, `evict` drops least recently used disk leaves and clean copies until it is not
  (leaves of the tier first: `reclaim_disk`).
- `salt` (on `match_prefix` / `insert`) names a partition: each salt has its own root, so tokens
  inserted under one salt are never matched under another (tenant isolation; None is the shared
  default partition). An emptied salted root is dropped.

Invariants (`check_integrity` asserts them):
1. every node but the root holds one slot per token of its key, or none (on disk: then it has an extent
   of as many tokens, and so has every node below it); no slot appears twice;
2. `lock_ref(node) >= sum(lock_ref(child))` (a lock on a node counts on all its ancestors);
3. `total_tokens` (tokens in the pool), `disk_tokens` (tokens only on disk) and `locked_tokens` (the
   tokens of locked nodes; the rest is evictable) are the counts the tree holds; only nodes in the pool
   are locked.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch

_clock = itertools.count()


class Node:
    """`parent` is None only for a root (one per salt)."""

    __slots__ = ("key", "slots", "extent", "children", "parent", "lock_ref", "last_access", "loading", "fresh")

    def __init__(self, key: list[int], slots: torch.Tensor | None, parent: "Node | None", extent=None):
        self.key = key
        self.slots = slots  # None: on disk only
        self.extent = extent  # its KV in a tier file (disk_tier.Extent), or None
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.loading = False  # its KV is being read back into the pool (memory.py)
        self.fresh = False  # read back from disk and not yet served to a request (stats)


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
    def __init__(self, free_slots: Callable[[torch.Tensor], None], device: torch.device | str = "cpu", tier=None):
        self._free_slots = free_slots
        self.device = torch.device(device)
        self.tier = tier
        self.roots: dict[str | None, Node] = {}
        self.root = self._root(None)
        self.total_tokens = 0
        self.disk_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0  # tokens that left the pool (to the tier or gone)
        self.dropped_tokens = 0  # tokens that left the tree

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
            if child is None or child.slots is None:
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

    def disk_path(self, node: Node, tokens: list[int], pos: int) -> tuple[list[Node], bool]:
        """The nodes on disk that continue the match of `tokens` past `node` (which ends at `pos`; a node
        `match_prefix` returned), the last one split where the match ends; and whether one of them is being
        read back already (then nothing is split: wait for it)."""
        path = []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or child.slots is not None:
                break
            if child.loading:
                return path, True
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        return path, False

    def install(self, node: Node, slots: torch.Tensor) -> None:
        """`node`, on disk, has its KV in `slots` now (read back into them): the tree owns them."""
        assert node.slots is None and slots.numel() == len(node.key)
        node.slots = slots
        node.fresh = True
        node.last_access = next(_clock)
        self.total_tokens += len(node.key)
        self.disk_tokens -= len(node.key)

    def served_from_disk(self, node: Node) -> int:
        """Tokens on the path to `node` read back from disk and not served before (they count once)."""
        n = 0
        while node.parent is not None:
            if node.fresh:
                n += len(node.key)
                node.fresh = False
            node = node.parent
        return n

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Insert `tokens` with their `slots`; return how many leading tokens were already in the pool."""
        assert len(tokens) == slots.numel(), "one slot per token"
        node, pos, handed = self._root(salt), 0, None
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(list(tokens[pos:]), slots[pos:].clone(), node)
                node.children[tokens[pos]] = new
                self.total_tokens += len(new.key)
                return pos if handed is None else handed
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            if child.slots is None:  # on disk (so is all below it): our computed copy is its pool copy now
                handed = pos if handed is None else handed
                child.slots = slots[pos:pos + n].clone()
                child.loading = False  # a read back in flight finds it in the pool and frees its rows
                self.total_tokens += n
                self.disk_tokens -= n
            child.last_access = next(_clock)
            pos += n
            node = child
        return pos if handed is None else handed

    def add_disk_child(self, parent: Node, key: list[int], extent) -> Node:
        """Attach a new node on disk under `parent` (a node or a root), its KV at `extent`: for rebuilding
        the tree from the tier's files at start (persistence.py); `parent` must be on disk too, or a root."""
        assert key and key[0] not in parent.children and (parent.parent is None or parent.slots is None)
        node = parent.children[key[0]] = Node(list(key), None, parent, extent)
        self.disk_tokens += len(key)
        return node

    def attach_disk(self, prefix: list[int], tokens: list[int], salt, extent) -> Node | None:
        """Rebuilding from the tier's files at start (persistence.py): add the part of `tokens` after `prefix` that
        the tree does not spell yet, as a node on disk at `extent(offset, length)` (rows of the file's
        `tokens`); None if the tree does not spell `prefix` (the file's KV follows tokens no file holds) or
        already spells all of `tokens`."""
        node, pos = self._walk(prefix, salt)
        if pos < len(prefix):
            return None
        node, pos = self._walk(prefix + tokens, salt)
        covered = pos - len(prefix)
        if covered == len(tokens):
            return None
        return self.add_disk_child(node, tokens[covered:], extent(covered, len(tokens) - covered))

    def _walk(self, tokens: list[int], salt) -> tuple[Node, int]:
        """The node where the tree's spelling of `tokens` ends (split there) and how many it spells."""
        node, pos = self._root(salt), 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        return node, pos

    def touch(self, node: Node) -> None:
        """Make `node` the most recently used (a saved LRU order is replayed oldest first)."""
        node.last_access = next(_clock)

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child` after `n` tokens; return the new upper node (same locks, tiers and state as `child`)."""
        slots = child.slots
        upper = Node(child.key[:n], None if slots is None else slots[:n], child.parent)
        upper.lock_ref, upper.last_access, upper.loading = child.lock_ref, child.last_access, child.loading
        upper.fresh = child.fresh
        if child.extent is not None:
            e = child.extent
            upper.extent = type(e)(e.file, e.offset, n)
            child.extent = type(e)(e.file, e.offset + n, e.length - n)
            e.file.refs += 1
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.parent = child.key[n:], upper
        child.slots = None if slots is None else slots[n:]
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
    def evict(self, n: int, spill: bool = True) -> int:
        """Free at least `n` pool slots from unlocked nodes without children in the pool, least recently used
        first; return the count. To the tier if there is one and `spill` (module doc), else dropped."""
        heap = [(x.last_access, id(x), x) for x in self.nodes() if self._evictable(x)]
        heapq.heapify(heap)
        freed, spilled, staged = 0, [], 0  # staged: tokens this call gives the tier's writer (`room` counts them)
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            parent = node.parent
            if spill and self.tier is not None and (node.extent is not None or self.tier.room(staged + len(node.key))):
                staged += len(node.key) if node.extent is None else 0
                spilled.append((node, node.slots))
                node.slots = None
                self.total_tokens -= len(node.key)
                self.disk_tokens += len(node.key)
            else:
                self._free_slots(node.slots)
                self._drop(node)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if spilled:
            new = [(node, slots) for node, slots in spilled if node.extent is None]
            extents = self.tier.spill([(self._prefix(node), node.key, self._salt(node), slots) for node, slots in new])
            for (node, _), extent in zip(new, extents):
                node.extent = extent
            for _, slots in spilled:
                self._free_slots(slots)
            self.reclaim_disk()
        self._drop_empty_roots()
        self.evicted_tokens += freed
        return freed

    @staticmethod
    def _evictable(node: Node) -> bool:
        """In the pool, unlocked, no child in the pool or being read back into it (invariant 1)."""
        return (node.parent is not None and node.slots is not None and node.lock_ref == 0
                and not any(c.slots is not None or c.loading for c in node.children.values()))

    def _drop(self, node: Node) -> None:
        """Take `node` and everything below it (on disk: invariant 1) out of the tree; its slots, if any, are
        the caller's to free."""
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            x = stack.pop()
            assert not x.loading, "a node being read back is dropped"
            stack.extend(x.children.values())
            if x.slots is not None:
                self.total_tokens -= len(x.key)
            else:
                self.disk_tokens -= len(x.key)
            if x.extent is not None:
                self.tier.release(x.extent)
                x.extent = None
            self.dropped_tokens += len(x.key)

    def drop_disk(self, node: Node) -> None:
        """Drop `node`, on disk, and everything below it: its KV could not be read back (a miss)."""
        assert node.slots is None
        node.loading = False
        self._drop(node)
        self._drop_empty_roots()

    def reclaim_disk(self) -> None:
        """While the tier is over its budget: drop least recently used disk leaves and clean copies of nodes in
        the pool, in both cases only extents no child's extent follows (as `evict` takes leaves: a file whose
        prefix's file is gone could not be attached at the next start); a node being read back stays."""
        if not self.tier.over_budget():
            return
        heap = [(x.last_access, id(x), x) for x in self.nodes() if self._reclaimable(x)]
        heapq.heapify(heap)
        while heap and self.tier.over_budget():
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if node.slots is not None:  # a clean copy: the node stays, in the pool
                self.tier.release(node.extent)
                node.extent = None
            else:
                self._drop(node)
            if self._reclaimable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._drop_empty_roots()

    @staticmethod
    def _reclaimable(node: Node) -> bool:
        """Its extent may go: not being read back, and no child has an extent (a node on disk: no child)."""
        return (node.parent is not None and node.extent is not None and not node.loading
                and not any(c.extent is not None for c in node.children.values()))

    def _drop_empty_roots(self) -> None:
        for salt in [s for s, r in self.roots.items() if s is not None and not r.children]:
            del self.roots[salt]

    def reset(self) -> int:
        """Drop every unlocked node, on disk too (nodes being read back stay); return the pool slots freed."""
        freed = self.evict(self.total_tokens, spill=False)
        for node in [x for x in self.nodes() if x.slots is None and x.parent is not None and not x.loading
                     and (x.parent.parent is None or x.parent.slots is not None)]:
            self._drop(node)
        self._drop_empty_roots()
        return freed

    def unwritten(self) -> list[Node]:
        """The nodes in the pool that have no copy on disk (`write_back` gives them one)."""
        return [x for x in self.nodes() if x.parent is not None and x.slots is not None and x.extent is None]

    def write_back(self, todo: list[Node]) -> tuple[int, list[Node]]:
        """Stage clean copies of the nodes of `todo` (from `unwritten`) that still need one, as many as the tier's
        writer takes now (one at least); nothing is freed. Returns the tokens staged and the nodes left to do."""
        todo = [x for x in todo if x.slots is not None and x.extent is None and self._reachable(x)]
        batch, n = [], 0
        while todo and (not batch or self.tier.room(n + len(todo[-1].key))):
            batch.append(todo.pop())
            n += len(batch[-1].key)
        extents = self.tier.spill([(self._prefix(x), x.key, self._salt(x), x.slots) for x in batch])
        for x, extent in zip(batch, extents):
            x.extent = extent
        return n, todo

    def order_files(self) -> None:
        """Give the tier's files the tree's LRU order (disk_tier.DiskTier.order): a restart keeps it."""
        files = {}
        for x in sorted((x for x in self.nodes() if x.extent is not None), key=lambda x: x.last_access):
            files.pop(x.extent.file, None)
            files[x.extent.file] = None  # a file's place: its most recently used node's
        self.tier.order(list(files))

    def _reachable(self, node: Node) -> bool:
        """Still in the tree (not dropped since it was listed)."""
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                return False
            node = node.parent
        return any(root is node for root in self.roots.values())

    def _prefix(self, node: Node) -> list[int]:
        """The tokens on the path from the root to `node`, without `node`'s own."""
        parts = []
        node = node.parent
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return [t for key in reversed(parts) for t in key]

    def _salt(self, node: Node):
        while node.parent is not None:
            node = node.parent
        return next(s for s, r in self.roots.items() if r is node)

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
            if node.extent is not None:
                e = node.extent
                assert self.tier is not None and e.length == len(node.key) and e.file.refs > 0, \
                    "a node's extent does not match its key"
            if node.slots is None:
                assert node.extent is not None, "a node holds neither slots nor an extent"
                assert node.lock_ref == 0, "a node on disk is locked"
                assert all(c.slots is None for c in node.children.values()), "a node in the pool below one on disk"
                disk += len(node.key)
                continue
            assert node.slots.numel() == len(node.key), "node slots do not match its key"
            assert not node.loading, "a node in the pool is being read back"
            total += len(node.key)
            locked += len(node.key) if node.lock_ref > 0 else 0
        assert total == self.total_tokens, f"token count {total} != {self.total_tokens}"
        assert disk == self.disk_tokens, f"disk token count {disk} != {self.disk_tokens}"
        assert locked == self.locked_tokens, f"locked count {locked} != {self.locked_tokens}"
        held = self.held_slots()
        assert held.unique().numel() == held.numel(), "a slot is held twice by the tree"
