"""What the disk tier (disk_tier.py) and its policy (tier_policy.py) hand each other: a tier file, the extent of
a node's K/V in it, the items to write and to read back, a file found at start, a read in flight."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch


class TierFile:
    """One file of the tier. `staging` holds (prefix, tokens, k, v) until the writer has written it. `bytes`: its
    size (until it is written, an upper bound of it); `refs`: extents of tree nodes in it (engine thread)."""

    def __init__(self, path: Path, nbytes: int, refs: int, staging=None):
        self.path, self.bytes, self.refs, self.staging = path, nbytes, refs, staging
        self.lock = threading.Lock()  # guards `staging` between the writer and the reader


@dataclass
class Extent:
    """Rows `[offset, offset + length)` of `file`'s tokens: where a node's KV is on disk."""

    file: TierFile
    offset: int
    length: int


class SpillItem(NamedTuple):
    """A node's KV to write: the tokens on its tree path before it, its own, its partition, its pool slots."""

    prefix: list[int]
    tokens: list[int]
    salt: str | None
    slots: torch.Tensor


class ReadItem(NamedTuple):
    """A node's KV to read back from `extent`, checked against the tree path it is read for (module doc)."""

    extent: Extent
    prefix: list[int]
    tokens: list[int]
    salt: str | None


class ScannedFile(NamedTuple):
    """A usable file `scan` found: its modification time (the LRU order), size and what it holds."""

    mtime_ns: int
    path: Path
    bytes: int
    salt: str | None
    prefix: list[int]
    tokens: list[int]


@dataclass
class Load:
    """A read of several extents into pool slots (reader thread); `ok[i]` per item once `done` is set."""

    items: list[ReadItem]
    slots: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    ok: list[bool] = field(default_factory=list)
