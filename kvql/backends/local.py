"""`LocalBackend`: a local transformers model served by kvql's engine (radix KV cache + continuous batching);
the user's object is `kvql.Model` (`kvql.local_model`: this with LMQL's model methods)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from pathlib import Path
from typing import AsyncIterator, Sequence

from ..completion import Completion
from ..engine import Engine, RequestGroup, RequestSpec, forcing, plain_copy, warm_up
from . import base, gguf_check, gguf_model
from .base import Backend, StreamChunk
from .cache_options import disk_tier
from .options import GenerateOptions
from .sizes import parse_bytes

LOCAL_OPTIONS = ("mask", "prompt_logprobs")  # beyond the contract's (GenerateOptions)


def request_spec(o: GenerateOptions, extra: dict | None = None) -> RequestSpec:
    """The engine's request for the checked options `o` (and `extra`: `LOCAL_OPTIONS`): every option whose `engine`
    rule (`kvql.backends.options.option`) is True as a `SamplingParams` field of its own name; the others are
    the spec's own fields, which the engine makes into masks, healing and stop functions (`RequestSpec`)."""
    extra = extra or {}
    params = {name: getattr(o, name) for name, rule in GenerateOptions.rules("engine").items() if rule is True}
    return RequestSpec(params | {"prompt_logprobs": extra.get("prompt_logprobs")}, constraint=o.constraint,
                       mask=extra.get("mask"), grammar_prefix=o.grammar_prefix, logit_bias=o.logit_bias,
                       min_tokens=o.min_tokens, stop_fn=o.stop_fn, heal=o.heal, cache_salt=o.cache_salt)


class LocalBackend(Backend):
    """A causal LM behind kvql's engine: the local implementation of the backend contract
    (`kvql.backends.base`), with every capability. Thread-safe: calls from many threads or tasks share
    batches and the cache. LMQL's model methods come on top, in `kvql.Model` (`kvql.local_model`).

    Beyond the contract it takes `mask` (a Python function of the generated ids -> allowed tokens) and
    `prompt_logprobs=k` (every prompt token's log-probability and top k, vLLM's option). A server drives it
    through `submit`, `collect`, `cancel` and `stream`'s hooks.

    `disk_cache` (also spelled `cache_dir`): a second cache tier in that directory, `disk_budget` bytes, that keeps
    the cache across restarts too (kvql.engine.cache.disk_tier): the cache starts as what it holds for this model;
    what only memory holds is written there on `close()` / exit, every `cache_save_interval` seconds when idle
    (0: only on close) and on `save_cache()`. `disk_budget` needs it (ValueError). A start never fails over the
    tier: without a `disk_budget`, a disk with no free space leaves the model memory-only (one WARNING line, logger
    `kvql.cache`, naming the directory), and so does a directory that cannot be used (kvql.engine.cache.persistence).

    `weights` ("gguf" with `gguf` the model's GGUF file, "int8", "int4"; None: as loaded): the linear layers on
    quantized weights (kvql.engine.model.quantized), done to `hf_model` in place before the engine prepares it;
    `quantization` says what was done (one line), None without."""

    capabilities = frozenset({base.TOKEN_IDS, base.SCORE, base.LOGPROBS, base.MASKED_LOGPROBS, base.MIN_TOKENS,
                              base.STOP_FN, base.SAMPLING, base.CACHE_SALT, base.TOKEN_GRAMMAR, base.HEAL,
                              *base.CONSTRAINTS})

    def __init__(self, hf_model, tokenizer, *, name: str = "model", cache_budget: int | str | None = None,
                 max_batch_tokens: int = 1024, max_running: int = 64, background: bool = True,
                 cache_dir=None, cache_save_interval: float = 300.0, speculate: bool = True,
                 disk_cache=None, disk_budget: int | str | None = None, weights: str | None = None, gguf=None):
        disk_cache, disk_bytes = disk_tier(cache_dir, disk_cache, disk_budget)
        if not cache_save_interval >= 0:
            raise ValueError(f"cache_save_interval must be >= 0 seconds, got {cache_save_interval!r}")
        self.name = name
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        # a file given here directly is checked as a model spec's is (gguf_check.py)
        blocks = gguf_model.blocks(Path(gguf), gguf_check.check(gguf)) if gguf is not None else None
        self.engine = Engine(hf_model, tokenizer, max_batch_tokens=max_batch_tokens, max_running=max_running,
                             cache_budget=parse_bytes(cache_budget) if cache_budget is not None else None,
                             background=background, speculate=speculate, disk_cache=disk_cache,
                             disk_budget=disk_bytes, save_interval=cache_save_interval, weights=weights, gguf=blocks)
        self.quantization, self.device = self.engine.quantization, self.engine.device
        self.eos_ids = frozenset(self.engine.eos_ids)
        self.vocab_size = self.engine.requests.vocab_size

    @property
    def context_length(self) -> int:
        """The most tokens one request may hold (the model's own maximum; a server may lower it)."""
        return self.engine.requests.context_length

    @context_length.setter
    def context_length(self, tokens: int) -> None:
        self.engine.requests.context_length = tokens

    # -- requests (built on the caller's thread or, where slow, the engine's builder threads) ------------------
    def prompt_ids(self, prompts) -> list[list[int]]:
        """Each prompt (a string, or a list of token ids; one prompt or a list of them) as the token ids
        the engine is fed for it; ValueError / TypeError naming the prompt that is not one."""
        return self.engine.requests.prompt_ids(prompts)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold, prompt and output together: the model's context, or fewer
        where the cache budget's slots are fewer."""
        return self.engine.requests.max_request_tokens

    def _submit(self, prompts, on_update=None, **options) -> list[RequestGroup]:
        built = self.engine.requests.build(prompts, request_spec(*GenerateOptions.read(options, LOCAL_OPTIONS)))
        return self.engine.submit_all(built, on_update)

    async def submit(self, prompts, on_update=None, **options) -> list[RequestGroup]:
        """Queue the prompts' requests (the options of `agenerate`) and return their handles, one per
        prompt, without waiting for them: `collect(groups)` waits, `cancel(group)` cancels.
        `on_update(sample, text, token_id, completion)` is called on the engine thread after each step of
        a request. What is slow to build (a constraint to compile, much text, a long logit bias) is built off the
        event loop (`kvql.engine.request_builder`); nothing is queued if the caller is cancelled meanwhile."""
        built = await self.engine.requests.abuild(
            prompts, lambda: request_spec(*GenerateOptions.read(options, LOCAL_OPTIONS)),
            bias_entries=len(options.get("logit_bias") or ()))  # (the options are read off the loop with it)
        return self.engine.submit_all(built, on_update)

    # -- public API ------------------------------------------------------------------------------
    # Options of generate / agenerate / stream: those of the backend contract (kvql.backends.options; unknown
    # ones raise TypeError), `mask` (a fn of the generated ids -> bool tensor) as a fifth kind of
    # constraint, and `prompt_logprobs` (vLLM's).
    # Constraints are compiled by kvql.engine.decode.grammar. cache_salt (a string): requests share cached
    # prefixes only with requests of the same salt, so tenants cannot probe each other's prompts through
    # cached_tokens or timing.
    def complete(self, prompts, *, progress=False, **options) -> list[Completion]:
        """`generate`, always synchronous: the list of completions, also inside an event loop.
        `progress=True`: a tqdm bar of completions done (see `base.progress_bar`)."""
        started = time.perf_counter()
        groups = self._submit(prompts, **options)
        prepared = time.perf_counter() - started
        bar = base.progress_bar(progress, sum(g.params.n for g in groups))
        n_of = {g.future: g.params.n for g in groups}
        if not self.engine.background:
            self.engine.run_until_idle()
        try:
            for f in concurrent.futures.as_completed(n_of):  # wait for all, even if one fails
                if bar is not None:
                    bar.update(n_of[f])
        except BaseException:  # interrupted (e.g. Ctrl-C): free the engine from this call's work
            for g in groups:
                self.engine.cancel(g)
            raise
        finally:
            if bar is not None:
                bar.close()
        return _prepared_in([c for g in groups for c in g.future.result()], prepared)

    async def agenerate(self, prompts, *, progress=False, **options) -> list[Completion]:
        """`generate` for asyncio; cancelling the awaiting task cancels the requests."""
        started = time.perf_counter()
        groups = await self.submit(prompts, **options)
        prepared = time.perf_counter() - started
        return _prepared_in(await self.collect(groups, base.progress_bar(progress, sum(g.params.n for g in groups))),
                            prepared)

    def cancel(self, group: RequestGroup) -> None:
        """Cancel a submitted request (its samples end as cancelled; a no-op once it finished)."""
        self.engine.cancel(group)

    async def collect(self, groups: list[RequestGroup], bar=None) -> list[Completion]:
        """The completions of submitted `groups`, prompt by prompt; if the caller is cancelled or one
        group fails, every group is cancelled. `bar` (a tqdm bar, closed here) counts them."""
        async def done(g: RequestGroup) -> list[Completion]:
            try:
                return await asyncio.wrap_future(g.future)
            finally:
                if bar is not None:
                    bar.update(g.params.n)
        try:
            results = await asyncio.gather(*(done(g) for g in groups))
        except BaseException:
            for g in groups:
                self.engine.cancel(g)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [c for r in results for c in r]

    async def stream(self, prompt, *, on_token=None, on_group=None, **options) -> AsyncIterator[StreamChunk]:
        """Yield a `StreamChunk` per generated token of one prompt (all `n` samples interleaved).
        Leaving the loop early cancels the request. A server's hooks: `on_token()` after each token (on
        the engine thread) and `on_group(group)` once the request is queued (its handle, as `submit`'s)."""
        if not isinstance(prompt, str) and not (isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt)):
            raise TypeError("stream() takes one prompt: a string or a list of token ids")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        started = time.perf_counter()

        def on_update(sample, text, token, completion):
            if on_token is not None:
                on_token()
            loop.call_soon_threadsafe(queue.put_nowait, StreamChunk(sample, text, token, completion))

        (group,) = await self.submit(prompt, on_update, **options)
        prepared = time.perf_counter() - started
        if on_group is not None:
            on_group(group)
        group.future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (chunk := await queue.get()) is not None:
                if chunk.completion is not None:
                    chunk.completion.prepare_seconds = prepared
                yield chunk
            group.future.result()  # raise the request's error, if any
        finally:
            self.engine.cancel(group)  # no-op once it finished

    async def ascore(self, prompt_ids: list[int], continuations: list[list[int]]):
        """Each continuation forced token by token after the prompt (one batch: the prompt is computed
        once, then served from the cache); log-probabilities of the raw distribution."""
        async def one(ids: list[int]):
            if not ids:
                return [], None
            (c,) = await self.agenerate([prompt_ids], max_tokens=len(ids), mask=forcing(ids, self.vocab_size),
                                        logprobs=0, ignore_eos=True)
            return [e.logprob for e in c.logprobs], c

        results = await asyncio.gather(*(one(ids) for ids in continuations))
        return [lps for lps, _ in results], [c for _, c in results if c is not None]

    def warm_up(self) -> None:
        """Do now what the first constrained request would pay (~1 s: llguidance's view of the tokenizer);
        a server calls it at start."""
        warm_up(self.tokenizer)

    @property
    def dtype(self):
        return self.hf_model.dtype

    @property
    def cache_slots(self) -> int:
        """Tokens the KV cache holds."""
        return self.engine.pool.num_slots

    @property
    def cache_bytes(self) -> int:
        return self.engine.pool.bytes

    @property
    def own_forward(self) -> str | None:
        """Why the engine runs this model on its own forward, one request per forward (exact, slower than the
        ragged path: docs/models.md), or None where it runs on the ragged path."""
        return self.engine.runner.geometry.own

    def plain_copy(self):
        """A copy of the transformers model as transformers runs it: kvql's fused modules and linear layers swapped
        back, SDPA attention. What a baseline beside kvql runs (`kvql bench`); the engine's model is untouched."""
        return plain_copy(self.hf_model)

    def stats(self) -> dict:
        """Engine counters: prompt/cached/computed tokens, hit rate, cache bytes and budget, evictions, ...
        Where the cached prompt tokens came from: `ram_tokens` (KV found in the pool) + `disk_tokens` (KV read back
        from the disk tier) = `cached_tokens`; with a tier, its `tier_*` counters too (`Engine.stats`)."""
        s = self.engine.stats()
        s["ram_tokens"] = s["cached_tokens"] - s["disk_tokens"]
        return s

    def clear_cache(self) -> int:
        """Evict every cached token not in use by a running request; returns how many were freed."""
        return self.engine.clear_cache()

    def check_integrity(self, full: bool = True) -> None:
        """Assert the engine's invariants; `full=False` is the cheap slot count only."""
        self.engine.check_integrity(full)

    def save_cache(self) -> dict:
        """Write what only memory holds to the disk tier now (as `close()` does; `{tokens, tier_bytes}`): a restart
        then finds the whole cache. ValueError without `disk_cache`."""
        return self.engine.save_cache()

    def close(self) -> None:
        """Stop the engine (pending requests are cancelled); with a disk tier, write what only memory holds to it."""
        self.engine.close()

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def describe(self) -> str:
        return f"the local model {self.name!r}"

    def __repr__(self) -> str:
        return f"kvql.Model({self.name!r}, device={self.device}, cache_slots={self.engine.pool.num_slots})"


def _prepared_in(completions: list[Completion], seconds: float) -> list[Completion]:
    """`completions`, each told how long its call took before queueing them (`Completion.prepare_seconds`)."""
    for c in completions:
        c.prepare_seconds = seconds
    return completions
