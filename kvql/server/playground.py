"""The playground of `kvql serve` (off with `--no-playground`): one static page (playground.html: plain HTML and
JavaScript, nothing to build or fetch) where a person types a query in LMQL syntax, runs it on the served model
and watches it run: the prompt as it grows, token by token; then every token of the run marked as the engine
served it (from the cache, computed, drafted and accepted, forced by a constraint), each hole's value and where
clause, the cache's counts as they change; examples from the docs one click away; an error at its line and column.

- `GET /playground`: the page. It holds nothing of the server's, so a browser may load it without a key (as
  /health), under the Host check of every request.
- `POST /playground/run` with `{"source": QUERY, "inputs": {NAME: VALUE}}`: server-sent events, one JSON object
  each: `{"type": "text", "text": ...}` (the prompt's new text as the run goes: the query's own text, then each
  generated token's), `{"type": "stats", ...}` (the model's cache counters: after each hole and every
  `STATS_EVERY` tokens), then `{"type": "done", "traces": [...], "variables": [...], "stats": ...}` (one trace per
  run: `Trace.to_dict`) or `{"type": "error", "message": ..., "line": L, "column": C}` (line and column where the
  error is in the query, else null).

Who may run a query. A query is Python run in the server process, as the server's user: whoever may run one has
a shell. So running is a privilege of its own, off unless the server was started with `run=True`
(`kvql serve --playground-run`); without it every run is refused (403 `playground_refused`) whatever the key or
the peer. Opted in, a run needs what the API needs (a key, where the server has keys: every key holder may run
code) and more: a server without keys runs queries only for a client whose socket peer is on the loopback and
whose request carries no proxy header (`Forwarded`, `X-Forwarded-For`, `X-Real-IP`, ...), since a same-host
reverse proxy makes every remote client a loopback peer; a server that partitions its cache by key
(`--salt-per-key`) runs none (a query's requests are not partitioned). A same-host forwarder that adds no header
(socat, an SSH tunnel) cannot be told from a local client: a keyless server opted in trusts every process that can
reach its port through the loopback. The query runs on a worker thread with its own event loop, on the served
model whatever its `from` clause says; a client that goes away ends it (its writer raises: its requests are
cancelled).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import threading
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from .protocol import RequestError, parse_json

STATS_EVERY = 16  # tokens between two stats events while a hole grows
# headers a reverse proxy adds: a request carrying one came from elsewhere, whatever its socket peer
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
                 "x-client-ip", "true-client-ip", "cf-connecting-ip", "via")
STATS = ("prompt_tokens", "cached_tokens", "computed_tokens", "hit_rate", "generated_tokens", "drafted_tokens",
         "accepted_tokens", "forced_tokens", "cache_tokens", "evictions")


class _Gone(Exception):
    """The client went away: the query's writer ends it."""


class _Writer:
    """The run's output writer: each call's new prompt text (and now and then the cache counters) as events on
    `emit` (thread-safe); raises `_Gone` once `gone` is set."""

    def __init__(self, model, emit, gone: threading.Event):
        self.model, self.emit, self.gone = model, emit, gone
        self.shown, self.calls, self.hole = "", 0, None

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables) -> None:
        if self.gone.is_set():
            raise _Gone("the client went away")
        if is_final:
            return
        if not prompt.startswith(self.shown):  # another sample's prompt: from its start, on a new line
            self.emit({"type": "text", "text": "\n", "hole": None})
            self.shown = ""
        start = len(prompt) - len(str(program_variables.get(variable) or ""))  # where the hole's text begins
        if start > len(self.shown):
            self.emit({"type": "text", "text": prompt[len(self.shown):start], "hole": None})
        self.emit({"type": "text", "text": prompt[max(start, len(self.shown)):], "hole": variable})
        self.shown = prompt
        self.calls += 1
        if variable != self.hole or self.calls % STATS_EVERY == 0:
            self.hole = variable
            self.emit(stats(self.model))


def stats(model) -> dict:
    got = model.stats()
    return {"type": "stats", **{k: got[k] for k in STATS if k in got}}


def routes(app: FastAPI, s, *, keys: bool, run: bool) -> None:
    """Add the playground's two routes (module doc) for `s` (the app's `Served`); `keys`: whether the server has
    API keys; `run`: whether the operator opted in to running queries (module doc: who may run one)."""
    model = s.model
    page = resources.files(__package__).joinpath("playground.html").read_text(encoding="utf-8")

    @app.get("/playground")
    async def playground():
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; "
                                                                       "script-src 'unsafe-inline'"})

    @app.post("/playground/run")
    async def run_query(request: Request):
        _admit(request, s, keys=keys, run=run)
        source, inputs = _query(parse_json(await s.body(request), "the request body"))
        loop, queue, gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def emit(event: dict) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        worker = threading.Thread(target=_run, args=(model, source, inputs, emit, gone), daemon=True,
                                  name="kvql-playground")
        worker.start()

        async def events():
            try:
                while (event := await queue.get()) is not None:
                    yield f"data: {json.dumps(event)}\n\n"
            finally:
                gone.set()  # a client that went away: the query's next token ends it

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _admit(request: Request, s, *, keys: bool, run: bool) -> None:
    """Raise a 403 unless this request may run a query (module doc: who may run one)."""
    def refuse(why: str):
        raise RequestError(why, status=403, code="playground_refused")

    if not run:
        refuse("running queries is off on this server: a query is Python run in the server process, so the "
               "operator must opt in (kvql serve --playground-run); the page itself stays open")
    if s.salt_per_key:
        refuse("the playground runs no queries on a server that partitions its cache by API key (--salt-per-key): "
               "a query's requests would not be partitioned")
    if keys:
        return  # the Guard already checked the key
    client = request.client.host if request.client else ""
    if not _loopback(client):
        refuse("a query is Python run in the server process: without --api-key the playground runs queries only "
               "for clients on the loopback")
    if any(h in request.headers for h in PROXY_HEADERS):
        refuse("a query is Python run in the server process: without --api-key the playground runs none for a "
               "request that came through a proxy (it carries a forwarding header)")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _query(body) -> tuple[str, dict]:
    """(source, inputs) of a run's request body."""
    if not isinstance(body, dict) or not isinstance(body.get("source"), str):
        raise RequestError("the request body must be {\"source\": QUERY, \"inputs\": {NAME: VALUE}}", "source")
    inputs = body.get("inputs") or {}
    if not isinstance(inputs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in inputs):
        raise RequestError("inputs must be an object of NAME: VALUE (names as in the query)", "inputs")
    return body["source"], inputs


def _run(model, source: str, inputs: dict, emit, gone: threading.Event) -> None:
    """Compile and run the query (on this worker thread); every outcome an event, then None (the stream's end)."""
    import kvql

    try:
        q = kvql.Query(source, name="playground")
        result = q.run_sync(model=model, output_writer=_Writer(model, emit, gone), **inputs)
        results = result if isinstance(result, list) else [result]
        emit({"type": "done", "traces": [t.to_dict() for t in q.last_traces if t is not None],
              "variables": [{k: str(v) for k, v in getattr(r, "variables", {}).items()} for r in results],
              "value": None if isinstance(result, kvql.LMQLResult) else str(result), "stats": stats(model)})
    except _Gone:
        pass
    except SyntaxError as e:
        emit({"type": "error", "message": getattr(e, "msg_only", None) or e.msg, "line": e.lineno,
              "column": e.offset})
    except Exception as e:  # noqa: BLE001 -- the query's own error, shown where the user reads it
        emit({"type": "error", "message": f"{type(e).__name__}: {e}", "line": None, "column": None})
    finally:
        emit(None)
