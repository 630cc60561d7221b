"""`Served`: one model as the server serves it, and the steps every route shares: read a request body
(`parse`), translate its fields into the model's generation options (`options`), feed the model (`run`,
`streamed`), and the parts of OpenAI's answers that do not depend on the route (`usage`,
`usage_chunk`). The model is used through its public methods only (`kvql.backends.local.LocalBackend`)."""

from __future__ import annotations

import concurrent.futures
import hashlib

import jinja2
from fastapi import Request

from ..backends.options import GenerateOptions
from ..runtime import plain_content
from . import streaming, tools
from .errors import request_errors, unless_disconnected
from .logprobs import PROMPT_TOP
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest, RequestError, parse_request
from .request_constraint import constraint_options
from .tools import ToolCalling


class Served:
    """`model` served as `name` (and `aliases`); `counters`: the app's request and error counts; `plain_content`:
    messages' content is tokenized as plain text (kvql.runtime.plain_content), so it cannot forge a turn."""

    def __init__(self, model, name: str, aliases, counters: dict, *, salt_per_key: bool, max_body_bytes: int,
                 max_tokens_cap: int, plain_content: bool = False):
        self.model, self.name, self.served, self.counters = model, name, {name, *aliases}, counters
        self.metrics = Metrics(model, counters)
        self.salt_per_key, self.max_body_bytes, self.max_tokens_cap = salt_per_key, max_body_bytes, max_tokens_cap
        self.plain_content = plain_content
        self._takes_tools: bool | None = None  # whether the chat template renders tools: found on first use

    async def body(self, request: Request) -> bytes:
        """The request's body, read within `max_body_bytes` (413 past it), also when no content-length was sent."""
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise RequestError(f"request body over {self.max_body_bytes} bytes", status=413)
        return bytes(raw)

    async def parse(self, request: Request, cls):
        req = parse_request(await self.body(request), cls)
        if req.model is not None and req.model not in self.served:
            raise RequestError(f"model {req.model!r} is not served here; this server serves {self.name!r}",
                               "model", 404, "model_not_found")
        return req

    def options(self, request: Request, req, logprobs, prompt_tokens: int | None = None, constraint=None) -> dict:
        """The request's fields as the model's generation options (`logprobs`: the top-k to return): the HTTP
        translation of `GenerateOptions` (each option's `http` rule says which field it is read from).
        Without max_tokens: a completion gets 16 tokens (OpenAI's and vLLM's default); a chat, whose
        `prompt_tokens` are given, the rest of what a request may hold (the context, or the cache budget where
        smaller), within the server's cap (as vLLM: a chat's answer runs to its end). `constraint`: generate
        options of a constraint the request's fields do not hold (tool calling's)."""
        default = 16
        if prompt_tokens is not None:
            default = max(1, min(self.max_tokens_cap, self.model.max_request_tokens - prompt_tokens))
        max_tokens = next((v for v in (req.max_completion_tokens, req.max_tokens) if v is not None), default)
        if max_tokens == 0 and not getattr(req, "echo", False):
            raise RequestError("max_tokens must be at least 1 (0 only with echo: true, which returns the prompt; "
                               "with logprobs, the prompt's log-probabilities)", "max_tokens")
        if max_tokens > self.max_tokens_cap:
            raise RequestError(f"max_tokens {max_tokens} is over this server's cap of {self.max_tokens_cap}",
                               "max_tokens")
        if req.min_tokens > max_tokens:
            raise RequestError(f"min_tokens must be at most max_tokens={max_tokens}, got {req.min_tokens}", "min_tokens")
        # the options HTTP spells as Python does (a null field: the option's default), then the others
        opts = {name: getattr(req, name) for name, rule in GenerateOptions.rules("http").items()
                if rule is True and getattr(req, name) is not None}
        opts.update(max_tokens=max(max_tokens, 1), logprobs=logprobs, top_k=max(req.top_k or 0, 0),  # vLLM's -1: 0
                    logit_bias=req.logit_bias or None)
        constraints = constraint_options(req)
        if constraint and constraints:
            raise RequestError("tools (with tool_choice other than none) constrain the output themselves: they do not "
                               "combine with response_format, structured_outputs, regex or json_schema", "tools")
        opts.update(constraints or constraint or {})
        if req.prompt_logprobs and req.stream:
            raise RequestError("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        echo_scored = getattr(req, "echo", False) and logprobs is not None  # vLLM: echo + logprobs -> prompt logprobs
        if (req.prompt_logprobs is not None and not req.stream) or echo_scored:
            opts["prompt_logprobs"] = PROMPT_TOP  # k shown; more asked for, so that more ranks are exact
        salt = self.cache_salt(request, req)
        if salt is not None:
            opts["cache_salt"] = salt
        return opts

    def cache_salt(self, request: Request, req) -> str | None:
        key = request.scope.get("kvql.api_key") if self.salt_per_key else None
        if key is None:
            return req.cache_salt
        # the key's own partition; a client salt subdivides it (a 64-hex prefix no client salt can forge)
        own = hashlib.sha256(key.encode()).hexdigest()
        return own if req.cache_salt is None else f"{own}:{req.cache_salt}"

    def prompt_ids(self, prompts: list) -> list[list[int]]:
        """Each prompt (text or token ids) as the token ids the engine is fed for it."""
        with request_errors():
            return self.model.prompt_ids(prompts)

    def chat_ids(self, req: ChatRequest, calling: ToolCalling | None = None) -> list[int]:
        """The chat template applied to the messages (and the tools of `calling`, kvql.server.tools), opening
        the assistant's turn: the engine's prompt. The rendered text is tokenized with its special tokens parsed,
        content included (as transformers and vLLM do), unless `plain_content`."""
        tokenizer = self.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        if self._takes_tools is None:
            self._takes_tools = tools.template_takes_tools(tokenizer)
        messages = tools.message_dicts(req.messages, self._takes_tools, tools.message_text)
        extra = {} if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
        if calling is not None:
            messages, offered = calling.messages(messages, self._takes_tools)
            extra.update(offered)
        try:
            if self.plain_content:
                ids = plain_content.chat_ids(tokenizer, messages, add_generation_prompt=True, **extra)
            else:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False, **extra)
        except jinja2.TemplateError as e:  # templates refuse some message sequences (raise_exception)
            raise RequestError(f"the model's chat template refused these messages: {e}", "messages") from None
        except (TypeError, KeyError, AttributeError, ValueError) as e:  # a field these messages lack; a mark cut
            raise RequestError(f"the model's chat template could not render these messages: "
                               f"{type(e).__name__}: {e}", "messages") from None
        return list(ids)

    async def _generate(self, flight, prompts, opts):
        """`model.agenerate`, its groups kept in `flight` (timings, cancellation at shutdown)."""
        groups = await self.model.submit(prompts, flight.on_update, **opts)
        flight.groups.extend(groups)
        return await self.model.collect(groups)

    async def run(self, request: Request, prompts, opts) -> list:
        """The completions of `prompts` (cancelled if the client leaves; a 503 if the server shuts down)."""
        self.counters["requests"] += 1
        flight, out = self.metrics.flight(request.scope), []
        try:
            with request_errors():
                out = await unless_disconnected(request, self._generate(flight, prompts, opts))
        except (concurrent.futures.CancelledError, RequestError) as e:
            # the engine's cancellation reaches an awaiting task as its own cancellation (a 499)
            if isinstance(e, RequestError) and not (e.status == 499 and flight.cancelled):
                raise
            raise RequestError("the request was cancelled: the server is shutting down", status=503,
                               kind="server_error") from None
        finally:
            flight.finish(out)
        return out

    async def streamed(self, request: Request, req, prompt, opts, make_chunk, usage_chunk=None):
        """Server-sent events of one prompt's `n` samples (streaming.events): `make_chunk(sample, text,
        token_ids, completion, first)` per engine step; then, with `usage_chunk`, `usage_chunk(completions)`."""
        self.counters["requests"] += 1
        flight = self.metrics.flight(request.scope)
        chunks = self.model.stream(prompt, on_token=flight.on_update, on_group=flight.groups.append, **opts)
        try:
            with request_errors():  # errors in the request surface before the 200 is sent
                first = await unless_disconnected(request, anext(chunks, None))
        except BaseException:
            flight.finish([])
            raise
        running = None
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            running = len(prompt) if isinstance(prompt, list) else len(self.prompt_ids([prompt])[0])
        return streaming.sse(streaming.events(first, chunks, opts["n"], make_chunk, usage_chunk, self.counters, flight,
                                              running))

    def usage_chunk(self, req, rid: str, created: int, kind: str, echo_only: bool = False):
        """stream_options.include_usage: a last chunk with no choices and the request's usage (OpenAI's)."""
        if req.stream_options is None or not req.stream_options.include_usage:
            return None
        return lambda completions: {"id": rid, "object": kind, "created": created, "model": self.name, "choices": [],
                                    "usage": usage(completions, req.n, echo_only)}


def usage(completions, n: int, echo_only: bool = False) -> dict:
    completions = sorted(completions, key=lambda c: (c.index, c.sample))
    prompt = sum(c.prompt_tokens for c in completions[::n])
    cached = sum(c.cached_tokens for c in completions[::n])
    generated = 0 if echo_only else sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


MAX_PROMPTS = 256  # prompts in one completion request, at most ...
MAX_SAMPLES = 256  # ... and samples (prompts x n): one request cannot queue more work than this


def completion_prompts(req: CompletionRequest) -> list:
    """The request's prompts; a 400 past `MAX_PROMPTS` prompts or `MAX_SAMPLES` samples (`n` bounds a prompt's
    samples, this a request's: ["Hi"] * 2000 with n 64 would queue 128,000)."""
    p = req.prompt
    prompts = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"{len(prompts)} prompts in one request; this server takes at most {MAX_PROMPTS} (send "
                           "more requests)", "prompt")
    if len(prompts) * req.n > MAX_SAMPLES:
        raise RequestError(f"{len(prompts)} prompts x n={req.n} = {len(prompts) * req.n} samples in one request; "
                           f"this server makes at most {MAX_SAMPLES} per request", "n")
    return prompts


def rendered(req, request_id: str, token_ids: list[int]) -> dict:
    """vLLM's `GenerateRequest` as its render endpoints answer it, less `sampling_params` (vLLM's engine
    options, which kvql's are not)."""
    return {"request_id": request_id, "token_ids": token_ids, "model": req.model, "stream": req.stream,
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": req.cache_salt}
