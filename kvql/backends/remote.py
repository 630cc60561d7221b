"""`RemoteBackend`: the backend contract over an OpenAI-compatible server (`kvql serve`, vLLM, SGLang).

`kvql.model("http://HOST:PORT/v1", name=..., tokenizer=...)` returns one (`kvql.RemoteModel()` with no URL
reads `OPENAI_BASE_URL`, and with no `api_key` `OPENAI_API_KEY`, as the `openai` client does). On creation it asks the server
what it serves (`/v1/models`) and what it is (`/metrics` for kvql, `/version` for vLLM,
`/get_model_info` for SGLang), and so which features it has; a request for one it lacks raises
`Unsupported` before anything is sent, naming the server and the feature. Requests are OpenAI's JSON
(extension fields at the top level, as the `openai` client's `extra_body` sends them); `stats()` reads the
server's Prometheus counters with `prometheus_client`'s parser. kvql serve and vLLM 0.32 are tested; SGLang's
spellings are taken from its source (python/sglang/srt/entrypoints/openai/protocol.py) and not tested here.

The server is not trusted (`kvql.backends.bounded_http`): each request has a deadline (`timeout=`, seconds from
sending it to its answer's last byte, however slowly the bytes come), answers are read within byte limits per
body, line and stream, a stream is closed once every sample has ended (its finish reason, or `max_tokens`
tokens), and every field used is checked. Anything else raises `BackendError` naming the server, the path and
the field ("server http://HOST:PORT: /v1/completions answered choices[0].text = 12345 (expected a string)"):
nothing malformed becomes a value.

With a tokenizer the query runtime keeps prompts as token ids and sends them as ids, exactly as on the
local backend: greedy results equal the local ones token for token (up to the server's arithmetic), role
tags render through the chat template, beam search, `distribution` and `score` work, and traces show
tokens. The tokenizer is the one given (`tokenizer=`: an object, a spec or a model directory), else one
found under the served model's name (a built-in spec, a local model directory, or a Hugging Face model in
the local cache), else the server's own through its `/tokenize` and `/detokenize` endpoints (kvql serve,
vLLM, SGLang: `kvql.backends.server_tokenizer`; `tokenizer="server"` asks for it first). Without any
(`tokenizer=False`, or an OpenAI-style server with no such endpoints), prompts are text: queries with
plain holes and constraints run, the rest is refused by name.

How each contract option travels (kvql serve and vLLM spell them alike; SGLang differently):
- constraints: `structured_outputs.{regex, choice, json, grammar}` (Lark: vLLM's default backend
  falls back to llguidance for grammars xgrammar cannot read); SGLang: `regex`, `json_schema`
  (no Lark: `grammar` is refused there);
- `logprobs=k`: OpenAI's `logprobs` with `return_tokens_as_token_ids` (tokens spelled `token_id:N`);
- `ascore`: `prompt_logprobs` on prompt + continuation;
- `stop_fn`: the request is streamed, the function called on each chunk, and the stream closed
  (the server aborts the request) once it says stop;
- `masked_logprobs` (beam search under a constraint) and `grammar_prefix`: no server returns the
  log-probabilities of the constrained distribution, so these are refused when a constraint or
  `min_tokens` is given (without one, the raw distribution is the masked one);
- every other option: the field of the same name, sent only when it is not at its default (`max_tokens`,
  `temperature`, `top_p`, `n` always), refused where the server lacks what it needs (`top_k`, `min_p` and
  `repetition_penalty` on an OpenAI-style server): each option's `remote` rule in
  `kvql.backends.options.GenerateOptions` (SGLang's OpenAI endpoint also reads `min_tokens`; it reports the
  stop string as `matched_stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import AsyncIterator

from ..completion import Completion
from . import base, completions_reply, server_metrics
from .base import Backend, BackendError, StreamChunk, Unsupported
from .bounded_http import (INTEGER, INTEGERS, LIST, OBJECT, STRING, Reply, Server, StatusError, error_message,
                           run_sync)
from .options import GenerateOptions, Sent
from .server_tokenizer import ServerTokenizer, local_tokenizer

QUICK_SECONDS = 30.0  # the deadline of requests that compute nothing (models, tokenizer, metrics), within timeout

# constraint option -> (group, field) in a completions request body; group None: a top-level field
_SPELLINGS = {
    "kvql": {"regex": ("structured_outputs", "regex"), "choices": ("structured_outputs", "choice"),
             "json_schema": ("structured_outputs", "json"), "grammar": ("structured_outputs", "grammar")},
    "vllm": {"regex": ("structured_outputs", "regex"), "choices": ("structured_outputs", "choice"),
             "json_schema": ("structured_outputs", "json"), "grammar": ("structured_outputs", "grammar")},
    "sglang": {"regex": (None, "regex"), "json_schema": (None, "json_schema")},
    "openai": {},
}
_EXTRAS = {  # what each kind of server offers besides constraints
    "kvql": {base.SCORE, base.LOGPROBS, base.MIN_TOKENS, base.STOP_FN, base.SAMPLING, base.CACHE_SALT},
    "vllm": {base.SCORE, base.LOGPROBS, base.MIN_TOKENS, base.STOP_FN, base.SAMPLING, base.CACHE_SALT},
    "sglang": {base.MIN_TOKENS, base.STOP_FN, base.SAMPLING, base.CACHE_SALT},
    "openai": {base.STOP_FN},
}
_CALLBACKS = ("mask",)  # Python functions that would have to run inside the server
_DEFAULTS = GenerateOptions()  # an option at its default is not sent (the server's default is the same)


class RemoteBackend(Backend):
    def __init__(self, base_url: str | None = None, *, name: str | None = None, api_key: str | None = None,
                 tokenizer=None, timeout: float = 600.0):
        """`base_url` (default `$OPENAI_BASE_URL`): the server's OpenAI base URL, `http://HOST:PORT/v1`;
        `api_key` (default `$OPENAI_API_KEY`, none when unset): sent as `Authorization: Bearer KEY`;
        `timeout`: the seconds one request may take, from sending it to its answer's last byte (a generation's
        whole stream included); those that compute nothing (the model list, the tokenizer's, `/metrics`) take
        at most `QUICK_SECONDS`. Setting up asks a few of these (the models, what the server is, its tokenizer)."""
        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError("no server URL: pass one (kvql.model('http://HOST:PORT/v1')) or set OPENAI_BASE_URL")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.api = self.base_url[len(self.root):]  # "/v1", or "" for a base URL without it
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = float(timeout)
        self.server = Server(self.root, self.headers)
        path = self.api + "/models"
        models = run_sync(self.server.json("GET", path, seconds=self._quick))
        served = {}
        for i, entry in enumerate(models.get(models.body, "data", LIST)):
            models.check(entry, OBJECT, f"data[{i}]")
            served[models.get(entry, "id", STRING, f"data[{i}]")] = i, entry
        if name is not None and name not in served:
            raise ValueError(f"{self.base_url} serves {sorted(served)}, not {name!r}")
        if not served:
            raise ValueError(f"{self.base_url} serves no model")
        self.name = name or next(iter(served))
        i, entry = served[self.name]
        self.context_length = models.get(entry, "max_model_len", INTEGER, f"data[{i}]", default=None)
        self.kind = self._detect()
        if tokenizer == "server":
            self.tokenizer = self._server_tokenizer(required=True)
        else:
            self.tokenizer = local_tokenizer(tokenizer, self.name)
            if self.tokenizer is None and tokenizer is None and self.kind != "openai":
                self.tokenizer = self._server_tokenizer(required=False)
        features = set(_SPELLINGS[self.kind]) | _EXTRAS[self.kind]
        if self.tokenizer is not None:
            features.add(base.TOKEN_IDS)
            if self.kind == "kvql":  # llguidance reads token ids in grammars; vLLM's xgrammar does not
                features.add(base.TOKEN_GRAMMAR)
            eos = self.tokenizer.eos_token_id
            self.eos_ids = frozenset([] if eos is None else [eos])
        self.capabilities = frozenset(features)

    @property
    def _quick(self) -> float:
        return min(self.timeout, QUICK_SECONDS)

    def _server_tokenizer(self, required: bool):
        """The server's tokenizer (`ServerTokenizer`), or None when it refuses `/tokenize` (a `BackendError` if
        `required`); a broken answer is an error either way."""
        try:
            return ServerTokenizer(self.root, self.name, self.headers, timeout=self._quick)
        except StatusError as e:
            if required:
                raise BackendError(f"{self.describe()} offers no tokenizer: {e}") from None
            return None

    def _detect(self) -> str:
        """What the server is, by the page only it has; a page it refuses is not there."""
        for kind, path, marker in (("kvql", "/metrics", b"kvql_"), ("vllm", "/version", b"version"),
                                   ("sglang", "/get_model_info", b"model_path")):
            try:
                page = run_sync(self.server.read("GET", path, seconds=self._quick))
            except StatusError:
                continue
            if marker in page:
                return kind
        return "openai"

    @property
    def supported_constraints(self) -> list[str]:
        return sorted(_SPELLINGS[self.kind])

    def describe(self) -> str:
        return f"the {self.kind} server at {self.base_url}"

    def why_not(self, capability: str) -> str:
        if capability == base.TOKEN_IDS:
            return (f"it needs the model's tokenizer: none was found under the served name {self.name!r} and the "
                    "server offers none (/tokenize): pass kvql.model(url, tokenizer=MODEL_DIR_OR_SPEC)")
        if capability == base.HEAL:
            return ("kvql's remote client does not heal tokens (it would back up the prompt's last tokens and "
                    "count the value's tokens itself); run the query on a local model, or without healing")
        if capability == base.MASKED_LOGPROBS:
            return "servers return log-probabilities of the unconstrained distribution only"
        return f"{self.kind} servers do not offer it"

    # -- requests --------------------------------------------------------------------------------
    def _request(self, prompt, **options) -> tuple[dict, object]:
        """Check every option against this server; -> (the `/completions` request body, stop_fn)."""
        o, callbacks = GenerateOptions.read(options, _CALLBACKS)
        if o.heal:
            self.require(base.HEAL, "token healing (heal=True, HEAL(X), token_healing=True)")
        for key, value in callbacks.items():
            if value is not None:
                raise Unsupported(f"{key} is a Python callback and cannot run on {self.describe()}; "
                                  "use regex, choices, json_schema or grammar")
        given = dict([o.constraint]) if o.constraint is not None else {}
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt
                                                and all(isinstance(t, int) for t in prompt)):
            raise TypeError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        spelled: dict = {}  # the constraint, as this server spells it
        for key, value in given.items():
            self.require(key, f"a {key} constraint")
            group, field = _SPELLINGS[self.kind][key]
            if self.kind == "sglang" and key == "json_schema" and not isinstance(value, str):
                value = json.dumps(value)  # SGLang takes the schema as a string
            (spelled.setdefault(group, {}) if group else spelled)[field] = value
        if o.masked_logprobs and (given or o.min_tokens):
            self.require(base.MASKED_LOGPROBS, "beam search under a constraint")
        if o.grammar_prefix and given:
            self.require(base.MASKED_LOGPROBS, "a constraint that starts inside the prompt (grammar_prefix)")
        if o.stop_fn is not None:
            self.require(base.STOP_FN, "a stop function")
        body = {"model": self.name, "prompt": prompt}
        for name, rule in GenerateOptions.rules("remote").items():  # those sent under their own names
            value = getattr(o, name)
            if isinstance(rule, Sent) and (rule.always or value != getattr(_DEFAULTS, name)):
                if rule.needs is not None:
                    self.require(rule.needs, f"the {name} option")
                body[name] = list(value) if isinstance(value, tuple) else value
        if o.logprobs is not None:
            self.require(base.LOGPROBS, "log-probabilities by token id")
            body.update(logprobs=o.logprobs, return_tokens_as_token_ids=True)
        if self.kind in ("kvql", "vllm", "sglang"):
            body["return_token_ids"] = True
        body.update(spelled)
        return body, o.stop_fn

    async def _complete(self, body: dict) -> Reply:
        """The answer to one `/completions` request, not streamed."""
        path = self.api + "/completions"
        try:
            return await self.server.json("POST", path, body, seconds=self.timeout)
        except StatusError as e:
            raise self._explained(e, body) from None

    def _explained(self, e: StatusError, body: dict) -> StatusError:
        """`e`, with its likely cause where vLLM failed a grammar that only one of its backends reads."""
        grammar = (body.get("structured_outputs") or {}).get("grammar") or ""
        if self.kind == "vllm" and e.status >= 500 and ("&" in grammar or "~" in grammar):
            return StatusError(f"{e} (a Lark grammar with & or ~: vLLM runs one structured-output backend per "
                               "process, chosen by its first constrained request; only 'guidance' reads these. "
                               "Start vLLM with --structured-outputs-config.backend guidance)", e.status)
        return e

    async def agenerate(self, prompts, *, progress=False, **options) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        requests = [self._request(p, **options) for p in prompts]  # every error before anything is sent
        bar = base.progress_bar(progress, sum(body["n"] for body, _ in requests))

        async def one(body: dict, stop_fn) -> list[Completion]:
            try:
                return await self._one(body, stop_fn)
            finally:
                if bar is not None:
                    bar.update(body["n"])
        try:
            replies = await asyncio.gather(*(one(body, stop_fn) for body, stop_fn in requests))
        finally:
            if bar is not None:
                bar.close()
        out = []
        for index, completions in enumerate(replies):
            for c in completions:
                c.index = index
                out.append(c)
        return out

    async def _one(self, body: dict, stop_fn) -> list[Completion]:
        if stop_fn is not None:
            return await self._streamed(body, stop_fn)
        reply = await self._complete(body)
        prompt_tokens, cached = completions_reply.usage(reply)
        return [Completion(text=reply.get(choice, "text", STRING, where),
                           token_ids=reply.get(choice, "token_ids", INTEGERS, where, default=[]),
                           finish_reason=reply.get(choice, "finish_reason", STRING, where, default="length"),
                           prompt_tokens=prompt_tokens, cached_tokens=cached, sample=sample,
                           logprobs=completions_reply.logprobs(reply, choice, where) if body.get("logprobs") is not None else None,
                           stop_reason=completions_reply.stop_reason(reply, choice, where))
                for sample, (where, choice) in enumerate(completions_reply.choices(reply, body["n"]))]

    async def _stream(self, body: dict) -> AsyncIterator[tuple[int, str, list[int], str | None]]:
        """The choices of `body` streamed, checked: (sample, text, token ids, finish reason or None). A sample
        ends at its finish reason, or at a chunk with more tokens after its `max_tokens` (counted as its chunks'
        ids, or a token per chunk with text where the server sends no ids), which ends it as "length" with
        nothing of that chunk: a server streaming past the limit is not read further. The stream is closed once
        every sample has ended; one that ends before is an error."""
        path, n = self.api + "/completions", body["n"]
        left = [body["max_tokens"]] * n  # tokens each sample may still have
        ended = [False] * n
        events = self.server.events(path, {**body, "stream": True}, seconds=self.timeout)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    reply = Reply(self.server, path, event)
                    if event.get("error") is not None:  # the request failed after the stream had started
                        raise self.server.error(path, "failed after its stream began: "
                                                      f"{error_message(event) or 'no message'}")
                    for k, choice in enumerate(reply.get(event, "choices", LIST)):
                        where = f"choices[{k}]"
                        reply.check(choice, OBJECT, where)
                        i = reply.get(choice, "index", INTEGER, where)
                        if not 0 <= i < n:
                            raise reply.wrong(where + ".index", i, f"a sample number below {n}")
                        if ended[i]:
                            continue
                        text = reply.get(choice, "text", STRING, where)
                        ids = reply.get(choice, "token_ids", INTEGERS, where, default=[])
                        reason = reply.get(choice, "finish_reason", STRING, where, default=None)
                        tokens = len(ids) or (1 if text else 0)
                        if tokens and not left[i]:  # past max_tokens
                            text, ids, reason = "", [], "length"
                        left[i] = max(left[i] - tokens, 0)
                        ended[i] = reason is not None
                        yield i, text, ids, reason
                    if all(ended):
                        return
            unfinished = [i for i in range(n) if not ended[i]]  # a stream cut short is no answer
            raise self.server.error(path, f"ended its stream before sample{'s' * (len(unfinished) > 1)} "
                                          f"{', '.join(map(str, unfinished))} had a finish_reason")
        except StatusError as e:
            raise self._explained(e, body) from None

    async def _streamed(self, body: dict, stop_fn) -> list[Completion]:
        """A request with a stop function, streamed (`_chunks`): each sample's completion."""
        done: list[Completion | None] = [None] * body["n"]
        async with contextlib.aclosing(self._chunks(body, stop_fn)) as chunks:
            async for chunk in chunks:
                if chunk.completion is not None:
                    done[chunk.sample] = chunk.completion
        return done

    async def _chunks(self, body: dict, stop_fn) -> AsyncIterator[StreamChunk]:
        """`body` streamed (`_stream`), a `StreamChunk` per chunk of a sample's text; the sample's last one
        carries its `Completion` (its text and token ids; the prompt's length where it was given as ids, no
        cached count: the usage comes after every sample's end, where the stream is closed). A sample ends at
        its finish reason, at `max_tokens`, or where `stop_fn` (called with its ids and text so far) says
        so; the stream is closed once every sample has ended (the text may run a little past where the
        function first said stop; the caller cuts it)."""
        n = body["n"]
        texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else 0
        async with contextlib.aclosing(self._stream(body)) as chunks:
            async for i, text, token_ids, reason in chunks:
                if reasons[i] is not None:
                    continue
                texts[i] += text
                ids[i] += token_ids
                if reason is None and stop_fn is not None and stop_fn(ids[i], texts[i]):
                    reason = "stop"
                reasons[i] = reason
                done = Completion(texts[i], ids[i], reason, prompt_tokens, 0, sample=i) if reason else None
                yield StreamChunk(i, text, token_ids[-1] if len(token_ids) == 1 else -1, done)
                if all(r is not None for r in reasons):
                    return

    async def stream(self, prompt, **options) -> AsyncIterator[StreamChunk]:
        body, stop_fn = self._request(prompt, **options)
        async with contextlib.aclosing(self._chunks(body, stop_fn)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def ascore(self, prompt_ids: list[int], continuations: list[list[int]]):
        """Each continuation appended to the prompt and sent with `prompt_logprobs` (one request each,
        concurrently; the server's prefix cache shares the prompt where it can)."""
        self.require(base.SCORE, "scoring (prompt log-probabilities)")

        async def one(ids: list[int]):
            if not ids:
                return [], None
            body = {"model": self.name, "prompt": prompt_ids + ids, "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": 0, "return_token_ids": True}
            reply = await self._complete(body)
            ((where, choice),) = completions_reply.choices(reply, 1)
            found = reply.get(choice, "prompt_logprobs", LIST, where, default=None)
            rows, at = (found, where + ".prompt_logprobs") if found is not None else \
                (reply.get(reply.body, "prompt_logprobs", LIST, default=None), "prompt_logprobs")  # or beside choices
            if rows is None or len(rows) != len(body["prompt"]):
                raise reply.wrong(at, rows, f"a list of {len(body['prompt'])} rows, one per prompt token")
            lps = [completions_reply.prompt_logprob(reply, rows, at, len(prompt_ids) + j, t) for j, t in enumerate(ids)]
            prompt_tokens, cached = completions_reply.usage(reply)
            return lps, Completion(reply.get(choice, "text", STRING, where), [],
                                   reply.get(choice, "finish_reason", STRING, where, default="length"),
                                   prompt_tokens, cached)

        results = await asyncio.gather(*(one(ids) for ids in continuations))
        return [lps for lps, _ in results], [c for _, c in results if c is not None]

    def stats(self) -> dict:
        """The server's counters, from its Prometheus `/metrics` (server_metrics.py): `prompt_tokens`,
        `cached_tokens`, `computed_tokens`, `generated_tokens`, `hit_rate` where the server counts them (kvql's also
        `ram_tokens` and `disk_tokens`: where its cached ones were, memory or its disk tier), and `metrics`: every
        sample by name (summed over labels)."""
        text = run_sync(self.server.read("GET", "/metrics", seconds=self._quick)).decode("utf-8", "replace")
        try:
            return server_metrics.counters(text, self.kind)
        except ValueError as e:
            raise self.server.error("/metrics", f"answered metrics that do not parse: {e}") from None

    def close(self) -> None:
        if isinstance(self.tokenizer, ServerTokenizer):
            self.tokenizer.close()

    def __repr__(self) -> str:
        mode = "token ids" if self.tokenizer is not None else "text prompts"
        return f"kvql.RemoteModel({self.name!r} at {self.base_url}, {self.kind}, {mode})"
