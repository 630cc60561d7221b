"""OpenAI-compatible HTTP server over one local model (`kvql.backends.local.LocalBackend`): many client processes share its radix cache.

Endpoints: `GET /health` (the engine's integrity check), `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (both with `stream: true` as server-sent events ending in `[DONE]`),
`POST /v1/completions/render` and `POST /v1/chat/completions/render` (vLLM's tokenize-only endpoints: the
token ids this server would feed the engine for that request; vllm-router's cache_aware policy routes on
them), `GET /metrics` (Prometheus).

Contracts:
- Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: a bad request is a
  4xx (see protocol.py), an unknown path 404, a wrong method 405, a model name not served 404
  (`model_not_found`); only a fault of the server itself is a 500.
- A stream that fails after its 200 was sent ends with an event `{"error": {...}}`, a chunk with
  `finish_reason: "error"` for each unfinished sample, then `[DONE]`.
- A client that disconnects cancels its request, streaming or not, queued or generating (polled every
  `POLL_S` seconds until the response starts; then Starlette's streaming response watches).
- `cache_salt` partitions the prefix cache: requests share cached tokens only with requests of the
  same salt (none: the default partition). With `salt_per_key`, each API key gets its own partition.
- Host, API key, Content-Type and body-size checks: guard.py. The server only generates: it never
  runs query code sent to it.
- `/metrics`, the access log and the throughput line: metrics.py. `shutdown()` (on the app's state)
  cancels every request in flight: non-streaming ones are answered 503, streams end with an error event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Iterable

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from prometheus_client import CONTENT_TYPE_LATEST

from ..backends.local import LocalBackend
from .guard import Guard
from .logprobs import PROMPT_TOP, Spelling, chat_logprobs, completion_logprobs, prompt_logprobs
from .metrics import AccessLog, Metrics, throughput_lines
from .protocol import (ChatRequest, CompletionRequest, RequestError, constraint_options, error_response,
                       message_text, parse_request)

POLL_S = 0.1  # how often a non-streaming request checks that its client is still connected


def create_app(model: LocalBackend, *, name: str | None = None, aliases: Iterable[str] = (),
               api_key: str | Iterable[str] | None = None, salt_per_key: bool = False,
               allowed_hosts: Iterable[str] | None = None, max_body_bytes: int = 1 << 20,
               max_tokens_cap: int = 4096, log_interval: float = 10.0) -> FastAPI:
    """The app serving `model` as `name` (default `model.name`); requests may also name it by an alias.

    `api_key`: one key or several (each `Authorization: Bearer KEY`). `salt_per_key`: each key's
    requests get their own cache partition. `allowed_hosts`: host names accepted in `Host` besides
    IP addresses and `localhost` (`"*"`: any); see guard.py. `log_interval`: seconds between throughput
    lines (logger `kvql.server`) while busy.
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("API keys must be non-empty strings")
    if salt_per_key and not keys:
        raise ValueError("salt_per_key needs API keys")
    name = name or model.name
    served = {name, *aliases}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        ticker = asyncio.get_running_loop().create_task(throughput_lines(model, log_interval))
        yield
        ticker.cancel()
        model.close()  # on shutdown: cancel what is still queued, stop the engine thread

    app = FastAPI(title="kvql", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(Guard, api_keys=keys, allowed_hosts=list(allowed_hosts or ()), max_body_bytes=max_body_bytes)
    app.add_middleware(AccessLog)
    counters = {"requests": 0, "errors": 0}
    metrics = Metrics(model, counters)
    app.state.shutdown = metrics.cancel_all  # cancel what is in flight: see launch.py

    @app.exception_handler(RequestError)
    async def bad(request, exc: RequestError):
        counters["errors"] += 1
        return error_response(exc.status, str(exc), exc.param, exc.code, exc.kind)

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, exc: HTTPException):
        what = {404: f"no endpoint {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(exc.status_code, what, headers=exc.headers)

    @app.exception_handler(Exception)
    async def fault(request, exc: Exception):
        counters["errors"] += 1
        return error_response(500, "internal server error", kind="server_error")

    async def parse(request: Request, cls):
        raw = bytearray()
        async for chunk in request.stream():  # bounded also when no content-length was sent
            raw += chunk
            if len(raw) > max_body_bytes:
                raise RequestError(f"request body over {max_body_bytes} bytes", status=413)
        req = parse_request(bytes(raw), cls)
        if req.model is not None and req.model not in served:
            raise RequestError(f"model {req.model!r} is not served here; this server serves {name!r}", "model",
                               404, "model_not_found")
        return req

    def options(request: Request, req, logprobs) -> dict:
        max_tokens = next((v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), 16)
        if max_tokens == 0 and not getattr(req, "echo", False):
            raise RequestError("max_tokens must be at least 1 (0 only with echo: true, which returns the prompt; "
                               "with logprobs, the prompt's log-probabilities)", "max_tokens")
        if max_tokens > max_tokens_cap:
            raise RequestError(f"max_tokens {max_tokens} is over this server's cap of {max_tokens_cap}", "max_tokens")
        if req.min_tokens > max_tokens:
            raise RequestError(f"min_tokens must be at most max_tokens={max_tokens}, got {req.min_tokens}", "min_tokens")
        opts = dict(max_tokens=max(max_tokens, 1), temperature=req.temperature, top_p=req.top_p, n=req.n,
                    seed=req.seed, stop=req.stop, logprobs=logprobs, ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens, logit_bias=req.logit_bias or None,
                    top_k=max(req.top_k or 0, 0), frequency_penalty=req.frequency_penalty,
                    presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty,
                    **constraint_options(req))
        if req.prompt_logprobs and req.stream:
            raise RequestError("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        echo_scored = getattr(req, "echo", False) and logprobs is not None  # vLLM: echo + logprobs -> prompt logprobs
        if (req.prompt_logprobs is not None and not req.stream) or echo_scored:
            opts["prompt_logprobs"] = PROMPT_TOP  # k shown; more asked for, so that more ranks are exact
        salt = cache_salt(request, req)
        if salt is not None:
            opts["cache_salt"] = salt
        return opts

    def cache_salt(request: Request, req) -> str | None:
        key = request.scope.get("kvql.api_key") if salt_per_key else None
        if key is None:
            return req.cache_salt
        # the key's own partition; a client salt subdivides it (a 64-hex prefix no client salt can forge)
        own = hashlib.sha256(key.encode()).hexdigest()
        return own if req.cache_salt is None else f"{own}:{req.cache_salt}"

    def usage(completions, n: int, echo_only: bool = False) -> dict:
        completions = sorted(completions, key=lambda c: (c.index, c.sample))
        prompt = sum(c.prompt_tokens for c in completions[::n])
        cached = sum(c.cached_tokens for c in completions[::n])
        generated = 0 if echo_only else sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion_prompts(req: CompletionRequest) -> list:
        p = req.prompt
        return p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]

    def engine_ids(prompts: list) -> list[list[int]]:
        """Each prompt (text or token ids) as the token ids the engine is fed for it."""
        with _request_errors():
            return model.prompt_ids(prompts)

    def chat_ids(req: ChatRequest) -> list[int]:
        """The chat template applied to the messages, opening the assistant's turn: the engine's prompt."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m, i)}
                    for i, m in enumerate(req.messages)]
        if not getattr(model.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        except jinja2.TemplateError as e:  # templates refuse some message sequences (raise_exception)
            raise RequestError(f"the model's chat template refused these messages: {e}", "messages") from None
        return list(ids)

    def rendered(req, request_id: str, token_ids: list[int]) -> dict:
        """vLLM's `GenerateRequest` as its render endpoints answer it, less `sampling_params` (vLLM's
        engine options, which kvql's are not)."""
        return {"request_id": request_id, "token_ids": token_ids, "model": req.model, "stream": req.stream,
                "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
                "cache_salt": req.cache_salt}

    async def generate(flight, prompts, opts):
        """`model.agenerate`, its groups kept in `flight` (timings, cancellation at shutdown)."""
        groups = await model.submit(prompts, flight.on_update, **opts)
        flight.groups.extend(groups)
        return await model.collect(groups)

    def stream(flight, prompt, opts):
        """`model.stream`, its group kept in `flight`."""
        return model.stream(prompt, on_token=flight.on_update, on_group=flight.groups.append, **opts)

    async def run(request: Request, prompts, opts):
        counters["requests"] += 1
        flight, out = metrics.flight(request.scope), []
        try:
            with _request_errors():
                out = await _unless_disconnected(request, generate(flight, prompts, opts))
        except (concurrent.futures.CancelledError, RequestError) as e:
            # the engine's cancellation reaches an awaiting task as its own cancellation (a 499)
            if isinstance(e, RequestError) and not (e.status == 499 and flight.cancelled):
                raise
            raise RequestError("the request was cancelled: the server is shutting down", status=503,
                               kind="server_error") from None
        finally:
            flight.finish(out)
        return out

    async def streamed(request: Request, prompt, opts, make_chunk, usage_chunk=None):
        """Server-sent events of one prompt's `n` samples: `make_chunk(sample, text, token_ids, completion,
        first)` per engine step (`completion` set on a sample's last one, `first` on its first); then, with
        `usage_chunk` (stream_options.include_usage), `usage_chunk(completions)`."""
        counters["requests"] += 1
        flight = metrics.flight(request.scope)
        chunks = stream(flight, prompt, opts)
        try:
            with _request_errors():  # errors in the request surface before the 200 is sent
                first = await _unless_disconnected(request, anext(chunks, None))
        except BaseException:
            flight.finish([])
            raise

        async def events():
            chunk, unfinished, sent, done = first, set(range(opts["n"])), {}, []
            try:
                while chunk is not None:
                    s = sent.setdefault(chunk.sample, _Sent())
                    c = chunk.completion
                    if c is not None:
                        done.append(c)
                        unfinished.discard(chunk.sample)
                        text, ids = c.text[s.chars:], c.token_ids[s.ids:]
                    else:
                        text, ids = chunk.text, [chunk.token_id]
                    event = make_chunk(chunk.sample, text, ids, c, not s.started)
                    if usage_chunk is not None:
                        event["usage"] = None  # OpenAI's: null in every chunk but the last
                    yield event
                    s.started, s.chars, s.ids = True, s.chars + len(text), s.ids + len(ids)
                    chunk = await anext(chunks, None)
                if usage_chunk is not None:
                    yield usage_chunk(done)
            except Exception as e:  # the 200 is sent: say so in the stream, not by ending it silently
                counters["errors"] += 1
                request_fault = isinstance(e, (ValueError, TypeError))
                message = ("the request was cancelled: the server is shutting down"
                           if isinstance(e, concurrent.futures.CancelledError)
                           else str(e) if request_fault else "internal server error")
                yield {"error": {"message": message, "type": "invalid_request_error" if request_fault else "server_error",
                                 "param": None, "code": None}}
                for sample in sorted(unfinished):
                    failed = make_chunk(sample, "", [], None, sample not in sent)
                    for choice in failed["choices"]:
                        choice["finish_reason"] = "error"
                    yield failed
            finally:
                flight.finish(done)
                await chunks.aclose()  # a client that went away cancels its request
        return _sse(events())

    def usage_chunk(req, rid: str, created: int, kind: str, echo_only: bool = False):
        """stream_options.include_usage: a last chunk with no choices and the request's usage (OpenAI's)."""
        if req.stream_options is None or not req.stream_options.include_usage:
            return None
        return lambda completions: {"id": rid, "object": kind, "created": created, "model": name, "choices": [],
                                    "usage": usage(completions, req.n, echo_only)}

    @app.get("/health")
    async def health():
        try:  # the cheap form (slot count); in a thread, as it waits for the current engine step
            await asyncio.to_thread(model.check_integrity, full=False)
        except AssertionError as e:
            return JSONResponse({"status": "error", "detail": str(e) or "integrity check failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvql",
                                            "max_model_len": model.context_length}]}  # vLLM's field

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        opts = options(request, req, req.logprobs)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompts = completion_prompts(req)
        tok, spell = model.tokenizer, Spelling(model.tokenizer, bool(req.return_tokens_as_token_ids))
        echo_only = req.echo and 0 in (req.max_tokens, req.max_completion_tokens)
        k = req.logprobs

        def prompt_ids(p):
            return engine_ids([p])[0]

        def shown(p, c, text: str, ids: list[int], first: bool) -> dict:
            """One choice (or a stream's chunk of it; `c` set when the sample is done), with vLLM's echo
            rules. Logprobs come whole with the finished sample (the engine streams text and ids only)."""
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
                    lp_ids, entries = prompt_ids(p) + lp_ids, c.prompt_logprobs + entries
                choice["logprobs"] = completion_logprobs(spell, lp_ids, entries, k)
            if req.return_token_ids:
                choice["token_ids"] = ids
                if first:
                    choice["prompt_token_ids"] = prompt_ids(p)
            if c is not None and req.prompt_logprobs is not None and c.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(tok, c.prompt_logprobs, req.prompt_logprobs)
            return choice

        if req.stream:
            if len(prompts) != 1:
                raise RequestError("stream: true takes one prompt", "prompt")
            p = prompts[0]
            return await streamed(request, p, opts, lambda sample, text, ids, c, first: {
                "id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": sample, **shown(p, c, text, ids, first)}]},
                usage_chunk(req, rid, created, "text_completion", echo_only))
        out = await run(request, prompts, opts)
        choices = [{"index": i, **shown(prompts[c.index], c, c.text, c.token_ids, True)}
                   for i, c in enumerate(out)]
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": choices, "usage": usage(out, req.n, echo_only)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        ids = chat_ids(req)
        k = (req.top_logprobs or 0) if req.logprobs else None
        opts = options(request, req, k)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        spell = Spelling(model.tokenizer, bool(req.return_tokens_as_token_ids))
        if req.stream:
            def make_chunk(sample, text, token_ids, c, first):
                choice = {"index": sample, "delta": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": c and c.finish_reason, "stop_reason": c and c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = token_ids
                if c is not None and k is not None:  # logprobs come whole, in a sample's last chunk
                    choice["logprobs"] = chat_logprobs(spell, c.token_ids, c.logprobs, k)
                event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [choice]}
                if req.return_token_ids and first and sample == 0:
                    event["prompt_token_ids"] = ids
                return event
            return await streamed(request, ids, opts, make_chunk,
                                  usage_chunk(req, rid, created, "chat.completion.chunk"))
        out = await run(request, [ids], opts)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "logprobs": chat_logprobs(spell, c.token_ids, c.logprobs, k) if k is not None else None}
                   | ({"token_ids": c.token_ids} if req.return_token_ids else {}) for i, c in enumerate(out)]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": choices, "usage": usage(out, req.n)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(model.tokenizer, out[0].prompt_logprobs, req.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return body

    @app.post("/v1/completions/render")
    async def render_completion(request: Request):
        """Per prompt, what /v1/completions would feed the engine; nothing is generated. The request is
        checked as /v1/completions checks it, so a render answers the 400 its generation would."""
        req = await parse(request, CompletionRequest)
        options(request, req, req.logprobs)
        ids = engine_ids(completion_prompts(req))
        rid = f"cmpl-{uuid.uuid4().hex}"
        return [rendered(req, rid if len(ids) == 1 else f"{rid}-{i}", t) for i, t in enumerate(ids)]

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        """What /v1/chat/completions would feed the engine (one object, as vLLM answers); nothing is
        generated."""
        req = await parse(request, ChatRequest)
        options(request, req, None)
        return rendered(req, f"chatcmpl-{uuid.uuid4().hex}", chat_ids(req))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


@contextlib.contextmanager
def _request_errors():
    """What the engine raises about a request's own options (a bad constraint, a prompt over the
    context) -> a 400."""
    try:
        yield
    except RequestError:
        raise
    except (ValueError, TypeError) as e:  # the model's checks of an option name it first ("logit_bias: ...")
        field = str(e).split(":", 1)[0]
        raise RequestError(str(e), field if field in _NAMED else None) from None
    except RecursionError:
        raise RequestError("the constraint is nested too deeply") from None


_NAMED = ("logit_bias",)


async def _unless_disconnected(request: Request, awaitable):
    """Await `awaitable`; if the client disconnects first, cancel it (cancelling a generation cancels its
    engine requests) and raise a 499 nobody will read. Until a response starts, nothing else notices."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise RequestError("the client disconnected", status=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)


def _sse(events) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


class _Sent:
    """What a stream has sent of one sample: how many characters and token ids went out."""

    def __init__(self):
        self.chars, self.ids, self.started = 0, 0, False
