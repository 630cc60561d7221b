"""Connection hygiene: idle or slow clients never lock the others out, nor flood the log.

- `raise_fd_limit()`: the soft limit on open files raised to the hard one at start (a common soft limit
  is 1,024: each connection holds one).
- `protocol(header_timeout, max_connections)`: uvicorn's HTTP/1.1 protocol, plus: a connection that has
  not sent a whole request head `header_timeout` seconds after it opened (or after its last response)
  is closed; when `max_connections` are open, a new one closes the connection that has waited longest
  without sending a request head. So open connections never reach the file limit, accepting never fails,
  and a new client is answered at once. Requests in progress are never closed.
- `quiet_accept_errors()`: asyncio's "socket.accept() out of system resource" (logged per failed accept)
  at most once per 10 seconds.
"""

from __future__ import annotations

import logging
import resource
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

RESERVE_FDS = 64
"""Files kept free of connections: the model, the log, the cache directory, the kernels."""
MARGIN = 16
"""Connections over the cap that uvicorn still serves: those whose close (at the cap) is under way."""


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one where allowed; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(max_connections: int | None) -> int:
    """`max_connections`, at most the file limit less RESERVE_FDS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = max(soft - RESERVE_FDS - MARGIN, 8)
    return room if max_connections is None else max(1, min(max_connections, room))


def protocol(header_timeout: float, max_connections: int):
    """uvicorn's H11Protocol with the deadline and cap of the module doc (one class per server)."""
    waiting: dict = {}  # connections without a request head yet -> when they began waiting (insertion order)

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next((c for c in waiting if c.conn.their_state is h11.IDLE), None)
                if oldest is not None:
                    oldest._close_idle()
            self._wait()

        def _wait(self) -> None:
            waiting[self] = time.monotonic()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            if self in waiting and self.conn.their_state is h11.IDLE:
                self._close_idle()

        def _close_idle(self) -> None:
            waiting.pop(self, None)
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self in waiting and self.conn.their_state is not h11.IDLE:  # the request head is in
                waiting.pop(self, None)
                self._deadline.cancel()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # not a pipelined next one
                self._wait()

        def connection_lost(self, exc) -> None:
            waiting.pop(self, None)
            deadline = getattr(self, "_deadline", None)
            if deadline is not None:
                deadline.cancel()
            super().connection_lost(exc)

    return Protocol


class _OncePer(logging.Filter):
    def __init__(self, text: str, seconds: float):
        super().__init__()
        self.text, self.seconds, self.last, self.dropped = text, seconds, -1e9, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < self.seconds:
            self.dropped += 1
            return False
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} more since the last such line)"
        self.last, self.dropped = now, 0
        return True


def quiet_accept_errors(seconds: float = 10.0) -> None:
    logging.getLogger("asyncio").addFilter(_OncePer("out of system resource", seconds))
