"""Snapshots of recurrent states, keyed by the tokens that led to them: what makes a prefix of a model with
recurrent layers (Qwen3.5, LFM2, Granite 4, Mamba) reusable.

A recurrent layer's state after `p` tokens summarizes all of them; it cannot be cut back to fewer. So a
request may resume after a cached prefix of `p` tokens only where a snapshot of every recurrent layer's state
after exactly those `p` tokens (and salt) exists, its attention layers' K/V coming from the pool as for any
model. The runner puts a snapshot at a request's marks (segment.Carry: its prompt but the last token, where the
tree's K/V of its prefix reach past the deepest snapshot, where a waiting request diverges from it) and
memory.py where a request's computed tokens go into the tree (it finishes or is preempted); `deepest` finds
the longest prefix of a request's tokens that has one, which caps what admission serves from the tree.

Snapshots are opaque objects with `clone()` and `nbytes`; the store holds at most `budget` bytes of them (its
share of the cache budget), the least recently used going first. A snapshot is keyed by (salt, length, a
BLAKE2b digest of the tokens): a request of one salt never resumes from another's state.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def _key(salt, tokens: list[int]) -> tuple:
    return salt, len(tokens), hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


class StateSnapshots:
    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self._items: OrderedDict[tuple, object] = OrderedDict()
        self._lengths: dict[object, dict[int, int]] = {}  # salt -> {length: snapshots of it}
        self.puts = self.hits = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, salt, tokens: list[int], state) -> None:
        """Keep `state` (owned by the store from here on) as the state after `tokens`; a snapshot larger than
        the whole budget is not kept."""
        key = _key(salt, tokens)
        if key in self._items:
            self._items.move_to_end(key)
            return
        if state.nbytes > self.budget:
            return
        self._items[key] = state
        self.bytes += state.nbytes
        lengths = self._lengths.setdefault(salt, {})
        lengths[len(tokens)] = lengths.get(len(tokens), 0) + 1
        self.puts += 1
        while self.bytes > self.budget:
            self._drop(next(iter(self._items)))

    def clear(self) -> None:
        self._items.clear()
        self._lengths.clear()
        self.bytes = 0

    def _drop(self, key: tuple) -> None:
        self.bytes -= self._items.pop(key).nbytes
        lengths = self._lengths[key[0]]
        lengths[key[1]] -= 1
        if not lengths[key[1]]:
            del lengths[key[1]]
            if not lengths:  # (one partition per API key on a server: none kept empty)
                del self._lengths[key[0]]

    def deepest(self, salt, tokens: list[int], limit: int) -> int:
        """The longest `p <= limit` such that a snapshot after `tokens[:p]` exists; 0 if none."""
        for p in sorted((x for x in self._lengths.get(salt, ()) if 0 < x <= limit), reverse=True):
            if _key(salt, tokens[:p]) in self._items:
                return p
        return 0

    def get(self, salt, tokens: list[int]):
        """A copy of the state after `tokens` (which must have one: `deepest`), now the most recently used."""
        key = _key(salt, tokens)
        self._items.move_to_end(key)
        self.hits += 1
        return self._items[key].clone()
