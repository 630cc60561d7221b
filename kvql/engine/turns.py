"""The engine's state lock, fair to the threads that inspect the engine between steps.

A plain lock goes back to the thread that released it: an engine thread stepping without a pause takes it
again at once, and a thread waiting for it (`stats()`, a server's `/health` integrity check, `clear_cache`,
`save_cache`) waited 6-29 s under a long request list. `Turns` counts those waiters; `for_step()`, which the
engine's step enters instead of the lock itself, first lets every one of them through. Reentrant, as the
engine's entry points call each other.
"""

from __future__ import annotations

import contextlib
import threading


class Turns:
    def __init__(self):
        self._lock = threading.RLock()
        self._changed = threading.Condition()
        self._waiting = 0  # threads waiting to inspect

    def __enter__(self):
        with self._changed:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._changed:
                self._waiting -= 1
                self._changed.notify_all()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def for_step(self):
        """Hold the lock for one step, after every thread already waiting for it had its turn."""
        if not self._lock._is_owned():  # (a step inside one of the engine's entry points: no one else can be let in)
            with self._changed:
                self._changed.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield
