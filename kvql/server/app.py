"""OpenAI-compatible HTTP server over one local `Model`: many client processes share its radix cache.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(both with `stream: true` as server-sent events ending in `[DONE]`), `GET /metrics` (Prometheus).
Security: with an API key every endpoint but `/health` needs `Authorization: Bearer KEY` (constant-time
compare); request bodies over `max_body_bytes` get a 413; `max_tokens` is capped. The server only
generates: it never runs query code sent to it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from ..backends.local import Model
from .protocol import ChatRequest, CompletionRequest, RequestError, constraint_options, message_text


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def create_app(model: Model, *, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               max_tokens_cap: int = 4096) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        model.close()  # on shutdown: cancel what is still queued, stop the engine thread

    app = FastAPI(title="kvql", docs_url=None, redoc_url=None, lifespan=lifespan)
    counters = {"requests": 0, "errors": 0}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key", kind="authentication_error")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            return _error(413, f"request body over {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        counters["errors"] += 1
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(exc), where or None)

    @app.exception_handler(RequestError)
    async def bad(request, exc: RequestError):
        counters["errors"] += 1
        return _error(exc.status, str(exc), exc.param)

    async def parse(request: Request, cls):
        raw = bytearray()
        async for chunk in request.stream():  # bounded also when no content-length was sent
            raw += chunk
            if len(raw) > max_body_bytes:
                raise RequestError(f"request body over {max_body_bytes} bytes", status=413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"malformed JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    def options(req, logprobs) -> dict:
        max_tokens = req.max_completion_tokens or req.max_tokens or 16
        if max_tokens > max_tokens_cap:
            raise RequestError(f"max_tokens {max_tokens} is over this server's cap of {max_tokens_cap}", "max_tokens")
        return dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n, seed=req.seed,
                    stop=req.stop, logprobs=logprobs, **constraint_options(req))

    def usage(completions, n: int) -> dict:
        prompt = sum(c.prompt_tokens for c in completions[::n])
        cached = sum(c.cached_tokens for c in completions[::n])
        generated = sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def run(prompts, opts):
        counters["requests"] += 1
        try:
            return await model.agenerate(prompts, **opts)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

    def sse(events):
        async def body():
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def streamed(prompt, opts, make_chunk):
        counters["requests"] += 1
        stream = model.stream(prompt, **opts)
        try:
            first = await anext(stream)  # errors in the request surface before the 200 is sent
        except StopAsyncIteration:
            first = None
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from None

        async def events():
            chunk = first
            try:
                while chunk is not None:
                    yield make_chunk(chunk)
                    chunk = await anext(stream, None)
            finally:
                await stream.aclose()  # a client that went away cancels its request
        return sse(events())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0, "owned_by": "kvql"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        opts = options(req, req.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            else [req.prompt]
        if req.stream:
            if len(prompts) != 1:
                raise RequestError("stream: true takes one prompt", "prompt")
            return await streamed(prompts[0], opts, lambda ch: {
                "id": rid, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"index": ch.sample, "text": ch.text, "logprobs": None,
                             "finish_reason": ch.completion.finish_reason if ch.completion else None}]})
        out = await run(prompts, opts)
        texts = {i: p for i, p in enumerate(prompts) if isinstance(p, str)} if req.echo else {}
        choices = [{"index": i, "text": texts.get(c.index, "") + c.text, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "logprobs": _logprobs(model, c) if req.logprobs is not None else None}
                   | ({"token_ids": c.token_ids} if req.return_token_ids else {}) for i, c in enumerate(out)]
        return {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                "choices": choices, "usage": usage(out, req.n)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
                    for m in req.messages]
        if not getattr(model.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        opts = options(req, req.top_logprobs if req.logprobs else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return await streamed(list(ids), opts, lambda ch: {
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name,
                "choices": [{"index": ch.sample, "delta": {"role": "assistant", "content": ch.text},
                             "finish_reason": ch.completion.finish_reason if ch.completion else None}]})
        out = await run([list(ids)], opts)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None} for i, c in enumerate(out)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model.name,
                "choices": choices, "usage": usage(out, req.n)}

    @app.get("/metrics")
    async def metrics():
        s = model.stats()
        lines = [
            ("kvql_requests_total", "counter", counters["requests"]),
            ("kvql_request_errors_total", "counter", counters["errors"]),
            ("kvql_prompt_tokens_total", "counter", s["prompt_tokens"]),
            ("kvql_cached_tokens_total", "counter", s["cached_tokens"]),
            ("kvql_computed_tokens_total", "counter", s["computed_tokens"]),
            ("kvql_generated_tokens_total", "counter", s["generated_tokens"]),
            ("kvql_cache_hit_rate", "gauge", s["hit_rate"]),
            ("kvql_queue_depth", "gauge", s["waiting"]),
            ("kvql_running_requests", "gauge", s["running"]),
            ("kvql_evicted_tokens_total", "counter", s["evictions"]),
            ("kvql_cache_bytes", "gauge", s["cache_bytes"]),
            ("kvql_cache_budget_bytes", "gauge", s["cache_budget_bytes"]),
            ("kvql_locked_nodes", "gauge", s["locked_nodes"]),
            ("kvql_free_slots", "gauge", s["free_slots"]),
            ("kvql_pool_slots", "gauge", s["pool_slots"]),
        ]
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _logprobs(model: Model, c) -> dict:
    tok = model.tokenizer
    return {"tokens": [tok.decode([e.token_id]) for e in c.logprobs], "token_logprobs": [e.logprob for e in c.logprobs],
            "top_logprobs": [{tok.decode([t]): lp for t, lp in e.top.items()} for e in c.logprobs]}
