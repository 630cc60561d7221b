"""Snapshots of recurrent states, keyed by the tokens that led to them: what makes a prefix of a model with
recurrent layers (Qwen3.5, LFM2, Granite 4, Mamba) reusable.

A recurrent layer's state after `p` tokens summarizes all of them; it cannot be cut back to fewer. So a
request may resume after a cached prefix of `p` tokens only where a snapshot of every recurrent layer's state
after exactly those `p` tokens (and salt) exists, its attention layers' K/V coming from the pool as for any
model. The runner puts a snapshot at a request's marks (segment.Carry: its prompt but the last token, where the
tree's K/V of its prefix reach past the deepest snapshot, where a waiting request diverges from it) and
memory.py where a request's computed tokens go into the tree (it finishes or is preempted); `deepest` finds
the longest prefix of a request's tokens that has one, which caps what admission serves from the tree.

Snapshots are opaque objects with `clone()` and `nbytes` (and `encode()` for the disk); the store holds at most
`budget` bytes of them (its share of the cache budget), the least recently used going first. A snapshot is keyed
by (salt, length, a BLAKE2b digest of the tokens): a request of one salt never resumes from another's state.

With a disk tier, `write` writes the snapshots (`encoded`) to one file in the tier's directory (`FILE`, beside the K/V files;
at every `save_cache`: close and idle autosaves; the most recently used that fit in `DISK_SHARE` of the tier's
budget, in which the file counts: disk_tier.DiskTier.side_file) and `load` reads it back at the next start, as untrustingly as
the tier reads its files (tier_file.py: no links, no blocking, copied into memory, a SHA-256 keyed by the
model's fingerprint over the description and the tensors; anything wrong is a start without snapshots).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from array import array
from collections import OrderedDict
from pathlib import Path

import torch

from . import tier_file

FILE = "snapshots.safetensors"
FORMAT = "kvql-state-snapshots-1"
DISK_SHARE = 4  # the file holds the most recently used snapshots that fit in this share of the tier's budget


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
        if self._insert(_key(salt, tokens), state):
            self.puts += 1

    def _insert(self, key: tuple, state) -> bool:
        if key in self._items:
            self._items.move_to_end(key)
            return False
        if state.nbytes > self.budget:
            return False
        self._items[key] = state
        self.bytes += state.nbytes
        lengths = self._lengths.setdefault(key[0], {})
        lengths[key[1]] = lengths.get(key[1], 0) + 1
        while self.bytes > self.budget:
            self._drop(next(iter(self._items)))
        return True

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

    def encoded(self, max_bytes: int | None = None) -> tuple[list, dict]:
        """(entries, tensors) for `write`: the snapshots, least recently used first; `max_bytes`: the most
        recently used only, as many as fit in that many bytes of states. The states are the store's own, never
        changed, so `write` may run after the caller lets the engine go on."""
        entries, tensors = [], {}
        kept, room = [], max_bytes if max_bytes is not None else float("inf")
        for item in reversed(self._items.items()):
            if item[1].nbytes > room:
                break
            kept.append(item)
            room -= item[1].nbytes
        for (salt, length, key), state in reversed(kept):
            try:
                description, own = state.encode()
            except ValueError:
                continue  # a state holding a value the file cannot: not kept across the restart
            tensors.update({f"{len(entries)}.{name}": t for name, t in own.items()})
            entries.append([salt, length, key.hex(), description])
        return entries, tensors

    def load(self, directory: Path, digest: str, decode) -> int:
        """The snapshots `save` wrote to `directory / FILE`, each rebuilt by `decode(description, tensors)`
        (as many as the budget holds, the most recently used kept); the number loaded. FileNotFoundError where
        there is none; ValueError (whatever the cause: truncated, garbage, another model's, a state `decode`
        refuses) or OSError where the file is not one this model wrote (module doc): then none is loaded."""
        fd, st = tier_file.open_regular(directory / FILE)
        try:
            if st.st_size > 2 * self.budget + tier_file.MAX_HEADER:
                raise ValueError(f"{st.st_size:,} bytes, more than the snapshots' budget holds")
            data = bytearray(st.st_size)
            tier_file.read_into(fd, data)
        finally:
            os.close(fd)
        try:
            states = _decoded(data, digest, decode)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 -- safetensors', JSON's, a state's own errors: all "not this file"
            raise ValueError(f"{type(e).__name__}: {e}") from None
        return sum(self._insert(key, state) for key, state in states)  # all decoded first: none or all of them


def _decoded(data: bytearray, digest: str, decode) -> list[tuple[tuple, object]]:
    """(key, state) of every snapshot in the file's bytes `data`, least recently used first (`StateSnapshots.load`)."""
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or n > tier_file.MAX_HEADER or n + 8 > len(data):
        raise ValueError(f"a {n:,}-byte header in a {len(data):,}-byte file")
    header = json.loads(data[8:8 + n])
    meta = (header.get("__metadata__") if isinstance(header, dict) else None) or {}
    tensors = load(bytes(data))
    text = meta.get("entries", "")
    if meta.get("kvql_format") != FORMAT or meta.get("sha256") != _sha256(digest, text, tensors):
        raise ValueError("not this model's snapshots (format or checksum)")
    states = []
    for i, (salt, length, key, description) in enumerate(json.loads(text)):
        if not isinstance(salt, (str, type(None))):  # a key of the store: a partition's name or None
            raise ValueError("a cache partition that is not a string")
        prefix = f"{i}."
        own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        states.append(((salt, int(length), bytes.fromhex(key)), decode(description, own)))
    return states


def _sha256(digest: str, text: str, tensors: dict[str, torch.Tensor]) -> str:
    """Over the format, the fingerprint's digest, the entries' description and every tensor (name, dtype, shape,
    bytes) in name order: a file of another model, or one edited, fails it (module doc)."""
    names = sorted(tensors)
    h = hashlib.sha256(json.dumps([FORMAT, digest, text] + [[n, str(tensors[n].dtype), list(tensors[n].shape)]
                                                           for n in names]).encode())
    for n in names:
        h.update(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write(directory: Path, digest: str, encoded: tuple[list, dict]) -> int:
    """Write `StateSnapshots.encoded`'s snapshots to `directory / FILE`, replacing it at once (a temporary file
    renamed; none: the file removed); the number written. `digest`: the model's fingerprint digest (module doc)."""
    entries, tensors = encoded
    path = directory / FILE
    if not entries:
        path.unlink(missing_ok=True)
        return 0
    from safetensors.torch import save_file

    text = json.dumps(entries)
    tmp = directory / f".{FILE}.{threading.get_ident()}.tmp"  # a save of its own: saves may overlap, the last wins
    save_file(tensors, str(tmp), metadata={"kvql_format": FORMAT, "entries": text,
                                           "sha256": _sha256(digest, text, tensors)})
    os.replace(tmp, path)
    return len(entries)
