"""Requests: sampling parameters, one sequence's state in the engine, and the group of `n` samples."""

from __future__ import annotations

import concurrent.futures
import enum
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from ..completion import Completion, TokenLogprob
from .detokenizer import Detokenizer
from .segment import Carry

MaskFn = Callable[[list[int]], "torch.Tensor | None"]
"""Called with a sequence's generated token ids so far; returns a bool tensor `[vocab]` of allowed
next tokens, or None for no restriction. Samples of one prompt share the function, so it must depend
only on the ids it is given. If it raises, that request fails alone.

A mask with a true attribute `jump_forward` (`Grammar.mask_fn()`'s have one) opts in to jump-forward
(engine.py): it is then asked about a history as soon as that history exists, before the forward
of its last token, so a token it forces is appended without a decode step of its own; a mask
without it is asked only when the logits for that history are there."""


StopFn = Callable[[list[int], str], bool]
"""Called after each generated token with the ids and text so far; True ends the sequence ("stop").
The text is not cut: the caller decides where its value ends."""


@dataclass(frozen=True)
class SamplingParams:
    """One prompt's request parameters, made by the engine's caller from options it has checked (kvql's local
    backend translates the generation options of its contract, where each option is declared, defaulted and
    checked). The engine checks only what keeps one request from failing others (`__post_init__`); a value
    that makes sampling fail (a bad mask, a NaN temperature) fails its own request, inside the request's
    error boundary (outputs.py)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                   # sample among the k most likely tokens only; 0: all
    min_p: float = 0.0               # drop tokens below min_p times the top token's probability (vLLM's); 0: off
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (CTRL / HF semantics)
    frequency_penalty: float = 0.0   # subtracted per earlier occurrence in the output (OpenAI / vLLM semantics)
    presence_penalty: float = 0.0    # subtracted once if the token occurred in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value) added to its logit (OpenAI / vLLM)
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_after: int = 0  # stop strings count only where they end after the text of this many tokens (min_tokens)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprob of every prompt token (and its k best alternatives), as vLLM
    mask: MaskFn | None = None
    stop_fn: StopFn | None = None
    masked_logprobs: bool = False  # logprobs of the masked distribution (beam search) instead of the raw one
    ignore_eos: bool = False
    healing: object = None  # token healing (kvql.engine.decode.healing.Healing): its text starts the output, not `text`

    def __post_init__(self):
        """The values the engine thread uses outside a request's error boundary (making its `Request`,
        scheduling it, scoring its prompt in a step's bookkeeping) must be of the kind it uses: a wrong one
        would fail every request of the step. Ranges and meaning are the caller's to check."""
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {k!r}")  # topk over the row
        kinds = {"max_tokens": isinstance(self.max_tokens, int), "n": isinstance(self.n, int),
                 "temperature": isinstance(self.temperature, (int, float)),
                 "seed": self.seed is None or isinstance(self.seed, int),
                 "stop": all(isinstance(s, str) for s in self.stop)}
        if not all(kinds.values()):
            raise TypeError(f"SamplingParams: {', '.join(k for k, ok in kinds.items() if not ok)} of the wrong kind")
        # the logit bias as the sampler adds it, built once: a bias over the whole vocabulary then costs one
        # vector add per step, not a Python pass over its pairs
        bias = None
        if self.logit_bias:
            tokens, values = zip(*self.logit_bias)
            bias = (torch.tensor(tokens, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        object.__setattr__(self, "bias_tensors", bias)


@dataclass(frozen=True)
class RequestSpec:
    """What a caller asks for its prompts, checked by the caller (kvql's backend contract: `GenerateOptions`); the
    engine makes each prompt's `SamplingParams` of it (request_builder.py). `params`: SamplingParams fields taken
    as they are; `constraint`: `(kind, value)`, kind "regex", "choices", "json_schema" or "grammar" (Lark),
    compiled into the mask; `mask`: a function of the generated ids instead (`MaskFn`); `grammar_prefix`: the
    constraint continued from the prompt's last that many tokens; `logit_bias`: {token id: value}, -100 / 100 into
    the mask, the rest added to the logits (`decode.masks`); `min_tokens`: no end of sequence before that many
    tokens, stop strings only after their text; `stop_fn`: (ids, text) -> True ends a sample; `heal`: each prompt
    backed up to a clean token boundary (`decode.healing`); `cache_salt`: requests share cached prefixes only
    with requests of the same salt."""

    params: dict
    constraint: tuple | None = None
    mask: MaskFn | None = None
    grammar_prefix: int = 0
    logit_bias: dict | None = None
    min_tokens: int = 0
    stop_fn: StopFn | None = None
    heal: bool = False
    cache_salt: str | None = None


class RequestGroup:
    """The `n` samples of one prompt; `future` resolves to their completions, in sample order.

    `on_update(sample, text_delta, token_id, completion)` is called on the engine thread after each
    generated token (`completion` set when that sample finished).

    The future is marked running at creation, so no consumer can cancel it behind the engine's back
    (`asyncio.wrap_future` tries to on task cancellation); cancellation goes through
    `Engine.cancel` and is applied between steps. `closed` is set, by the engine thread only, just
    before the future is resolved.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, index: int, on_update=None,
                 salt: str | None = None):
        self.prompt_ids = prompt_ids
        self.params = params
        self.index = index
        self.on_update = on_update
        self.salt = salt
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()
        self.completions: list[Completion | None] = [None] * params.n
        self.requests: list[Request] = []
        self.cancelled = False
        self.closed = False

    def close(self) -> None:
        self.closed = True


_ids = itertools.count()


class State(enum.Enum):
    """Where a request is in its life; only `memory.Memory` moves it (see the diagram there)."""

    WAITING = "waiting"      # queued, holds no memory
    RUNNING = "running"      # admitted: holds `kv_slots` and a lock on `node`
    PREEMPTED = "preempted"  # evicted from the batch under memory pressure: queued again, holds nothing
    FINISHED = "finished"    # done (stop or length); holds nothing
    FAILED = "failed"        # its own error, or its batch's; holds nothing
    CANCELLED = "cancelled"  # by the caller or at close; holds nothing


class Request:
    """One sequence. Memory fields (`state`, `kv_slots`, `node`, `tree_len`, `num_computed`) are
    written only by `memory.Memory`, whose docstring states what they mean."""

    def __init__(self, group: RequestGroup, sample: int, tokenizer, device):
        self.rid = next(_ids)
        self.group = group
        self.sample = sample
        self.params = group.params
        self.prompt_ids = group.prompt_ids
        self.salt = group.salt
        self.output_ids: list[int] = []
        # Jump-forward (engine.py): tokens the constraint forced, computed but not yet appended to
        # `output_ids` (only for requests that want logprobs, whose entries need the forward's rows);
        # they are part of `tokens`, so the scheduler computes them as one chunk
        self.forced: list[int] = []
        self.forced_tokens = 0  # how many tokens jump-forward appended without a decode step (an ending EOS too)
        self.forced_at: list[int] = []  # their indices in `output_ids` (what a trace needs to show them apart)
        self.next_allowed: tuple[int, object] | None = None  # (len(output_ids), mask result) already computed
        # a mask asked of the mask worker and not taken yet: (history, future) (decode/mask_worker.py)
        self.mask_pending: tuple[list[int], object] | None = None
        self.mask_seconds = 0.0  # its mask's time per call, a running estimate (decode/mask_worker.py)
        self.vocab_size: int | None = None  # the model's logits width, from the first sampled row
        self.draft = None  # speculative decoding's state for this request (drafts.Draft), made at its first draft
        self.drafted_tokens = 0  # tokens drafted for it and verified
        self.accepted_at: list[int] = []  # indices in `output_ids` of drafted tokens it accepted
        # its recurrent state (segment.py); a repeat of its prompt resumes after all but its last token
        self.carry = Carry(salt=self.salt, marks={len(self.prompt_ids) - 1})
        self.state = State.WAITING
        self.kv_slots = torch.empty(0, dtype=torch.long, device=device)
        self.tree_len = 0
        self.num_computed = 0
        self.node = None
        self.cached_tokens: int | None = None  # set at first admission
        self.disk_tokens = 0  # of those, read back from the disk tier for this request (memory.py)
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        # entry i: logprob of prompt token i given tokens < i, filled as the prompt is computed (shared by forks)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if self.params.prompt_logprobs is not None else None)
        healed = self.params.healing.text if self.params.healing is not None else ""
        self.detok = Detokenizer(tokenizer, list(self.params.stop), skip=healed, after=self.params.stop_after)
        self.finish_reason: str | None = None
        self.forked = sample > 0
        seed = self.params.seed
        self.generator = None
        if self.params.temperature > 0:
            self.generator = torch.Generator(device="cpu")
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed((seed * 1_000_003 + sample) % (2**63))

    @property
    def tokens(self) -> list[int]:
        """Every token the model sees: prompt, output, then pending forced tokens."""
        return self.prompt_ids + self.output_ids + self.forced

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.forced)

    @property
    def replay_from(self) -> int | None:
        """The position whose logits predict the first pending forced token (None when none is
        pending): from there on the forward returns every row, and nothing is served from the cache."""
        return len(self.prompt_ids) + len(self.output_ids) - 1 if self.forced else None

    @property
    def needs_prompt_logits(self) -> bool:
        """True while some prompt logprob is missing: the logits of every computed prompt token are wanted."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def max_cached(self) -> int:
        """How many leading tokens may be served from the cache. Invariant 3: never the last token, so
        its logits exist. A request still collecting prompt logprobs computes every position whose
        logits it lacks (cached positions have none): at most the ones it already scored; so does one
        with pending forced tokens (`replay_from`)."""
        limit = self.num_tokens - 1
        if self.needs_prompt_logits:
            limit = len(self.prompt_logprobs) - 1
        if self.forced:
            limit = min(limit, self.replay_from)
        return limit

    def completion(self) -> Completion:
        c = Completion(
            text=self.detok.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens or 0,
            disk_tokens=min(self.disk_tokens, self.cached_tokens or 0),
            index=self.group.index,
            sample=self.sample,
            logprobs=self.logprobs,
            stop_reason=self.detok.stop_string,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            forced=[i for i in self.forced_at if i < len(self.output_ids)],
            drafted_tokens=self.drafted_tokens,
            accepted=list(self.accepted_at),
        )
        return c if self.params.healing is None else self.params.healing.finish(c)
