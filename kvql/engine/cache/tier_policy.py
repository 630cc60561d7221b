"""Tier policy: which radix-tree nodes have their KV on disk, when it goes there, and when it leaves.

The tree (radix_cache.py) holds the pool's slots; the disk tier (disk_tier.py) moves bytes. Between them this
policy is the tree's hook (`RadixCache.hook`) and keeps a `TierRecord` per node that has tier state: its
`Extent` (where its KV is in a tier file), whether it is being read back, whether it was read back and not yet
served. A node holds slots, an extent or both (a clean copy: evicting it again writes nothing). It decides:
- Spill: a node `evict` takes out of the pool stays in the tree off the pool, its KV staged for the tier's
  writer, if it has a clean copy already or the writer has room (`DiskTier.room`); else it is dropped with
  everything below it (as without a tier), so a node kept earlier in the same eviction may go with it (then
  nothing is written for it: the file would be held by no node).
- Reclaim: while the tier is over its byte budget, least recently used extents go, only ones no child's
  extent follows (a file whose prefix's file is gone could not be attached at the next start): a node off the
  pool is dropped with it, a clean copy of a node in the pool only loses its copy; a node being read back stays.
- Write-back: clean copies of the nodes only the pool holds (`unwritten`, `write_back`: saving the cache).
- Ordering: the tier's files get the tree's LRU order (`order`), which a restart replays.
- Attach: at start the tree is rebuilt from the tier's files (`rebuild`), every node off the pool.
- Reading back (for `Memory`, which owns the slots read into): `disk_path` finds the nodes off the pool that
  continue a match, `read` reads them, `install` hands their slots to the tree, `miss` drops what failed.

Invariants (`check_integrity`): every node off the pool has an extent of as many tokens as its key (its file
live); no node in the pool is being read back; records are of nodes in the tree only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .disk_tier import DiskTier
from .tier_items import Extent, Load, ReadItem, ScannedFile, SpillItem
from .radix_cache import Evicted, Node, RadixCache


@dataclass(slots=True)
class TierRecord:
    """A node's tier state (module doc); a node without one has none of it."""

    extent: Extent | None = None
    loading: bool = False  # its KV is being read back into the pool (memory.py)
    fresh: bool = False  # read back from disk and not yet served to a request (stats)


class DiskPath(NamedTuple):
    """The nodes off the pool that continue a match, in order; `busy`: one of them is being read back already."""

    nodes: list[Node]
    busy: bool


class WriteBack(NamedTuple):
    """What one `write_back` staged (tokens) and the nodes it left for the next."""

    tokens: int
    todo: list[Node]


class TierPolicy:
    def __init__(self, disk: DiskTier, tree: RadixCache):
        """The policy of `disk` for `tree`, which it observes from now on (`RadixCache.observe`)."""
        self.disk, self.tree = disk, tree
        self._records: dict[Node, TierRecord] = {}
        self._staged = 0  # tokens the current `evict` call gives the writer (`keep` asks `room` for them all)
        tree.observe(self)

    def extent(self, node: Node) -> Extent | None:
        """Where `node`'s KV is on disk, or None."""
        record = self._records.get(node)
        return None if record is None else record.extent

    def _record(self, node: Node) -> TierRecord:
        record = self._records.get(node)
        if record is None:
            record = self._records[node] = TierRecord()
        return record

    # -- the tree's hook (radix_cache.TreeHook) ------------------------------------------------------------
    def split(self, upper: Node, lower: Node) -> None:
        record = self._records.get(lower)
        if record is None:
            return
        n, e = len(upper.key), record.extent
        top = self._records[upper] = TierRecord(loading=record.loading, fresh=record.fresh)
        if e is not None:  # both halves read from the same file
            top.extent = Extent(e.file, e.offset, n)
            record.extent = Extent(e.file, e.offset + n, e.length - n)
            e.file.refs += 1

    def keep(self, node: Node) -> bool:
        if self.extent(node) is not None:
            return True  # a clean copy: nothing to write
        if self.disk.room(self._staged + len(node.key)):
            self._staged += len(node.key)
            return True
        return False

    def evicted(self, kept: list[Evicted]) -> None:
        self._staged = 0
        self._spill([x for x in kept if self.extent(x.node) is None])
        self.reclaim()

    def filled(self, node: Node) -> None:
        record = self._records.get(node)
        if record is not None:
            record.loading = False  # a read back in flight finds it in the pool and frees its rows

    def dropped(self, node: Node) -> None:
        record = self._records.pop(node, None)
        if record is not None and record.extent is not None:
            self.disk.release(record.extent)

    def pinned(self, node: Node) -> bool:
        record = self._records.get(node)
        return record is not None and record.loading

    # -- spill, reclaim, write-back, order -------------------------------------------------------------------
    def _spill(self, nodes: list[Evicted]) -> None:
        """Stage each node's KV (read from its slots before they are freed) for the writer; it has an extent now."""
        extents = self.disk.spill([SpillItem(self.tree.prefix_of(x.node), x.node.key, self.tree.salt_of(x.node),
                                             x.slots) for x in nodes])
        for x, extent in zip(nodes, extents):
            self._record(x.node).extent = extent

    def reclaim(self) -> None:
        """While the tier is over its budget: drop least recently used extents (module doc)."""
        if not self.disk.over_budget():
            return
        heap = [(x.last_access, id(x), x) for x in self._records if self._reclaimable(x)]
        heapq.heapify(heap)
        while heap and self.disk.over_budget():
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if node.slots is not None:  # a clean copy: the node stays, in the pool
                record = self._records[node]
                self.disk.release(record.extent)
                record.extent = None
            else:
                self.tree.drop(node)
            if self._reclaimable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _reclaimable(self, node: Node) -> bool:
        """Its extent may go: not being read back, and no child has an extent (a node off the pool: no child)."""
        record = self._records.get(node)
        return (record is not None and record.extent is not None and not record.loading
                and not any(self.extent(c) is not None for c in node.children.values()))

    def unwritten(self) -> list[Node]:
        """The nodes in the pool that have no copy on disk (`write_back` gives them one)."""
        return [x for x in self.tree.nodes() if x.parent is not None and x.slots is not None and self.extent(x) is None]

    def write_back(self, todo: list[Node]) -> WriteBack:
        """Stage clean copies of the nodes of `todo` (from `unwritten`) that still need one, as many as the tier's
        writer takes now (one at least); nothing is freed."""
        todo = [x for x in todo if x.slots is not None and self.extent(x) is None and self.tree.contains(x)]
        batch, n = [], 0
        while todo and (not batch or self.disk.room(n + len(todo[-1].key))):
            batch.append(todo.pop())
            n += len(batch[-1].key)
        self._spill([Evicted(x, x.slots) for x in batch])
        return WriteBack(n, todo)

    def order(self) -> None:
        """Give the tier's files the tree's LRU order (disk_tier.DiskTier.order): a restart keeps it."""
        files = {}
        for x in sorted((x for x in self.tree.nodes() if self.extent(x) is not None), key=lambda x: x.last_access):
            file = self._records[x].extent.file
            files.pop(file, None)
            files[file] = None  # a file's place: its most recently used node's
        self.disk.order(list(files))

    # -- attach ----------------------------------------------------------------------------------------------
    def rebuild(self, vocab_size: int) -> None:
        """Every file of the tier whose prefix the others spell becomes a node off the pool, least recently used
        first in the LRU order; files no node can use are deleted; then the budget is enforced."""
        used = []
        for found in self.disk.scan(vocab_size):
            node = self._attach(found)
            if node is not None:
                used.append((found.mtime_ns, node))
        for _, node in sorted(used, key=lambda u: u[0]):
            self.tree.touch(node)
        self.reclaim()

    def _attach(self, found: ScannedFile) -> Node | None:
        """The part of the file's tokens after its prefix that the tree does not spell yet, as a node off the pool
        at those rows of the file; None (the file released) if the tree does not spell its prefix (its KV follows
        tokens no file holds) or spells all of its tokens already."""
        file = self.disk.adopt(found.path, found.bytes)
        walk = self.tree.descend(found.prefix, found.salt)
        covered = 0
        if walk.pos == len(found.prefix):
            walk = self.tree.descend(found.prefix + found.tokens, start=walk.node, pos=walk.pos)
            covered = walk.pos - len(found.prefix)
        if walk.pos < len(found.prefix) or covered == len(found.tokens):
            self.disk.release_unused(file)
            return None
        node = self.tree.attach(walk.node, found.tokens[covered:])
        file.refs += 1
        self._record(node).extent = Extent(file, covered, len(found.tokens) - covered)
        return node

    # -- reading back (memory.py) -----------------------------------------------------------------------------
    def disk_path(self, node: Node, tokens: list[int], pos: int) -> DiskPath:
        """The nodes off the pool that continue the match of `tokens` past `node` (which ends at `pos`; a node
        `match_prefix` returned), the last one split where the match ends; and whether one of them is being
        read back already (then nothing is split: wait for it)."""
        walk = self.tree.descend(tokens, start=node, pos=pos, enter=lambda c: c.slots is None and not self.pinned(c))
        stop = walk.node.children.get(tokens[walk.pos]) if walk.pos < len(tokens) else None
        return DiskPath(walk.path, stop is not None and stop.slots is None and self.pinned(stop))

    def reading(self, nodes: list[Node], on: bool) -> None:
        """Mark `nodes` (off the pool) as being read back, or no longer."""
        for x in nodes:
            self._records[x].loading = on

    def read(self, nodes: list[Node], tokens: list[int], pos: int, salt, slots: torch.Tensor) -> Load:
        """Start reading back `nodes` (a `disk_path` from `pos` of `tokens`) into `slots`, in order."""
        items = []
        for x in nodes:
            items.append(ReadItem(self._records[x].extent, tokens[:pos], x.key, salt))
            pos += len(x.key)
        return self.disk.read(items, slots)

    def install(self, node: Node, slots: torch.Tensor) -> None:
        """`node`, read back, has its KV in `slots`: the tree owns them."""
        record = self._records[node]
        record.loading = False
        self.tree.restore(node, slots)
        record.fresh = True

    def miss(self, nodes: list[Node], node: Node) -> None:
        """The read of `nodes` failed at `node`: it and everything below it leave the tree (computed again)."""
        for x in nodes:
            record = self._records.get(x)
            if record is not None:
                record.loading = False
        self.tree.drop(node)

    def served(self, node: Node, limit: int | None = None) -> int:
        """Of the first `limit` tokens (None: all) on the path to `node`, those read back from disk and not served
        before. They count once: a node partly within `limit` is spent too, so the count never exceeds what a
        request was served (a hybrid model's admission serves its match only up to a snapshot: memory.py)."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        n, start = 0, 0
        for x in reversed(path):
            if limit is not None and start >= limit:
                break
            record = self._records.get(x)
            if record is not None and record.fresh:
                n += len(x.key) if limit is None else min(len(x.key), limit - start)
                record.fresh = False
            start += len(x.key)
        return n

    def check_integrity(self) -> None:
        live = set()
        for node in self.tree.nodes():
            if node.parent is None:
                continue
            live.add(node)
            record = self._records.get(node)
            e = None if record is None else record.extent
            if e is not None:
                assert e.length == len(node.key) and e.file.refs > 0, "a node's extent does not match its key"
            if node.slots is None:
                assert e is not None, "a node holds neither slots nor an extent"
            else:
                assert record is None or not record.loading, "a node in the pool is being read back"
        assert live.issuperset(self._records), "tier state of a node no longer in the tree"
