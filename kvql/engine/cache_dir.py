"""Cache dir: when an engine's cache is read from and written to disk (the format: snapshot.py).

`CacheDir(engine, directory, save_interval)`:
- at once: loads `directory/SNAPSHOT` if it is there. A snapshot of another model, dtype, device,
  tokenizer or format, or a truncated or corrupt file, is logged in one WARNING line (logger
  `kvql.cache`) and the engine starts cold: a snapshot never fails the start and never gives a
  token another model would not have given.
- every `save_interval` seconds (0: never), when the engine is idle and its cache changed since the
  last save or load, saves it (between steps: `Engine.save_cache`). A save failure is one WARNING
  line; serving goes on.
- `close()` (also at interpreter exit): stops the timer, closes the engine (its pending requests
  are cancelled; their computed KV stays in the tree, unlocked), then saves if anything changed.
One directory holds one model's snapshot: a second model pointed at it replaces the first's.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from pathlib import Path

from .snapshot import SnapshotError, remove_stale

SNAPSHOT = "kv-cache.safetensors"
log = logging.getLogger("kvql.cache")

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
        self.path = Path(directory).expanduser() / SNAPSHOT
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
        saves killed mid-write are removed first (snapshot.remove_stale)."""
        stale = remove_stale(self.path)
        if stale:
            log.warning("removed %d temporary file(s) of interrupted saves next to %s", stale, self.path)
        if not self.path.exists():
            log.info("no cache snapshot at %s: starting with an empty cache", self.path)
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
