"""Persistence of an engine's cache (`Persistence`, one per engine, given what it uses): the disk tier
opened at start with its policy (tier_policy.py: it observes the tree; `Memory.tier_policy`) and the tree rebuilt
from its files, the pool's nodes written to it (`save_cache`: when idle every `save_interval` seconds,
autosave.py, and at `close`), the fingerprint that names its directory. One format: the tier's files
(disk_tier.py) are both the second cache tier and what a restart starts from.

Never fails a start over a cache: a directory another process holds (disk_tier.TierBusy), or one that cannot be
created, read or written (disk_tier.TierUnavailable: a read-only or full disk, a file in its place) is one WARNING
line (logger `kvql.cache`) and the engine runs with its memory budget alone; unusable files are misses
(disk_tier.py). (A disk too full for the default `disk_budget` is told apart earlier: kvql.backends.local.)"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from .disk_tier import DiskTier, TierUnavailable
from .tier_file import FORMAT
from .fingerprint import fingerprint
from . import state_snapshots
from .tier_policy import TierPolicy

log = logging.getLogger("kvql.cache")
LEGACY = "kv-cache-*.safetensors"
"""The single-file snapshots that `cache_dir` kept before it became the disk tier (no longer read)."""


class Persistence:
    """The cache's disk tier for one engine: its state lock (`state`: a step and a save's batches take turns), tree,
    memory, pool, runner and tokenizer, given at construction. `saves`: `save_cache` calls done."""

    def __init__(self, state, tree, memory, pool, runner, tokenizer):
        self._state, self.tree, self.memory, self.pool = state, tree, memory, pool
        self.runner, self.tokenizer = runner, tokenizer
        self._fingerprint: dict[str, str] | None = None  # fingerprint.py
        self.saves = 0

    def fingerprint(self) -> dict[str, str]:
        """What the KV in a tier directory must have been computed with to be used here (fingerprint.py);
        computed once: weights changed under a live engine would make its cache stale anyway."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.runner.model, self.tokenizer, self.pool, FORMAT)
        return self._fingerprint

    def open(self, directory, budget: int) -> bool:
        """The disk tier at `directory` (module doc), the tree rebuilt from its files; False where it cannot be
        used (one warning)."""
        legacy = sorted(p.name for p in Path(directory).expanduser().glob(LEGACY))
        if legacy:
            log.warning("%s holds %d cache snapshot(s) of an earlier kvql (%s), which this one does not read: the "
                        "cache is kept in %s/<model digest>/ now; delete them", directory, len(legacy),
                        ", ".join(legacy), directory)
        try:
            tier = DiskTier(directory, self.fingerprint(), self.pool, budget)
        except TierUnavailable as e:  # TierBusy among them
            log.warning("disk cache not used: %s; this model keeps its cache in memory only", e)
            return False
        policy = TierPolicy(tier, self.tree)  # the tree's hook from now on, which memory reads as its tier_policy
        policy.rebuild(int(self.runner.model.config.get_text_config().vocab_size))
        snapshots = self.memory.snapshots
        if snapshots is not None:  # a model with recurrent layers: its states' snapshots (state_snapshots.py)
            try:
                snapshots.load(tier.path, tier.digest, self.runner.states.decode_state)
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 -- a file that cannot serve is a start without it (module doc)
                log.warning("kvql disk tier: %s not used (%s); prefixes are resumed from snapshots taken from now "
                            "on", tier.path / state_snapshots.FILE, e)
        tier.side_file(_size(tier.path / state_snapshots.FILE))  # in the budget until the next save replaces it
        return True

    def save_cache(self) -> dict:
        """Write every node that only the pool holds to the disk tier (a clean copy: evicting it later writes
        nothing) and give the files the tree's LRU order; `{"tokens": written, "tier_bytes": ...}` once the files
        are on disk. Steps run between batches of at most disk_tier.MAX_STAGED bytes: holding the engine only
        while a batch is copied out of the pool. ValueError without a disk tier."""
        policy = self.memory.tier_policy
        if policy is None or policy.disk.closed:
            raise ValueError("save_cache needs an open disk tier: kvql.model(..., disk_cache=DIR)")
        tier, written = policy.disk, 0
        with self._state:
            todo = policy.unwritten()
        while todo:
            with self._state:
                staged = policy.write_back(todo)
            written, todo = written + staged.tokens, staged.todo
            tier.flush()
        snapshots = self.memory.snapshots
        if snapshots is not None:  # in the tier's budget, at most a share of it; written with the engine going on
            with self._state:
                encoded = snapshots.encoded(tier.budget // state_snapshots.DISK_SHARE)
            state_snapshots.write(tier.path, tier.digest, encoded)
            tier.side_file(_size(tier.path / state_snapshots.FILE))
        with self._state:
            policy.reclaim()
            policy.order()
        tier.flush()
        self.saves += 1
        return {"tokens": written, "tier_bytes": tier.bytes}

    def close(self) -> None:
        """At `close` (holding the engine, its autosave stopped): finish reads in flight, write the pool's nodes,
        let go of the tier."""
        policy = self.memory.tier_policy
        if policy is None or policy.disk.closed:
            return
        for read in self.memory.loads:
            read.load.done.wait()
        self.memory.install_loads()
        self.save_cache()  # the next start finds what only the pool held
        policy.disk.close()


def _size(path: Path) -> int:
    """The size of a regular file at `path` (not followed where it is a link), 0 where there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
