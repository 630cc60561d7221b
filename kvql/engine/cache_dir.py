"""Cache dir: when an engine's cache is read from and written to disk (the format: snapshot.py).

A directory keeps one snapshot per model fingerprint (model, dtype, device, KV geometry, tokenizer,
format: `snapshot.fingerprint`), named `snapshot_path(directory, fingerprint)`: `kv-cache-<16 hex digits
of the fingerprint's SHA-256>.safetensors`. Models of several dtypes or weights pointed at one directory
(`kvql run` and `kvql serve` with `--cache-dir`, say) each find their own snapshot and never overwrite
another's; each file is at most its model's cache budget, and a fingerprint no model has any more (a
format bump, weights retrained) leaves its file there until it is deleted.

`CacheDir(engine, directory, save_interval)`:
- at once: loads the engine's snapshot if it is there. One that is there but unusable (a hash
  collision or a renamed file of another fingerprint, a truncated or corrupt file) is logged in one
  WARNING line (logger `kvql.cache`) and the engine starts cold: a snapshot never fails the start and
  never gives a token another model would not have given. Temporary files of saves killed mid-write,
  this fingerprint's or another's, are removed first (`snapshot.remove_stale`).
- every `save_interval` seconds (0: never), when the engine is idle and its cache changed since the
  last save or load, saves it (between steps: `Engine.save_cache`). A save failure is one WARNING
  line; serving goes on.
- `close()` (also at interpreter exit): stops the timer, closes the engine (its pending requests
  are cancelled; their computed KV stays in the tree, unlocked), then saves if anything changed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
import weakref
from pathlib import Path

from .snapshot import SnapshotError, remove_stale

PREFIX, SUFFIX = "kv-cache-", ".safetensors"
log = logging.getLogger("kvql.cache")


def snapshot_path(directory, fingerprint: dict[str, str]) -> Path:
    """Where the snapshot of the model with `fingerprint` lives in `directory`. 16 hex digits (64 bits)
    keep names short; two fingerprints sharing them would share a file, which the fingerprint check
    inside it then refuses (one WARNING line, a cold start), never loads."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory).expanduser() / f"{PREFIX}{digest}{SUFFIX}"


def _saved(directory: Path) -> set[str]:
    """The names of the snapshots saved in `directory`."""
    return {p.name for p in directory.glob(f"{PREFIX}*{SUFFIX}")}


def _saving(directory: Path) -> set[str]:
    """The names of the snapshots that temporary files in `directory` are (or were, if killed) saves of."""
    return {p.name[1:].split(SUFFIX)[0] + SUFFIX for p in directory.glob(f".{PREFIX}*{SUFFIX}.*.tmp")}


_open: "weakref.WeakSet[CacheDir]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Before or after engine.py's own handler: closing an engine twice is a no-op, a closed one still saves.
    for cache in list(_open):
        cache.close()


class CacheDir:
    def __init__(self, engine, directory, save_interval: float = 300.0):
        if save_interval < 0:
            raise ValueError(f"cache_save_interval must be >= 0 seconds, got {save_interval!r}")
        self.engine = engine
        self.path = snapshot_path(directory, engine.fingerprint())
        self.save_interval = float(save_interval)
        self.saves = 0
        self._lock = threading.Lock()  # one save at a time; close() once
        self._closed = False
        self._stop = threading.Event()
        self.load()
        self._saved = self._version()
        _open.add(self)
        self._timer = None
        if self.save_interval > 0:
            self._timer = threading.Thread(target=self._run, name="kvql-cache-save", daemon=True)
            self._timer.start()

    def load(self) -> None:
        """Load the snapshot, or log one line saying why not and leave the cache empty. Temporary files of
        saves killed mid-write are removed first (snapshot.remove_stale), whichever snapshot they were for."""
        directory = self.path.parent
        stale = sum(remove_stale(directory / name) for name in _saving(directory))
        if stale:
            log.warning("removed %d temporary file(s) of interrupted saves in %s", stale, directory)
        if not self.path.exists():
            others = len(_saved(directory) - {self.path.name})
            note = f" ({others} other snapshot(s) there: other models or dtypes)" if others else ""
            log.info("no cache snapshot of this model (weights, dtype, tokenizer) at %s%s: starting with an empty "
                     "cache", self.path, note)
            return
        t0 = time.perf_counter()
        try:
            got = self.engine.load_cache(self.path)
        except SnapshotError as e:
            log.warning("cache snapshot %s not loaded: %s; starting with an empty cache", self.path, e)
        except Exception as e:  # noqa: BLE001 - never fail a start over a cache
            log.warning("cache snapshot %s not loaded: %s: %s; starting with an empty cache",
                        self.path, type(e).__name__, e)
        else:
            dropped = f", {got['dropped']:,} dropped to fit the cache budget" if got["dropped"] else ""
            log.info("loaded %s tokens of cached KV from %s in %.2f s%s", f"{got['tokens']:,}", self.path,
                     time.perf_counter() - t0, dropped)

    def save(self) -> dict | None:
        """Save now if the cache changed since the last save or load; the save's numbers, or None."""
        with self._lock:
            version = self._version()
            if version == self._saved:
                return None
            t0 = time.perf_counter()
            got = self.engine.save_cache(self.path)
            self._saved = version
            self.saves += 1
            log.info("saved %s tokens of cached KV (%.1f MiB) to %s in %.2f s", f"{got['tokens']:,}",
                     got["bytes"] / 2**20, self.path, time.perf_counter() - t0)
            return got

    def close(self) -> None:
        """Stop the timer, close the engine, save what changed (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        self.engine.close()
        self._try_save()
        _open.discard(self)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(min(self.save_interval, 5.0)):
            if time.monotonic() - last >= self.save_interval and self.engine.idle():
                self._try_save()
                last = time.monotonic()

    def _try_save(self) -> None:
        try:
            self.save()
        except Exception as e:  # noqa: BLE001 - a full disk must not stop serving or a shutdown
            log.warning("cache snapshot %s not saved: %s: %s", self.path, type(e).__name__, e)

    def _version(self) -> tuple[int, int, int]:
        """Changes whenever the tree may have: a step ran (inserts, LRU), tokens came or went."""
        e = self.engine
        return e.steps, e.tree.total_tokens, e.tree.evicted_tokens
