"""OpenAI-compatible HTTP server over one local model (`kvql.backends.local.LocalBackend`): many client processes share its radix cache.

Endpoints: `GET /health` (the engine's integrity check), `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (both with `stream: true` as server-sent events ending in `[DONE]`),
`POST /v1/completions/render` and `POST /v1/chat/completions/render` (vLLM's tokenize-only endpoints: the
token ids this server would feed the engine for that request; vllm-router's cache_aware policy routes on
them), `GET /metrics` (Prometheus), and vLLM's tokenizer endpoints `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info` (tokenization.py: clients without the model's tokenizer use the server's).

Contracts:
- Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: a bad request is a
  4xx (see protocol.py), an unknown path 404, a wrong method 405, a model name not served 404
  (`model_not_found`); only a fault of the server itself is a 500.
- A stream that fails after its 200 was sent ends with an event `{"error": {...}}`, a chunk with
  `finish_reason: "error"` for each unfinished sample, then `[DONE]`.
- A client that disconnects cancels its request, streaming or not, queued or generating (polled every
  `errors.POLL_S` seconds until the response starts; then Starlette's streaming response watches).
- `cache_salt` partitions the prefix cache: requests share cached tokens only with requests of the
  same salt (none: the default partition). With `salt_per_key`, each API key gets its own partition.
- Host, API key, Content-Type and body-size checks: guard.py. The API only generates: no route runs code
  sent to it, except the playground's `POST /playground/run` (a query is Python), which is off unless the
  operator opts in (`playground_run=True`, `kvql serve --playground-run`; who may then run one:
  playground.py).
- `/metrics`, the access log and the throughput line: metrics.py. `shutdown()` (on the app's state)
  cancels every request in flight: non-streaming ones are answered 503, streams end with an error event.

Where things are: the routes here; what every route does with a request (parse, options, run, stream):
served.py; server-sent events: streaming.py; errors: errors.py; request models: protocol.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..backends.local import LocalBackend
from . import errors
from .guard import Guard
from .logprobs import Spelling, chat_logprobs, completion_logprobs, prompt_logprobs
from .metrics import AccessLog, throughput_lines
from .playground import routes as playground_routes
from .protocol import ChatRequest, CompletionRequest, RequestError
from .served import Served, completion_prompts, rendered, usage
from .tokenization import tokenization_routes
from .tools import ToolCalling


def create_app(model: LocalBackend, *, name: str | None = None, aliases: Iterable[str] = (),
               api_key: str | Iterable[str] | None = None, salt_per_key: bool = False,
               allowed_hosts: Iterable[str] | None = None, max_body_bytes: int = 1 << 20,
               max_tokens_cap: int = 4096, log_interval: float = 10.0, metrics_auth: bool = True,
               playground: bool = True, playground_run: bool = False, plain_content: bool | None = None) -> FastAPI:
    """The app serving `model` as `name` (default `model.name`); requests may also name it by an alias.

    `api_key`: one key or several (each `Authorization: Bearer KEY`). `salt_per_key`: each key's
    requests get their own cache partition. `allowed_hosts`: host names accepted in `Host` besides
    IP addresses and `localhost` (`"*"`: any); see guard.py. `log_interval`: seconds between throughput
    lines (logger `kvql.server`) while busy. `metrics_auth=False`: `GET /metrics` answers without a key
    (as vLLM's does), for a Prometheus scraper; by default it needs one, as every route but /health.
    `playground`: the query playground's page (`GET /playground`, open like /health). `playground_run`: let the
    playground run queries (Python in this process, as its user: whoever may run one has a shell); off by
    default, and then every run is refused whatever the key or the peer (kvql.server.playground).
    `plain_content`: chat messages' content is tokenized as plain text, so a special token's text in it (a
    `<|im_start|>`) is text, not a control token (kvql.runtime.plain_content); default: the model's own
    `plain_content` (`kvql.model(..., plain_content=True)`), else off, as transformers and vLLM.
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("API keys must be non-empty strings")
    if salt_per_key and not keys:
        raise ValueError("salt_per_key needs API keys")
    if playground_run and not playground:
        raise ValueError("playground_run needs the playground")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        ticker = asyncio.get_running_loop().create_task(throughput_lines(model, log_interval))
        yield
        ticker.cancel()
        model.close()  # on shutdown: cancel what is still queued, stop the engine thread

    app = FastAPI(title="kvql", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    open_paths = ("/health",) + (() if metrics_auth else ("/metrics",)) + (("/playground",) if playground else ())
    app.add_middleware(Guard, api_keys=keys, allowed_hosts=list(allowed_hosts or ()), max_body_bytes=max_body_bytes,
                       open_paths=open_paths)
    app.add_middleware(AccessLog)
    counters = {"requests": 0, "errors": 0}
    s = Served(model, name or model.name, aliases, counters, salt_per_key=salt_per_key,
               max_body_bytes=max_body_bytes, max_tokens_cap=max_tokens_cap,
               plain_content=getattr(model, "plain_content", False) if plain_content is None else plain_content)
    app.state.shutdown = s.metrics.cancel_all  # cancel what is in flight: see launch.py
    errors.install(app, counters)
    _service_routes(app, s)
    _completion_routes(app, s)
    _chat_routes(app, s)
    if playground:
        playground_routes(app, s, keys=bool(keys), run=playground_run)
    return app


def _service_routes(app: FastAPI, s: Served) -> None:
    @app.get("/health")
    async def health():
        try:  # the cheap form (slot count); in a thread, as it waits for the current engine step
            await asyncio.to_thread(s.model.check_integrity, full=False)
        except AssertionError as e:
            return JSONResponse({"status": "error", "detail": str(e) or "integrity check failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.name, "object": "model", "created": 0, "owned_by": "kvql",
                                            "max_model_len": s.model.context_length}]}  # vLLM's field

    @app.get("/metrics")
    async def prometheus():
        return Response(s.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    tokenization_routes(app, s)


def _completion_routes(app: FastAPI, s: Served) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await s.parse(request, CompletionRequest)
        opts = s.options(request, req, req.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompts = completion_prompts(req)
        echo_only = req.echo and 0 in (req.max_tokens, req.max_completion_tokens)
        shown = _completion_choice(s, req, echo_only)
        if req.stream:
            if len(prompts) != 1:
                raise RequestError("stream: true takes one prompt", "prompt")
            p = prompts[0]
            return await s.streamed(request, req, p, opts, lambda sample, text, ids, c, first: {
                "id": rid, "object": "text_completion", "created": created, "model": s.name,
                "choices": [{"index": sample, **shown(p, c, text, ids, first)}]},
                s.usage_chunk(req, rid, created, "text_completion", echo_only))
        out = await s.run(request, prompts, opts)
        choices = [{"index": i, **shown(prompts[c.index], c, c.text, c.token_ids, True)}
                   for i, c in enumerate(out)]
        return {"id": rid, "object": "text_completion", "created": created, "model": s.name,
                "choices": choices, "usage": usage(out, req.n, echo_only)}

    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        """Per prompt, what /v1/completions would feed the engine; nothing is generated. The request is
        checked as /v1/completions checks it, so a render answers the 400 its generation would."""
        req = await s.parse(request, CompletionRequest)
        s.options(request, req, req.logprobs)
        ids = s.prompt_ids(completion_prompts(req))
        rid = f"cmpl-{uuid.uuid4().hex}"
        return [rendered(req, rid if len(ids) == 1 else f"{rid}-{i}", t) for i, t in enumerate(ids)]


def _completion_choice(s: Served, req, echo_only: bool):
    """`shown(prompt, c, text, ids, first)`: one /v1/completions choice (or a stream's chunk of it; `c` set
    when the sample is done), with vLLM's echo rules. Logprobs come whole with the finished sample (the
    engine streams text and ids only)."""
    tok, spell, k = s.model.tokenizer, Spelling(s.model.tokenizer, bool(req.return_tokens_as_token_ids)), req.logprobs

    def shown(p, c, text: str, ids: list[int], first: bool) -> dict:
        if echo_only:
            text, ids = "", []
        if req.echo and first:
            text = (p if isinstance(p, str) else tok.decode(p)) + text
        choice = {"text": text, "logprobs": None,
                  "finish_reason": None if c is None else "length" if echo_only else c.finish_reason,
                  "stop_reason": None if c is None or echo_only else c.stop_reason}
        if c is not None and k is not None:
            lp_ids, entries = ([], []) if echo_only else (c.token_ids, c.logprobs)
            if req.echo:
                lp_ids, entries = s.prompt_ids([p])[0] + lp_ids, c.prompt_logprobs + entries
            choice["logprobs"] = completion_logprobs(spell, lp_ids, entries, k)
        if req.return_token_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = s.prompt_ids([p])[0]
        if c is not None and req.prompt_logprobs is not None and c.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tok, c.prompt_logprobs, req.prompt_logprobs)
        return choice
    return shown


def _chat_routes(app: FastAPI, s: Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await s.parse(request, ChatRequest)
        calling = ToolCalling.of(req)
        ids = s.chat_ids(req, calling)
        k = (req.top_logprobs or 0) if req.logprobs else None
        opts = s.options(request, req, k, len(ids), calling and calling.constraint())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        spell = Spelling(s.model.tokenizer, bool(req.return_tokens_as_token_ids))
        if req.stream:
            calls = {}  # sample -> its tools.CallStream

            def make_chunk(sample, text, token_ids, c, first):
                delta, finish = {"content": text}, c and c.finish_reason
                if calling is not None:
                    delta, finish = calls.setdefault(sample, calling.stream()).delta(text, c)
                choice = {"index": sample, "delta": {"role": "assistant", **delta},
                          "logprobs": None, "finish_reason": finish, "stop_reason": c and c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = token_ids
                if c is not None and k is not None:  # logprobs come whole, in a sample's last chunk
                    choice["logprobs"] = chat_logprobs(spell, c.token_ids, c.logprobs, k)
                event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": s.name,
                         "choices": [choice]}
                if req.return_token_ids and first and sample == 0:
                    event["prompt_token_ids"] = ids
                return event
            return await s.streamed(request, req, ids, opts, make_chunk,
                                    s.usage_chunk(req, rid, created, "chat.completion.chunk"))
        out = await s.run(request, [ids], opts)
        choices = []
        for i, c in enumerate(out):
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if calling is not None:
                content, tool_calls, finish = calling.read(c.text, c.finish_reason)
                message = {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})
            choices.append({"index": i, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                            "logprobs": chat_logprobs(spell, c.token_ids, c.logprobs, k) if k is not None else None}
                           | ({"token_ids": c.token_ids} if req.return_token_ids else {}))
        body = {"id": rid, "object": "chat.completion", "created": created, "model": s.name,
                "choices": choices, "usage": usage(out, req.n)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(s.model.tokenizer, out[0].prompt_logprobs, req.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return body

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        """What /v1/chat/completions would feed the engine (one object, as vLLM answers); nothing is
        generated."""
        req = await s.parse(request, ChatRequest)
        calling = ToolCalling.of(req)
        ids = s.chat_ids(req, calling)
        s.options(request, req, None, len(ids), calling and calling.constraint())
        return rendered(req, f"chatcmpl-{uuid.uuid4().hex}", ids)
