"""`LocalBackend`: a local transformers model served by kvql's engine (radix KV cache + continuous batching);
the user's object is `kvql.Model` (`kvql.local_model`: this with LMQL's model methods)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import shutil
import time
from pathlib import Path
from typing import AsyncIterator, Sequence

import torch

from ..completion import Completion
from ..engine.engine import Engine
from ..engine.decode import healing, masks
from ..engine.model import model_runner, quantized
from ..engine.decode.grammar import Grammar, warm_up
from ..engine.decode.mask_worker import lowest_priority
from ..engine.cache.kv_pool import KVPool
from ..engine.request import RequestGroup, SamplingParams
from . import base, gguf_check, gguf_model
from .base import Backend, StreamChunk
from .cache_options import tier_directory
from .options import GenerateOptions
from .sizes import parse_bytes

log = logging.getLogger("kvql.cache")

LOCAL_OPTIONS = ("mask", "prompt_logprobs")  # beyond the contract's (GenerateOptions)
SNAPSHOT_SHARE = 4  # a model with recurrent layers keeps snapshots of their states in 1/4 of its cache budget


def default_budget(device: torch.device) -> int:
    """A quarter of free memory (at most 4 GiB) on CPU; half of free memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 4 * 2**30
    return min(available // 4, 4 * 2**30)


def default_disk_budget(directory) -> int:
    """20 GiB, at most half the free space of the disk that holds `directory` (0 when there is none, or the
    disk cannot tell)."""
    if directory is None:
        return 0
    path = Path(directory).expanduser()
    while not path.exists():
        path = path.parent
    try:
        return min(20 * 2**30, shutil.disk_usage(path).free // 2)
    except OSError:
        return 0


_COMPILERS = {"regex": "regex", "choices": "choices", "json_schema": "json_schema", "grammar": "lark"}


def engine_params(o: GenerateOptions, **by_hand) -> SamplingParams:
    """The engine's parameters for one prompt under the checked options `o`: every option whose `engine` rule
    (`kvql.backends.options.option`) is True, under its own name, and `by_hand`: what `LocalBackend._prepare`
    made of the others (the mask, the stop function, `stop_after`) and of its own options (`prompt_logprobs`)."""
    same = {name: getattr(o, name) for name, rule in GenerateOptions.rules("engine").items() if rule is True}
    return SamplingParams(**same, **by_hand)


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
        disk_cache = tier_directory(cache_dir, disk_cache, disk_budget)
        if not cache_save_interval >= 0:
            raise ValueError(f"cache_save_interval must be >= 0 seconds, got {cache_save_interval!r}")
        config = hf_model.config
        self.name = name
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.device = next(hf_model.parameters()).device
        text = config.get_text_config()
        # the model's own maximum: sliding-window layers read their window, the pool keeps every token
        self.context_length = int(getattr(text, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(text.vocab_size)
        budget = parse_bytes(cache_budget) if cache_budget is not None else default_budget(self.device)
        disk_bytes = parse_bytes(disk_budget) if disk_budget is not None else default_disk_budget(disk_cache)
        if disk_cache is not None and disk_budget is None and disk_bytes <= 0:  # a given 0 is the caller's error
            log.warning("disk cache not used: no free space on the disk of %s (the default disk_budget is half of "
                        "it); this model keeps its cache in memory only", disk_cache)
            disk_cache = None
        # quantized linear layers (kvql.engine.model.quantized) once the cheap checks passed, before the load check
        # below probes the model and the engine prepares its layers
        blocks = None
        if gguf is not None:  # a file given here directly is checked as a model spec's is (gguf_check.py)
            blocks = gguf_model.blocks(Path(gguf), gguf_check.check(gguf))
        self.quantization = None if weights is None else quantized.apply(hf_model, weights, blocks).line()
        if blocks is not None:
            gguf_model.fill(hf_model, blocks)  # what loader.load_hf left to the blocks and apply did not take
        geometry = model_runner.read_geometry(hf_model)  # UnsupportedModel (a ValueError) says why not
        slot_bytes = KVPool.slot_bytes(num_layers=len(geometry.layers), kv_heads=geometry.kv_heads,
                                       head_dim=geometry.head_dim, v_dim=geometry.v_dim, dtype=hf_model.dtype)
        # a model with recurrent layers: a quarter of the budget for snapshots of their states, at most a quarter
        # for the states of the requests running (fewer run at once where a quarter holds fewer)
        snapshot_bytes = budget // SNAPSHOT_SHARE if geometry.recurrent else 0
        if geometry.state_bytes:
            max_running = max(1, min(max_running, budget // SNAPSHOT_SHARE // geometry.state_bytes))
        running_bytes = max_running * geometry.state_bytes
        if budget - snapshot_bytes - running_bytes < slot_bytes:
            raise ValueError(f"cache_budget {budget} bytes holds no token ({slot_bytes} bytes per token)")
        self.engine = Engine(hf_model, tokenizer, num_slots=(budget - snapshot_bytes - running_bytes) // slot_bytes,
                             max_batch_tokens=max_batch_tokens, max_running=max_running, background=background,
                             geometry=geometry, speculate=speculate, disk_cache=disk_cache, disk_budget=disk_bytes,
                             save_interval=cache_save_interval, snapshot_budget=snapshot_bytes)
        self.eos_ids = frozenset(self.engine.eos_ids)
        # Grammars are immutable: the runs of a query (a map over many inputs) share one per constraint.
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, kind: str, value) -> Grammar:
        return getattr(Grammar, _COMPILERS[kind])(self.tokenizer, list(value) if kind == "choices" else value)

    def _grammar(self, kind: str, value) -> Grammar:
        if kind == "choices" and isinstance(value, (list, tuple)):
            value = tuple(value)
        try:
            hash(value)
        except TypeError:  # a schema given as a dict: compiled each time
            return self._compile(kind, value)
        return self._compiled(kind, value)

    # -- input checks (caller's thread, before anything is queued) -------------------------------
    def prompt_ids(self, prompts) -> list[list[int]]:
        """Each prompt (a string, or a list of token ids; one prompt or a list of them) as the token ids
        the engine is fed for it; ValueError / TypeError naming the prompt that is not one."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                self._check_readable(p, i)
                ids = self.tokenizer.encode(p)
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
            else:
                raise TypeError(f"prompt {i} is {type(p).__name__}; expected a string or a list of token ids")
            if not ids:
                raise ValueError(f"prompt {i} is empty (no tokens)")
            out.append(ids)
        return out

    @functools.cached_property
    def _chars_per_token(self) -> int:
        """The most characters one token can stand for: its vocabulary's longest entry (special tokens
        included; a byte-level entry's characters are bytes, each at least one character of text)."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return max(map(len, vocab), default=64)

    def _check_readable(self, text: str, i: int) -> None:
        """A text longer than the context could hold at the longest token is refused without tokenizing it
        (8 MB of text took ~3 s of both cores from every other client). Twice the bound: a normalizer may
        drop characters; the exact check follows the tokenizing in `_check_fits`."""
        bound = 2 * self.context_length * self._chars_per_token
        if len(text) > bound:
            raise ValueError(f"prompt {i} has {len(text)} characters, more than the model's context of "
                             f"{self.context_length} tokens can hold (at most {bound} characters); not tokenized")

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold, prompt and output together: the model's context, or fewer
        where the cache budget's slots are fewer."""
        return min(self.context_length, self.engine.pool.num_slots)

    def _check_fits(self, ids: list[int], params: SamplingParams, i: int) -> None:
        need = len(ids) + params.max_tokens
        if need > self.context_length:
            raise ValueError(f"prompt {i} has {len(ids)} tokens + max_tokens {params.max_tokens} = {need}, "
                             f"more than the model's context of {self.context_length} tokens")
        slots = self.engine.pool.num_slots
        if need > slots:
            per = self.engine.pool.bytes // slots
            raise ValueError(f"cache_budget too small: prompt {i} needs {need} tokens of KV "
                             f"({need * per} bytes) but the budget holds {slots} tokens ({slots * per} bytes)")

    def _grammar_end(self, o):
        """The request's stop_fn; with `ignore_eos` under a constraint, one that also ends the output at an
        end-of-sequence token (kept in it): the grammar allows one only at its end, after which it takes
        no token (as vLLM ends a request whose grammar is terminated)."""
        if not (o.ignore_eos and o.constraint is not None):
            return o.stop_fn
        eos, user = set(self.eos_ids), o.stop_fn
        return lambda ids, text: (bool(ids) and ids[-1] in eos) or (user is not None and user(ids, text))

    def _prepare(self, prompts, **options):
        """Check every option and compile the constraint; nothing is queued yet. -> (ids, params, salt): each
        prompt's token ids and the engine's parameters for it, one per prompt (with `heal`, each prompt backs up
        its own tokens; else they share one)."""
        o, extra = GenerateOptions.read(options, LOCAL_OPTIONS)
        mask, logit_bias = extra.get("mask"), o.logit_bias
        if mask is not None and not callable(mask):
            raise TypeError("mask must be a callable (generated token ids -> bool tensor or None)")
        if mask is not None and o.constraint is not None:
            raise ValueError(f"give at most one of mask, {', '.join(base.CONSTRAINTS)}; got mask and {o.constraint[0]}")
        if o.heal and (mask is not None or o.grammar_prefix or logit_bias):
            raise ValueError("heal=True does not combine with mask=, logit_bias= or grammar_prefix= (they read "
                             "the generated ids, which then start inside the prompt)")
        all_ids = self.prompt_ids(prompts)
        if o.constraint is not None and not o.heal:
            mask = self._grammar(*o.constraint).mask_fn()
        if o.grammar_prefix:
            if mask is None or len(all_ids) != 1 or o.grammar_prefix > len(all_ids[0]):
                raise ValueError("grammar_prefix needs a constraint, one prompt, and at most the prompt's tokens")
            mask = masks.continued(mask, all_ids[0][len(all_ids[0]) - o.grammar_prefix:])
        mask, added = masks.logit_bias(logit_bias, self.vocab_size, mask)
        if not o.heal:
            mask = masks.no_end_before(mask, o.min_tokens, self.eos_ids, self.vocab_size)
        params = engine_params(o, stop_after=o.min_tokens, mask=mask, stop_fn=self._grammar_end(o),
                               prompt_logprobs=extra.get("prompt_logprobs"), logit_bias=added)
        if o.heal:
            all_ids, per_prompt = self._heal(all_ids, params, o)
        else:
            per_prompt = [params] * len(all_ids)
        for i, (ids, p) in enumerate(zip(all_ids, per_prompt)):
            self._check_fits(ids, p, i)
        return all_ids, per_prompt, o.cache_salt

    def _heal(self, all_ids, params: SamplingParams, o: GenerateOptions):
        """heal=True: each prompt's healed ids and parameters (`kvql.engine.decode.healing`); a prompt with
        nothing to heal keeps its own, with the constraint as given."""
        h = healing.healer(self.tokenizer)
        kind, value = o.constraint or (None, None)
        min_tokens = o.min_tokens
        # compiled whether or not a prompt heals: an invalid or empty constraint fails here, named as given
        # (inside the healed grammar an empty one would only fail after the backed-up text is generated)
        plain = None if kind is None else self._grammar(kind, value) if kind != "choices" else \
            self._grammar("grammar", healing.canonical_choices(self.tokenizer, value))  # as healed choices are
        out_ids, out_params = [], []
        for ids in all_ids:
            heal = h.heal(ids, params.max_tokens, min_tokens, params.stop_fn)
            if heal is None:
                mask = plain.mask_fn() if plain is not None else None
                mask = masks.no_end_before(mask, min_tokens, self.eos_ids, self.vocab_size)
                out_ids.append(ids)
                out_params.append(dataclasses.replace(params, mask=mask))
                continue
            ids = ids[:-heal.tokens]
            mask = self._grammar("grammar", heal.constraint(self.tokenizer, kind, value)).mask_fn() if kind else None
            out_ids.append(ids)
            out_params.append(heal.apply(params, mask, self.eos_ids, self.vocab_size, self.context_length, len(ids)))
        return out_ids, out_params

    def _enqueue(self, prepared, on_update=None) -> list[RequestGroup]:
        all_ids, params, cache_salt = prepared
        return [self.engine.submit(ids, params[i], index=i, on_update=on_update, cache_salt=cache_salt)
                for i, ids in enumerate(all_ids)]

    def _submit(self, prompts, on_update=None, **options) -> list[RequestGroup]:
        return self._enqueue(self._prepare(prompts, **options), on_update)

    async def submit(self, prompts, on_update=None, **options) -> list[RequestGroup]:
        """Queue the prompts' requests (the options of `agenerate`) and return their handles, one per
        prompt, without waiting for them: `collect(groups)` waits, `cancel(group)` cancels.
        `on_update(sample, text, token_id, completion)` is called on the engine thread after each step of
        a request. A constraint to compile (ms, at worst the sandbox's time limit) or much to read (over
        `INLINE_CHARS` characters of text, `INLINE_PROMPTS` prompts or logit biases: a megabyte of text takes
        ~0.5 s to tokenize) is prepared on a worker thread, so it never holds up the event loop that serves
        other requests; nothing is queued if the caller is cancelled meanwhile."""
        if (options.get("heal") or any(options.get(k) is not None for k in base.CONSTRAINTS)
                or _much_text(prompts) or len(options.get("logit_bias") or ()) > INLINE_PROMPTS):
            # on threads of its own: the event loop's default pool also runs /health's check and other clients' work
            prepared = await asyncio.get_running_loop().run_in_executor(
                _PREPARING, functools.partial(self._prepare, prompts, **options))
        else:
            prepared = self._prepare(prompts, **options)
        return self._enqueue(prepared, on_update)

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
            (c,) = await self.agenerate([prompt_ids], max_tokens=len(ids), mask=masks.forcing(ids, self.vocab_size),
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
        import copy

        from ..engine.model import cpu_linear, fused_layers

        plain = copy.deepcopy(self.hf_model)
        fused_layers.restore(plain)
        cpu_linear.restore(plain)
        plain.set_attn_implementation("sdpa")
        return plain

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


# as many as sandbox children; at the lowest priority, as the mask workers: a megabyte to tokenize takes a core
# for ~0.5 s, which other clients' steps get first
_PREPARING = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kvql-prepare", initializer=lowest_priority)
INLINE_CHARS = 16 * 1024  # text `submit` tokenizes on the caller's event loop, at most; more goes to a thread
INLINE_PROMPTS = 64


def _much_text(prompts) -> bool:
    if isinstance(prompts, str):
        return len(prompts) > INLINE_CHARS
    if not isinstance(prompts, Sequence):
        return False
    return len(prompts) > INLINE_PROMPTS or sum(len(p) for p in prompts if isinstance(p, str)) > INLINE_CHARS


def _prepared_in(completions: list[Completion], seconds: float) -> list[Completion]:
    """`completions`, each told how long its call took before queueing them (`Completion.prepare_seconds`)."""
    for c in completions:
        c.prepare_seconds = seconds
    return completions
