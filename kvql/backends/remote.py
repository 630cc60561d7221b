"""`RemoteModel`: the `Model` API over an OpenAI-compatible server (a `kvql serve`, vLLM or SGLang).

`kvql.model("http://HOST:PORT/v1", name=...)` returns one. On first use it asks the server what it is
(`/v1/models`, then `/metrics` for kvql, `/version` for vLLM, `/get_model_info` for SGLang) and
so which constraints it can express; a constraint it cannot express raises ValueError before
anything is sent. Python callbacks (`mask`, `stop_fn`) cannot run remotely and are refused too.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import httpx

from ..completion import Completion
from .local import StreamChunk

# constraint option -> how each kind of server spells it in a completions request body
_SPELLINGS = {
    "kvql": {"regex": ("structured_outputs", "regex"), "choices": ("structured_outputs", "choice"),
             "json_schema": ("structured_outputs", "json"), "grammar": ("structured_outputs", "grammar")},
    "vllm": {"regex": ("structured_outputs", "regex"), "choices": ("structured_outputs", "choice"),
             "json_schema": ("structured_outputs", "json")},
    "sglang": {"regex": (None, "regex"), "json_schema": (None, "json_schema")},
    "openai": {},
}
_LOCAL_ONLY = ("mask", "stop_fn", "masked_logprobs", "ignore_eos")
_SALTED = ("kvql", "vllm")  # servers that partition their prefix cache by a request's `cache_salt`


class RemoteModel:
    def __init__(self, base_url: str, *, name: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        with httpx.Client(headers=self.headers, timeout=30) as client:
            try:
                models = client.get(self.base_url + "/models")
            except httpx.TransportError as e:
                raise ValueError(f"cannot reach {self.base_url}: {e}") from None
            if models.status_code != 200:
                raise ValueError(f"{self.base_url}/models answered {models.status_code}: {models.text[:200]}")
            served = [m["id"] for m in models.json().get("data", [])]
            if name is not None and name not in served:
                raise ValueError(f"{self.base_url} serves {served}, not {name!r}")
            if not served:
                raise ValueError(f"{self.base_url} serves no model")
            self.name = name or served[0]
            self.kind = self._detect(client)

    def _detect(self, client: httpx.Client) -> str:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        for kind, path, marker in (("kvql", "/metrics", "kvql_"), ("vllm", "/version", "version"),
                                   ("sglang", "/get_model_info", "model_path")):
            try:
                r = client.get(root + path)
            except httpx.TransportError:
                continue
            if r.status_code == 200 and marker in r.text:
                return kind
        return "openai"

    @property
    def supported_constraints(self) -> list[str]:
        return sorted(_SPELLINGS[self.kind])

    # -- requests --------------------------------------------------------------------------------
    def _body(self, prompt, *, max_tokens: int = 16, stop=None, temperature: float = 0.0, top_p: float = 1.0,
              n: int = 1, seed: int | None = None, logprobs: int | None = None, stream: bool = False,
              cache_salt: str | None = None, **constraints):
        for key in _LOCAL_ONLY:
            if constraints.pop(key, None):
                raise ValueError(f"{key} is a Python callback or engine option and cannot run on a remote server; "
                                 "use regex, choices, json_schema or grammar")
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "n": n, "stream": stream}
        if cache_salt is not None and self.kind not in _SALTED:
            raise ValueError(f"the {self.kind} server at {self.base_url} has no cache_salt: its prefix cache "
                             "cannot be partitioned per request")
        for key, value in (("stop", stop), ("seed", seed), ("logprobs", logprobs), ("cache_salt", cache_salt)):
            if value is not None:
                body[key] = value
        given = {k: v for k, v in constraints.items() if v is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of regex, choices, json_schema, grammar; got {sorted(given)}")
        for key, value in given.items():
            spelling = _SPELLINGS[self.kind].get(key)
            if key not in ("regex", "choices", "json_schema", "grammar"):
                raise TypeError(f"unknown option {key!r}")
            if spelling is None:
                raise ValueError(f"the {self.kind} server at {self.base_url} cannot express a {key} constraint "
                                 f"(it supports {self.supported_constraints or 'none'})")
            group, field = spelling
            if group is None:
                body[field] = value
            else:
                body.setdefault(group, {})[field] = value
        if self.kind == "kvql":
            body["return_token_ids"] = True
        return body

    async def _post(self, client: httpx.AsyncClient, body: dict) -> dict:
        r = await client.post(self.base_url + "/completions", json=body)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise ValueError(f"{self.kind} server answered {r.status_code}: {message}")
        return r.json()

    async def agenerate(self, prompts, **options) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        bodies = [self._body(p, **options) for p in prompts]  # every error before anything is sent
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout) as client:
            replies = await asyncio.gather(*(self._post(client, b) for b in bodies))
        out = []
        for index, reply in enumerate(replies):
            usage = reply.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            for sample, choice in enumerate(reply["choices"]):
                out.append(Completion(text=choice["text"], token_ids=choice.get("token_ids") or [],
                                      finish_reason=choice.get("finish_reason") or "length",
                                      prompt_tokens=usage.get("prompt_tokens", 0),
                                      cached_tokens=details.get("cached_tokens") or 0, index=index, sample=sample,
                                      stop_reason=reason if isinstance(reason := choice.get("stop_reason"), str)
                                      else None))
        return out

    def generate(self, prompts, **options) -> list[Completion]:
        return asyncio.run(self.agenerate(prompts, **options))

    async def stream(self, prompt, **options) -> AsyncIterator[StreamChunk]:
        body = self._body(prompt, stream=True, **options)
        texts: dict[int, str] = {}
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout) as client:
            async with client.stream("POST", self.base_url + "/completions", json=body) as r:
                if r.status_code != 200:
                    raise ValueError(f"{self.kind} server answered {r.status_code}: {(await r.aread())[:500]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:  # the request failed after the stream had started
                        error = event["error"]
                        raise ValueError(f"{self.kind} server: {error.get('message', error)}"
                                         if isinstance(error, dict) else f"{self.kind} server: {error}")
                    for choice in event["choices"]:
                        i, text = choice.get("index", 0), choice.get("text", "")
                        texts[i] = texts.get(i, "") + text
                        reason = choice.get("finish_reason")
                        done = Completion(texts[i], [], reason, 0, 0, sample=i) if reason else None
                        yield StreamChunk(i, text, -1, done)

    def stats(self) -> dict:
        """The server's counters (kvql servers only: parsed from `/metrics`)."""
        if self.kind != "kvql":
            return {}
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        text = httpx.get(root + "/metrics", headers=self.headers, timeout=30).text
        return {k.removeprefix("kvql_"): float(v) for k, v in
                (line.split() for line in text.splitlines() if line and not line.startswith("#"))}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"kvql.RemoteModel({self.name!r} at {self.base_url}, {self.kind})"
