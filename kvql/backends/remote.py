"""`RemoteBackend`: the backend contract over an OpenAI-compatible server (`kvql serve`, vLLM, SGLang).

`kvql.model("http://HOST:PORT/v1", name=..., tokenizer=...)` returns one (`kvql.RemoteModel()` with no URL
reads `OPENAI_BASE_URL`, and with no `api_key` `OPENAI_API_KEY`, as the `openai` client does). On creation it asks the server
what it serves (`/v1/models`) and what it is (`/metrics` for kvql, `/version` for vLLM,
`/get_model_info` for SGLang), and so which features it has; a request for one it lacks raises
`Unsupported` before anything is sent, naming the server and the feature. Requests go through the
official `openai` client (extension fields in `extra_body`); `stats()` reads the server's Prometheus
counters with `prometheus_client`'s parser. kvql serve and vLLM 0.32 are tested; SGLang's spellings are
taken from its source (python/sglang/srt/entrypoints/openai/protocol.py) and not tested here.

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
- `min_tokens`, `stop`, `seed`, `top_k`, penalties, `ignore_eos`, `cache_salt`: fields of the same name
  (SGLang's OpenAI endpoint also reads `min_tokens`; it reports the stop string as `matched_stop`);
- `logprobs=k`: OpenAI's `logprobs` with `return_tokens_as_token_ids` (tokens spelled `token_id:N`);
- `ascore`: `prompt_logprobs` on prompt + continuation;
- `stop_fn`: the request is streamed, the function called on each chunk, and the stream closed
  (the server aborts the request) once it says stop;
- `masked_logprobs` (beam search under a constraint) and `grammar_prefix`: no server returns the
  log-probabilities of the constrained distribution, so these are refused when a constraint or
  `min_tokens` is given (without one, the raw distribution is the masked one).
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from typing import AsyncIterator

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from ..completion import Completion, TokenLogprob
from . import base
from .base import Backend, BackendError, StreamChunk, Unsupported
from .options import GenerateOptions
from .server_tokenizer import ServerTokenizer

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


class RemoteBackend(Backend):
    def __init__(self, base_url: str | None = None, *, name: str | None = None, api_key: str | None = None,
                 tokenizer=None, timeout: float = 600.0):
        """`base_url` (default `$OPENAI_BASE_URL`): the server's OpenAI base URL, `http://HOST:PORT/v1`;
        `api_key` (default `$OPENAI_API_KEY`, none when unset): sent as `Authorization: Bearer KEY`."""
        base_url = base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise ValueError("no server URL: pass one (kvql.model('http://HOST:PORT/v1')) or set OPENAI_BASE_URL")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or None
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        with httpx.Client(headers=self.headers, timeout=30) as client:
            try:
                models = client.get(self.base_url + "/models")
            except httpx.TransportError as e:
                raise ValueError(f"cannot reach {self.base_url}: {e}") from None
            if models.status_code != 200:
                raise ValueError(f"{self.base_url}/models answered {models.status_code}: {models.text[:200]}")
            served = {m["id"]: m for m in models.json().get("data", [])}
            if name is not None and name not in served:
                raise ValueError(f"{self.base_url} serves {sorted(served)}, not {name!r}")
            if not served:
                raise ValueError(f"{self.base_url} serves no model")
            self.name = name or next(iter(served))
            length = served[self.name].get("max_model_len")
            self.context_length = int(length) if isinstance(length, int) else None
            self.kind = self._detect(client)
        if tokenizer == "server":
            self.tokenizer = self._server_tokenizer(required=True)
        else:
            self.tokenizer = _tokenizer(tokenizer, self.name)
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
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _server_tokenizer(self, required: bool):
        """The server's tokenizer (`ServerTokenizer`), or None when it offers none (a ValueError if `required`)."""
        try:
            return ServerTokenizer(self.root, self.name, self.headers)
        except ValueError as e:
            if required:
                raise ValueError(f"{self.describe()} offers no tokenizer: {e}") from None
            return None

    def _detect(self, client: httpx.Client) -> str:
        for kind, path, marker in (("kvql", "/metrics", "kvql_"), ("vllm", "/version", "version"),
                                   ("sglang", "/get_model_info", "model_path")):
            try:
                r = client.get(self.root + path)
            except httpx.TransportError:
                continue
            if r.status_code == 200 and marker in r.text:
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

    def _client(self) -> openai.AsyncOpenAI:
        """One client per event loop (connections belong to the loop that opened them). Connections are
        not kept alive: `asyncio.run` closes its loop without closing clients, and an idle pooled
        connection would then be torn down on a closed loop."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))
            client = self._clients[loop] = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                                              timeout=self.timeout, max_retries=0, http_client=http)
        return client

    # -- requests --------------------------------------------------------------------------------
    def _request(self, prompt, **options) -> tuple[dict, object]:
        """Check every option against this server; -> (the `completions.create` arguments, stop_fn)."""
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
        extra: dict = {}
        for key, value in given.items():
            self.require(key, f"a {key} constraint")
            group, field = _SPELLINGS[self.kind][key]
            if self.kind == "sglang" and key == "json_schema" and not isinstance(value, str):
                value = json.dumps(value)  # SGLang takes the schema as a string
            (extra.setdefault(group, {}) if group else extra)[field] = value
        if o.masked_logprobs and (given or o.min_tokens):
            self.require(base.MASKED_LOGPROBS, "beam search under a constraint")
        if o.grammar_prefix and given:
            self.require(base.MASKED_LOGPROBS, "a constraint that starts inside the prompt (grammar_prefix)")
        if o.min_tokens:
            self.require(base.MIN_TOKENS, "min_tokens")
            extra["min_tokens"] = o.min_tokens
        if o.stop_fn is not None:
            self.require(base.STOP_FN, "a stop function")
        sampling = {"top_k": o.top_k, "repetition_penalty": o.repetition_penalty}
        if o.top_k or o.repetition_penalty != 1.0:
            self.require(base.SAMPLING, f"sampling options {sorted(k for k, v in sampling.items() if v)}")
            extra.update({k: v for k, v in sampling.items() if v})
        if o.ignore_eos:
            extra["ignore_eos"] = True
        if o.cache_salt is not None:
            self.require(base.CACHE_SALT, "cache_salt (a per-tenant partition of the prefix cache)")
            extra["cache_salt"] = o.cache_salt
        if o.logprobs is not None:
            self.require(base.LOGPROBS, "log-probabilities by token id")
            extra["return_tokens_as_token_ids"] = True
        if self.kind in ("kvql", "vllm", "sglang"):
            extra["return_token_ids"] = True
        args = dict(model=self.name, prompt=prompt, max_tokens=o.max_tokens, temperature=o.temperature,
                    top_p=o.top_p, n=o.n, extra_body=extra)
        for key, value in (("stop", list(o.stop) or None), ("seed", o.seed), ("logprobs", o.logprobs)):
            if value is not None:
                args[key] = value
        for key, value in (("frequency_penalty", o.frequency_penalty), ("presence_penalty", o.presence_penalty)):
            if value:  # sent only when set: not every server takes them
                args[key] = value
        stop_fn = o.stop_fn
        return args, stop_fn

    async def _create(self, **args):
        try:
            return await self._client().completions.create(**args)
        except openai.APIStatusError as e:
            message = e.body.get("message", e.message) if isinstance(e.body, dict) else e.message
            grammar = (args.get("extra_body") or {}).get("structured_outputs", {}).get("grammar") or ""
            if self.kind == "vllm" and e.status_code >= 500 and ("&" in grammar or "~" in grammar):
                message += (" (a Lark grammar with & or ~: vLLM runs one structured-output backend per process, "
                            "chosen by its first constrained request; only 'guidance' reads these. Start vLLM "
                            "with --structured-outputs-config.backend guidance)")
            raise BackendError(f"{self.describe()} answered {e.status_code}: {message}") from None
        except openai.APIConnectionError as e:
            raise BackendError(f"cannot reach {self.describe()}: {e}") from None

    async def agenerate(self, prompts, *, progress=False, **options) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        requests = [self._request(p, **options) for p in prompts]  # every error before anything is sent
        bar = base.progress_bar(progress, sum(args["n"] for args, _ in requests))

        async def one(args: dict, stop_fn) -> list[Completion]:
            try:
                return await self._one(args, stop_fn)
            finally:
                if bar is not None:
                    bar.update(args["n"])
        try:
            replies = await asyncio.gather(*(one(args, stop_fn) for args, stop_fn in requests))
        finally:
            if bar is not None:
                bar.close()
        out = []
        for index, completions in enumerate(replies):
            for c in completions:
                c.index = index
                out.append(c)
        return out

    async def _one(self, args: dict, stop_fn) -> list[Completion]:
        if stop_fn is not None:
            return await self._streamed(args, stop_fn)
        reply = await self._create(**args)
        prompt_tokens, cached = _usage(reply)
        return [Completion(text=choice.text, token_ids=list(_extra(choice, "token_ids") or []),
                           finish_reason=choice.finish_reason or "length", prompt_tokens=prompt_tokens,
                           cached_tokens=cached, sample=sample, logprobs=_logprobs(choice.logprobs),
                           stop_reason=_stop_reason(choice))
                for sample, choice in enumerate(sorted(reply.choices, key=lambda c: c.index))]

    async def _streamed(self, args: dict, stop_fn) -> list[Completion]:
        """A request with a stop function: streamed, and closed once the function has stopped every sample
        (the text may run a little past that point; the caller cuts it)."""
        n = args["n"]
        texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        stream = await self._create(stream=True, **args)
        try:
            async for chunk in stream:
                for choice in chunk.choices:
                    i = choice.index
                    if reasons[i] is not None:
                        continue
                    texts[i] += choice.text
                    ids[i] += list(_extra(choice, "token_ids") or [])
                    if choice.finish_reason:
                        reasons[i] = choice.finish_reason
                    elif stop_fn(ids[i], texts[i]):
                        reasons[i] = "stop"
                if all(r is not None for r in reasons):
                    break
        finally:
            await stream.close()
        return [Completion(texts[i], ids[i], reasons[i] or "length", len(args["prompt"]) if
                           isinstance(args["prompt"], list) else 0, 0, sample=i) for i in range(n)]

    async def stream(self, prompt, **options) -> AsyncIterator[StreamChunk]:
        args, stop_fn = self._request(prompt, **options)
        if stop_fn is not None:
            raise TypeError("stream() takes no stop_fn: stop reading the stream instead")
        texts: dict[int, str] = {}
        stream = await self._create(stream=True, **args)
        try:
            async for chunk in stream:
                for choice in chunk.choices:
                    i = choice.index
                    texts[i] = texts.get(i, "") + choice.text
                    token_ids = list(_extra(choice, "token_ids") or [])
                    done = Completion(texts[i], [], choice.finish_reason, 0, 0, sample=i) if choice.finish_reason \
                        else None
                    yield StreamChunk(i, choice.text, token_ids[-1] if len(token_ids) == 1 else -1, done)
        except openai.APIError as e:  # the request failed after the stream had started
            raise BackendError(f"{self.describe()}: {e}") from None
        finally:
            await stream.close()

    async def ascore(self, prompt_ids: list[int], continuations: list[list[int]]):
        """Each continuation appended to the prompt and sent with `prompt_logprobs` (one request each,
        concurrently; the server's prefix cache shares the prompt where it can)."""
        self.require(base.SCORE, "scoring (prompt log-probabilities)")

        async def one(ids: list[int]):
            if not ids:
                return [], None
            extra = {"prompt_logprobs": 0, "return_token_ids": True}
            reply = await self._create(model=self.name, prompt=prompt_ids + ids, max_tokens=1, temperature=0.0,
                                       extra_body=extra)
            choice = reply.choices[0]
            rows = _extra(choice, "prompt_logprobs") or _extra(reply, "prompt_logprobs")
            if not rows or len(rows) != len(prompt_ids) + len(ids):
                raise BackendError(f"{self.describe()} returned no prompt log-probabilities for this prompt")
            lps = [float(_entry(rows[len(prompt_ids) + j], t)["logprob"]) for j, t in enumerate(ids)]
            prompt_tokens, cached = _usage(reply)
            return lps, Completion(choice.text, [], choice.finish_reason or "length", prompt_tokens, cached)

        results = await asyncio.gather(*(one(ids) for ids in continuations))
        return [lps for lps, _ in results], [c for _, c in results if c is not None]

    def stats(self) -> dict:
        """The server's counters, from its Prometheus `/metrics`: `prompt_tokens`, `cached_tokens`,
        `computed_tokens`, `generated_tokens`, `hit_rate` where the server counts them (kvql's also `ram_tokens`
        and `disk_tokens`: where its cached ones were, memory or its disk tier), and `metrics`:
        every sample by name (summed over labels). Read from kvql's `kvql_*_tokens_total`; vLLM's
        `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` and its prefix cache's
        `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens; the hit rate is hits per
        query token); SGLang's `sglang:prompt_tokens_total`, `sglang:cached_tokens_total` (SGLang counts
        them with `--enable-metrics`), else its `sglang:cache_hit_rate` gauge."""
        text = httpx.get(self.root + "/metrics", headers=self.headers, timeout=30).text
        metrics: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                metrics[sample.name] = metrics.get(sample.name, 0.0) + float(sample.value)
        prefix = {"kvql": "kvql_", "vllm": "vllm:", "sglang": "sglang:"}.get(self.kind, "")
        names = {"prompt_tokens": "prompt_tokens_total", "generated_tokens": "generation_tokens_total",
                 "cached_tokens": "prefix_cache_hits_total"}
        if self.kind == "kvql":
            names.update(generated_tokens="generated_tokens_total", cached_tokens="cached_tokens_total",
                         ram_tokens="prompt_tokens_from_ram_total", disk_tokens="prompt_tokens_from_disk_total")
        elif self.kind == "sglang":
            names.update(cached_tokens="cached_tokens_total")
        out = {k: metrics[prefix + v] for k, v in names.items() if prefix + v in metrics}
        if "prompt_tokens" in out and "cached_tokens" in out:
            out["computed_tokens"] = out["prompt_tokens"] - out["cached_tokens"]
            queries = metrics.get(prefix + "prefix_cache_queries_total", out["prompt_tokens"])
            out["hit_rate"] = out["cached_tokens"] / queries if queries else 0.0
        elif self.kind == "sglang" and "sglang:cache_hit_rate" in metrics:
            out["hit_rate"] = metrics["sglang:cache_hit_rate"]
        out["metrics"] = metrics
        return out

    def close(self) -> None:
        if isinstance(self.tokenizer, ServerTokenizer):
            self.tokenizer.close()

    def __repr__(self) -> str:
        mode = "token ids" if self.tokenizer is not None else "text prompts"
        return f"kvql.RemoteModel({self.name!r} at {self.base_url}, {self.kind}, {mode})"


def _tokenizer(given, served_name: str):
    """The tokenizer to keep prompts as ids with: `given` (an object, or a spec / directory / hub id to
    load), else one found under the served model's name, else None (text prompts; `given=False`: always)."""
    if given is False:
        return None
    if given is not None and not isinstance(given, str):
        return given
    from .loader import ModelLoadError, load_tokenizer

    spec = given or served_name
    try:
        return load_tokenizer(spec)
    except ModelLoadError:
        pass
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        if given is not None:
            raise ValueError(f"cannot load tokenizer {given!r}: {e}") from None
        return None


def _extra(obj, key: str):
    """A field the OpenAI schema does not name (vLLM's `token_ids`, `stop_reason`, `prompt_logprobs`)."""
    return (getattr(obj, "model_extra", None) or {}).get(key)


def _stop_reason(choice) -> str | None:
    """The stop string that ended a choice: vLLM's and kvql's `stop_reason`, SGLang's `matched_stop`."""
    for key in ("stop_reason", "matched_stop"):
        reason = _extra(choice, key)
        if isinstance(reason, str):
            return reason
    return None


def _usage(reply) -> tuple[int, int]:
    usage = reply.usage
    if usage is None:
        return 0, 0
    details = getattr(usage, "prompt_tokens_details", None)
    return usage.prompt_tokens or 0, (getattr(details, "cached_tokens", None) or 0) if details else 0


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"the server named a token {token!r}, not by id (return_tokens_as_token_ids)")
    return int(token[len("token_id:"):])


def _logprobs(lp) -> list[TokenLogprob] | None:
    if lp is None or lp.tokens is None:
        return None
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    return [TokenLogprob(_token_id(t), float(v), {_token_id(k): float(x) for k, x in (top or {}).items()})
            for t, v, top in zip(lp.tokens, lp.token_logprobs, tops)]


def _entry(row: dict, token: int) -> dict:
    """vLLM's prompt_logprobs row: {token id (a string in JSON): {"logprob", "rank", "decoded_token"}}."""
    entry = row.get(str(token), row.get(token)) if isinstance(row, dict) else None
    if entry is None:
        raise ValueError(f"the server's prompt log-probabilities lack token {token}")
    return entry if isinstance(entry, dict) else {"logprob": entry}
