"""Masks computed off the engine thread, so that no constraint can slow the requests beside it.

A constraint's mask for the next token can cost anything from microseconds (a JSON schema) to a tenth of a
second per token (`(x{1000}){300}`: llguidance builds a new lexer state for every token the vocabulary could
add). Computed on the engine thread, every request of the batch waits for it at every step. Here a mask that
is a function of the ids alone (`jump_forward` true: grammar masks and the wrappers around them,
`request.MaskFn`) is asked of a worker thread instead, and the engine waits for it only within a small
budget per step (`Outputs`): a mask that is late leaves its own request behind, never its neighbours.

Contract of `MaskWorker.ask(req, history, wait)`: the mask result for `history` (exactly what
`req.params.mask(history)` returns, or its exception raised here, in the caller's error boundary), or
`PENDING` when it is not ready within `wait` seconds; asked again for the same history it returns the same
call's result (each history is computed once). Each result taken updates `req.mask_seconds`, a running
estimate of its mask's time per call (the engine does not wait for a mask it expects to be late). The calls of one mask function (a group's samples share it)
run one at a time, in the order asked, so a group of many samples holds one worker, not all of them.

The workers run at the lowest CPU priority (`nice` 19, per thread): where the cores are busy with a forward,
a slow mask takes what the forward leaves instead of slowing it. (llguidance releases the GIL while it
computes a mask, so the engine thread runs on meanwhile.)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import threading
import time

PENDING = object()
WORKERS = 4


def lowest_priority() -> None:
    """The calling thread at `nice` 19: the engine's forwards take the cores first."""
    with contextlib.suppress(OSError, AttributeError):  # per thread on Linux; elsewhere left as it is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class MaskWorker:
    def __init__(self, workers: int = WORKERS):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvql-mask",
                                                           initializer=lowest_priority)
        self._lock = threading.Lock()
        self._chains: dict[int, collections.deque] = {}  # id(mask fn) -> calls waiting behind its running one

    def ask(self, req, history: list[int], wait: float | None):
        """See the module doc (`wait=None`: as long as it takes). `req.mask_pending` holds `(history, future)`
        between calls."""
        pending = req.mask_pending
        if pending is None or pending[0] != history:
            pending = req.mask_pending = (list(history), self._submit(req.params.mask, list(history)))
        future = pending[1]
        if not future.done() and (wait is None or wait > 0):
            concurrent.futures.wait([future], timeout=wait)
        if not future.done():
            return PENDING
        req.mask_pending = None
        req.mask_seconds = 0.5 * req.mask_seconds + 0.5 * future.seconds
        return future.result()

    def _submit(self, mask, history: list[int]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        key = id(mask)
        with self._lock:
            chain = self._chains.get(key)
            if chain is not None:  # a call of this mask runs: this one follows it
                chain.append((mask, history, future))
                return future
            self._chains[key] = collections.deque()
        self._pool.submit(self._run, key, mask, history, future)
        return future

    def _run(self, key: int, mask, history: list[int], future: concurrent.futures.Future) -> None:
        while True:
            future.seconds = 0.0
            if future.set_running_or_notify_cancel():
                started = time.perf_counter()
                try:
                    result = mask(history)
                except BaseException as e:  # noqa: BLE001 -- raised in the request's own error boundary
                    future.seconds = time.perf_counter() - started
                    future.set_exception(e)
                else:
                    future.seconds = time.perf_counter() - started
                    future.set_result(result)
            with self._lock:
                chain = self._chains[key]
                if not chain:
                    del self._chains[key]
                    return
                mask, history, future = chain.popleft()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
