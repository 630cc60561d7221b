"""A hostile OpenAI-style server on loopback, for the remote backend's tests: each path's answer is a function
a test chooses (`Hostile.routes`), including ones that never end (endless bodies, endless lines, a drip of
one byte at a time). It counts the bytes its endless answers sent and notes when a client closed on one."""

from __future__ import annotations

import http.server
import json
import threading
import time

DRIP_SECONDS = 0.2  # between the bytes of a drip: far below any per-read timeout


class Hostile:
    """`with Hostile() as h:` serves `h.url` (no /v1) until the block ends. `routes[path](handler, body)`
    writes the whole answer to a request for `path` (`body`: the request's JSON, None for a GET); by default
    `/v1/models` serves one model "m" and `/version` says vLLM, so the client sees a vLLM server.
    `sent`: bytes the endless answers wrote; `closed` is set when a client closed one of them."""

    def __init__(self):
        self.routes = {"/v1/models": answer({"object": "list", "data": [{"id": "m", "max_model_len": 2048}]}),
                       "/version": answer({"version": "0.32.0"})}
        self.requests: list[tuple[str, object]] = []
        self.sent = 0
        self.closed = threading.Event()
        self.stopping = threading.Event()
        hostile = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"null"))

            def _answer(self, body):
                hostile.requests.append((self.path, body))
                route = hostile.routes.get(self.path)
                try:
                    if route is None:
                        answer({"error": {"message": "not found"}}, status=404)(self, body)
                    else:
                        route(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    hostile.closed.set()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Hostile:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()  # endless answers stop writing
        self.server.shutdown()
        self.server.server_close()

    def write_forever(self, h, chunk: bytes, pause: float = 0.0) -> None:
        """Write `chunk` again and again until the client closes (or the server stops)."""
        while not self.stopping.is_set():
            h.wfile.write(chunk)
            h.wfile.flush()
            self.sent += len(chunk)
            if pause:
                time.sleep(pause)


def start(h, content_type: str = "application/json", status: int = 200) -> None:
    """The status line and headers of an answer whose body runs until the connection closes (HTTP/1.0)."""
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Connection", "close")
    h.end_headers()


def answer(obj, status: int = 200):
    """A route answering `obj` as JSON (bytes or str: sent as they are)."""
    data = obj if isinstance(obj, bytes) else (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode())

    def route(h, body):
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return route


def events(hostile: Hostile, chunks, then_forever: dict | None = None):
    """A route streaming `chunks` (dicts) as server-sent events, then `then_forever` again and again until
    the client closes (else `[DONE]`)."""
    def route(h, body):
        start(h, "text/event-stream")
        for c in chunks:
            h.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
        if then_forever is None:
            h.wfile.write(b"data: [DONE]\n\n")
            return
        hostile.write_forever(h, (b"data: " + json.dumps(then_forever).encode() + b"\n\n") * 100, pause=0.001)
    return route


def completion(text="hi", token_ids=(1, 2), finish_reason="length", **choice) -> dict:
    """A well-formed completions answer with one choice (`choice` overrides its fields)."""
    return {"id": "c", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "token_ids": list(token_ids), "finish_reason": finish_reason,
                         "logprobs": None, **choice}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
