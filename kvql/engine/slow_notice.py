"""A slow step of loading says so: a warning once it has run `SLOW_SECONDS`, and its time when it ends."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

SLOW_SECONDS = 3.0
"""A step of loading that takes longer says so (`said_when_slow`)."""


@contextlib.contextmanager
def said_when_slow(what: str):
    """Inside: `what` is logged (a warning: shown without any logging set up) once it has run SLOW_SECONDS, and
    its time when it ends; nothing when it is quick."""
    log = logging.getLogger("kvql")
    start = time.perf_counter()
    said = threading.Event()

    def say():
        said.set()
        log.warning("kvql: %s ...", what)

    timer = threading.Timer(SLOW_SECONDS, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if said.is_set():
            log.warning("kvql: %s: done in %.1f s", what, time.perf_counter() - start)
