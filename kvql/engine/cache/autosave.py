"""Autosave: while an engine with a disk tier is idle, write what only its pool holds to the tier every
`interval` seconds, so that a process killed without `close` loses at most that much of its cache
(`Engine.save_cache`, persistence.py). A failed save is one WARNING line (logger `kvql.cache`); serving goes on."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("kvql.cache")
POLL = 5.0
"""Longest wait between two looks at the engine (seconds)."""


class Autosave:
    def __init__(self, engine, interval: float):
        self.engine, self.interval = engine, float(interval)
        self._stop = threading.Event()
        self._saved = self._version()
        self._thread = threading.Thread(target=self._run, name="kvql-autosave", daemon=True)
        self._thread.start()

    def _version(self) -> tuple[int, int]:
        """Changes whenever the pool may hold nodes the tier has not: a step ran, or the cache was cleared."""
        return self.engine.steps, self.engine.tree.dropped_tokens

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(min(self.interval, POLL)):
            if time.monotonic() - last < self.interval or not self.engine.idle() or self._version() == self._saved:
                continue
            version = self._version()
            try:
                self.engine.save_cache()
                self._saved = version
            except Exception as e:  # noqa: BLE001 -- a full disk must not stop serving
                if not self._stop.is_set():
                    log.warning("cache not saved to the disk tier: %s: %s", type(e).__name__, e)
            last = time.monotonic()

    def stop(self) -> None:
        """No save starts after this returns (one running finishes first)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
