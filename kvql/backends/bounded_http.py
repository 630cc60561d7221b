"""Reading a server's answers without trusting it: bounded in bytes and in time, checked field by field.

`Server(root, headers)` sends one request and reads its answer, a body (`read`; `json`: a `Reply`) or a stream of
server-sent events (`events`), within
- `MAX_BODY_BYTES` per body, `MAX_LINE_BYTES` per line of a stream and `MAX_STREAM_BYTES` per stream (module
  constants, read at each call: set them to change the limits);
- a deadline per request (`seconds`, from sending it to its answer's last byte) that holds however slowly the
  bytes come: every wait is cut at the deadline, so a server dripping a byte a second ends there too, where
  per-read timeouts would wait forever.
`Reply(server, path, data)` reads a parsed answer's fields, checking each one's type.

Every failure raises `BackendError` naming the server, the path and, for a bad field, the field and its
value ("server http://127.0.0.1:8000: /v1/completions answered choices[0].text = 12345 (expected a
string)"); an answer with a status other than 200 raises its subclass `StatusError`, which callers may take
as "this server does not offer that".

Blocking callers (a remote model's setup, `ServerTokenizer`, `stats`) run the same coroutines through
`run_sync`, on one event loop of kvql's own in a daemon thread: the deadlines hold there too, also for a
call made from inside another event loop (the query runtime calls its tokenizer from async code).
"""

from __future__ import annotations

import asyncio
import json
import reprlib
import threading
import time
import weakref
from typing import AsyncIterator

import httpx

from .base import BackendError

MAX_BODY_BYTES = 16 << 20    # a JSON answer: n=16 samples of 4,096 tokens with top-5 logprobs is about 10 MB
MAX_LINE_BYTES = 4 << 20     # one line of an event stream: one streamed chunk
MAX_STREAM_BYTES = 64 << 20  # all of one event stream

STRING, INTEGER, NUMBER, LIST, OBJECT = "a string", "an integer", "a number", "a list", "a JSON object"
INTEGERS = "a list of integers"
_KINDS = {  # what each kind accepts; JSON's true and false are no numbers here
    STRING: lambda v: isinstance(v, str),
    INTEGER: lambda v: type(v) is int,
    NUMBER: lambda v: type(v) in (int, float),
    LIST: lambda v: isinstance(v, list),
    OBJECT: lambda v: isinstance(v, dict),
    INTEGERS: lambda v: isinstance(v, list) and all(type(x) is int for x in v),
}
_REQUIRED = object()


class StatusError(BackendError):
    """The server answered `status`, not 200."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Deadline:
    """One stream's deadline; each wait of it is cut there (a generator cannot run inside one `wait_for`)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    async def wait(self, awaitable):
        """`awaitable`'s result, or asyncio.TimeoutError once the deadline has passed."""
        return await asyncio.wait_for(awaitable, max(self.end - time.monotonic(), 0.0))


class Server:
    """An HTTP server at `root` (scheme, host, port and any path prefix), sent `headers` with every request."""

    def __init__(self, root: str, headers: dict | None = None):
        self.root = root.rstrip("/")
        self.headers = {**(headers or {}), "Accept-Encoding": "identity"}  # sizes are counted as bytes sent
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def error(self, path: str, what: str) -> BackendError:
        return BackendError(f"server {self.root}: {path} {what}")

    def _client(self) -> httpx.AsyncClient:
        """One client per event loop (connections belong to the loop that opened them). Connections are kept
        alive only on kvql's own loop, which never closes: `asyncio.run` closes its loop without closing
        clients, and an idle pooled connection would then be torn down on a closed loop."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            keep = 8 if loop is _loop else 0
            client = self._clients[loop] = httpx.AsyncClient(
                headers=self.headers, verify=_ssl_context(), timeout=None,  # the deadline bounds every wait
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=keep))
        return client

    async def read(self, method: str, path: str, payload=None, *, seconds: float) -> bytes:
        """The body of the answer to one request (`payload`: JSON to send), read within `seconds` and
        `MAX_BODY_BYTES`; `StatusError` when its status is not 200."""
        async def fetch() -> tuple[int, bytes]:
            response = await self._send(method, path, payload)
            try:
                return response.status_code, await self._read(response, path)
            finally:
                await response.aclose()
        try:
            status, data = await asyncio.wait_for(fetch(), seconds)  # cancelled at the deadline, wherever it waits
        except asyncio.TimeoutError:
            raise self._late(path, seconds) from None
        if status != 200:
            raise self._refused(path, status, data)
        return data

    async def json(self, method: str, path: str, payload=None, *, seconds: float) -> Reply:
        """The JSON object answering one request (as `read`), as a `Reply` that checks the fields read."""
        return Reply(self, path, self.parse(path, await self.read(method, path, payload, seconds=seconds)))

    async def events(self, path: str, payload, *, seconds: float) -> AsyncIterator:
        """Each event of the server-sent-event stream that a POST of `payload` answers, parsed as JSON, until
        `data: [DONE]` or the stream's end; the deadline covers the whole stream. Iterate it under
        `contextlib.aclosing`: a caller that stops early then closes the connection, and the server stops."""
        deadline = _Deadline(seconds)
        try:
            response = await deadline.wait(self._send("POST", path, payload))
            try:
                if response.status_code != 200:
                    raise self._refused(path, response.status_code, await deadline.wait(self._read(response, path)))
                total, buffer, data = 0, bytearray(), []
                chunks = response.aiter_raw()
                while (chunk := await deadline.wait(self._next(chunks, path))) is not None:
                    total += len(chunk)
                    if total > MAX_STREAM_BYTES:
                        raise self.error(path, f"streamed more than {MAX_STREAM_BYTES:,} bytes")
                    buffer += chunk
                    start = 0
                    while (end := buffer.find(b"\n", start)) >= 0:
                        line, start = bytes(buffer[start:end]).rstrip(b"\r"), end + 1
                        if line.startswith(b"data:"):
                            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
                        elif not line and data:  # a blank line ends an event
                            event, data = b"\n".join(data), []
                            if event.strip() == b"[DONE]":
                                return
                            yield self.parse(path, event)
                    del buffer[:start]
                    if len(buffer) > MAX_LINE_BYTES:
                        raise self.error(path, f"streamed a line longer than {MAX_LINE_BYTES:,} bytes")
                if data and b"\n".join(data).strip() != b"[DONE]":  # the last event, without its blank line
                    yield self.parse(path, b"\n".join(data))
            finally:
                await response.aclose()
        except asyncio.TimeoutError:
            raise self._late(path, seconds) from None

    def parse(self, path: str, data: bytes):
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
            raise self.error(path, f"answered something that is not JSON: {_shown(data)}") from None

    # -- the parts -----------------------------------------------------------------------------------
    async def _send(self, method: str, path: str, payload) -> httpx.Response:
        client = self._client()
        request = client.build_request(method, self.root + path, json=payload)
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as e:
            raise self.error(path, f"could not be reached: {type(e).__name__}: {e}") from None
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding != "identity":  # a compressed body's size in memory is not bounded by its bytes
            await response.aclose()
            raise self.error(path, f"answered with Content-Encoding {encoding!r}; kvql asks for 'identity'")
        return response

    async def _next(self, chunks: AsyncIterator[bytes], path: str) -> bytes | None:
        try:
            return await anext(chunks, None)
        except httpx.TransportError as e:
            raise self.error(path, f"broke off its answer: {type(e).__name__}: {e}") from None

    async def _read(self, response: httpx.Response, path: str) -> bytes:
        data = bytearray()
        chunks = response.aiter_raw()
        while (chunk := await self._next(chunks, path)) is not None:
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise self.error(path, f"answered more than {MAX_BODY_BYTES:,} bytes")
        return bytes(data)

    def _refused(self, path: str, status: int, data: bytes) -> StatusError:
        try:
            found = json.loads(data)
        except (ValueError, RecursionError):
            found = None
        message = error_message(found) or _shown(data, 300)
        if status == 401:  # what to do about it, wherever the key came from
            sent = "the API key sent was refused" if "Authorization" in self.headers else "no API key was sent"
            message += (f" ({sent}: give the server's key as kvql.model(url, api_key=KEY), --api-key KEY on the "
                        f"command line, or the OPENAI_API_KEY environment variable)")
        return StatusError(f"server {self.root}: {path} answered {status}: {message}", status)

    def _late(self, path: str, seconds: float) -> BackendError:
        return self.error(path, f"did not answer in full within the request's deadline of {seconds:g} s "
                                "(kvql.model(url, timeout=SECONDS))")


class Reply:
    """A parsed JSON answer (`body`, a JSON object) of `server` to a request for `path`; `get` reads a field of
    it, or of an object inside it, checking its type: nothing of the wrong type comes back as a value."""

    def __init__(self, server: Server, path: str, body):
        self.server, self.path, self.body = server, path, body
        self.check(body, OBJECT, "")

    def get(self, obj: dict, key: str, kind: str, where: str = "", default=_REQUIRED):
        """`obj[key]` when it is of `kind` (STRING, INTEGER, NUMBER, LIST, OBJECT, INTEGERS); `default` when
        it is missing or null and a default is given. `where`: where `obj` is in the answer (`choices[0]`)."""
        value = obj.get(key)
        if value is None and default is not _REQUIRED:
            return default
        return self.check(value, kind, f"{where}.{key}" if where else key)

    def check(self, value, kind: str, where: str):
        if not _KINDS[kind](value):
            raise self.wrong(where, value, kind)
        return value

    def wrong(self, where: str, value, expected: str) -> BackendError:
        if value is None:
            shown = f"no {where}" if where else "null"
        else:
            shown = f"{where} = {_shown(value)}" if where else _shown(value)
        return self.server.error(self.path, f"answered {shown} (expected {expected})")


def error_message(found) -> str | None:
    """The message of a server's error answer, in any of the shapes servers give it: OpenAI's
    `{"error": {"message"}}`, `{"error": "..."}`, `{"message"}`, FastAPI's `{"detail"}`; None if none."""
    if isinstance(found, dict):
        error = found.get("error")
        message = (error.get("message") if isinstance(error, dict) else error) or found.get("message") \
            or found.get("detail")
        if message:
            return message[:1000] if isinstance(message, str) else _shown(message, 300)
    return None


def _shown(value, limit: int = 80) -> str:
    """`value` for an error message, cut to about `limit` characters (never the whole of a huge one)."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[:limit * 4]).decode("utf-8", "replace")
        return repr(value if len(value) <= limit else value[:limit] + "...")
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


_ssl = None


def _ssl_context():
    """One SSL context for every client (making one reads the CA bundle: ~20 ms)."""
    global _ssl
    if _ssl is None:
        _ssl = httpx.create_ssl_context()
    return _ssl


_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def run_sync(coroutine):
    """Run `coroutine` on kvql's HTTP event loop (started on first use, in a daemon thread) and return its
    result, blocking the caller; interrupting the caller cancels it."""
    global _loop, _thread
    with _lock:
        if _thread is None or not _thread.is_alive():  # not started yet, or not in this process (after a fork)
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="kvql-http", daemon=True)
            _thread.start()
    future = asyncio.run_coroutine_threadsafe(coroutine, _loop)
    try:
        return future.result()
    finally:
        future.cancel()  # no-op when it finished; else (KeyboardInterrupt) the request stops too
