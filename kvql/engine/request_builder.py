"""A caller's request made into the engine's: prompts into token ids, a `RequestSpec` into each prompt's
`SamplingParams` (a constraint compiled into its mask, healing, the logit bias, min tokens), checked against the
context and the pool before anything is queued (`RequestBuilder.build`; `Engine.submit_all` queues the result).

Contract: `build` raises ValueError / TypeError naming the prompt or the option that is wrong and queues nothing;
a constraint that accepts nothing fails here, named as given. What is slow (a constraint to compile: ms, at worst
the grammar sandbox's time limit; much text to tokenize: ~0.5 s a megabyte; a long logit bias to read and check:
~20 ms for 49k entries) `abuild` does on a thread of its own at the lowest CPU priority, so an event loop that
serves other clients is never held up and the engine's forwards take the cores first. Grammars are immutable: the
runs of a query share one per constraint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from .decode import healing, masks
from .decode.grammar import Grammar
from .decode.mask_worker import lowest_priority
from .request import RequestSpec, SamplingParams

INLINE_CHARS = 16 * 1024  # text `abuild` tokenizes on the caller's event loop, at most; more goes to a thread
INLINE_PROMPTS = 64  # prompts or logit-bias entries, likewise
# as many as the grammar sandbox's children
_BUILDING = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kvql-prepare", initializer=lowest_priority)
_COMPILERS = {"regex": "regex", "choices": "choices", "json_schema": "json_schema", "grammar": "lark"}


@dataclass(frozen=True)
class Built:
    """A request ready to queue: each prompt's token ids and parameters, and the salt they share."""

    ids: list[list[int]]
    params: list[SamplingParams]
    cache_salt: str | None


class RequestBuilder:
    """Builds requests for one model: its tokenizer, end-of-sequence ids, vocabulary and context, and the KV pool
    a request must fit in (`num_slots`, `bytes`)."""

    def __init__(self, tokenizer, eos_ids, vocab_size: int, context_length: int, pool):
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, frozenset(eos_ids), vocab_size
        self.context_length, self.pool = context_length, pool
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold, prompt and output together."""
        return min(self.context_length, self.pool.num_slots)

    def prompt_ids(self, prompts) -> list[list[int]]:
        """Each prompt (a string, or a list of token ids; one prompt or a list of them) as the token ids the
        engine is fed for it; ValueError / TypeError naming the prompt that is not one."""
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
        (a text of many megabytes takes seconds of a core). Twice the bound: a normalizer may drop characters;
        the exact check follows the tokenizing (`_check_fits`)."""
        bound = 2 * self.context_length * self._chars_per_token
        if len(text) > bound:
            raise ValueError(f"prompt {i} has {len(text)} characters, more than the model's context of "
                             f"{self.context_length} tokens can hold (at most {bound} characters); not tokenized")

    def _check_fits(self, ids: list[int], params: SamplingParams, i: int) -> None:
        need = len(ids) + params.max_tokens
        if need > self.context_length:
            raise ValueError(f"prompt {i} has {len(ids)} tokens + max_tokens {params.max_tokens} = {need}, "
                             f"more than the model's context of {self.context_length} tokens")
        slots = self.pool.num_slots
        if need > slots:
            per = self.pool.bytes // slots
            raise ValueError(f"cache_budget too small: prompt {i} needs {need} tokens of KV "
                             f"({need * per} bytes) but the budget holds {slots} tokens ({slots * per} bytes)")

    def _compile(self, kind: str, value) -> Grammar:
        return getattr(Grammar, _COMPILERS[kind])(self.tokenizer, list(value) if kind == "choices" else value)

    def grammar(self, kind: str, value) -> Grammar:
        """The constraint `(kind, value)` compiled (kind: regex, choices, json_schema, grammar), shared."""
        if kind == "choices" and isinstance(value, (list, tuple)):
            value = tuple(value)
        try:
            hash(value)
        except TypeError:  # a schema given as a dict: compiled each time
            return self._compile(kind, value)
        return self._compiled(kind, value)

    def _stop_fn(self, spec: RequestSpec, ignore_eos: bool):
        """The request's stop function; with `ignore_eos` under a constraint, one that also ends the output at an
        end-of-sequence token (kept in it): the grammar allows one only at its end, after which it takes no token
        (as vLLM ends a request whose grammar is terminated)."""
        if not (ignore_eos and spec.constraint is not None):
            return spec.stop_fn
        eos, user = self.eos_ids, spec.stop_fn
        return lambda ids, text: (bool(ids) and ids[-1] in eos) or (user is not None and user(ids, text))

    def build(self, prompts, spec: RequestSpec) -> Built:
        """The request of `prompts` under `spec` (module doc); nothing is queued."""
        mask = spec.mask
        if mask is not None and not callable(mask):
            raise TypeError("mask must be a callable (generated token ids -> bool tensor or None)")
        if mask is not None and spec.constraint is not None:
            raise ValueError(f"give at most one of mask and a constraint; got mask and {spec.constraint[0]}")
        if spec.heal and (mask is not None or spec.grammar_prefix or spec.logit_bias):
            raise ValueError("heal=True does not combine with mask=, logit_bias= or grammar_prefix= (they read "
                             "the generated ids, which then start inside the prompt)")
        all_ids = self.prompt_ids(prompts)
        if spec.constraint is not None and not spec.heal:
            mask = self.grammar(*spec.constraint).mask_fn()
        if spec.grammar_prefix:
            if mask is None or len(all_ids) != 1 or spec.grammar_prefix > len(all_ids[0]):
                raise ValueError("grammar_prefix needs a constraint, one prompt, and at most the prompt's tokens")
            mask = masks.continued(mask, all_ids[0][len(all_ids[0]) - spec.grammar_prefix:])
        mask, added = masks.logit_bias(spec.logit_bias, self.vocab_size, mask)
        if not spec.heal:
            mask = masks.no_end_before(mask, spec.min_tokens, self.eos_ids, self.vocab_size)
        params = SamplingParams(**spec.params, stop_after=spec.min_tokens, mask=mask, logit_bias=added,
                                stop_fn=self._stop_fn(spec, spec.params.get("ignore_eos", False)))
        if spec.heal:
            all_ids, per_prompt = self._heal(all_ids, params, spec)
        else:
            per_prompt = [params] * len(all_ids)
        for i, (ids, p) in enumerate(zip(all_ids, per_prompt)):
            self._check_fits(ids, p, i)
        return Built(all_ids, per_prompt, spec.cache_salt)

    def _heal(self, all_ids, params: SamplingParams, spec: RequestSpec):
        """heal=True: each prompt's healed ids and parameters (`decode.healing`); a prompt with nothing to heal
        keeps its own, with the constraint as given."""
        h = healing.healer(self.tokenizer)
        kind, value = spec.constraint or (None, None)
        # compiled whether or not a prompt heals: an invalid or empty constraint fails here, named as given
        # (inside the healed grammar an empty one would only fail after the backed-up text is generated)
        plain = None if kind is None else self.grammar(kind, value) if kind != "choices" else \
            self.grammar("grammar", healing.canonical_choices(self.tokenizer, value))  # as healed choices are
        out_ids, out_params = [], []
        for ids in all_ids:
            heal = h.heal(ids, params.max_tokens, spec.min_tokens, params.stop_fn)
            if heal is None:
                mask = plain.mask_fn() if plain is not None else None
                mask = masks.no_end_before(mask, spec.min_tokens, self.eos_ids, self.vocab_size)
                out_ids.append(ids)
                out_params.append(dataclasses.replace(params, mask=mask))
                continue
            ids = ids[:-heal.tokens]
            mask = self.grammar("grammar", heal.constraint(self.tokenizer, kind, value)).mask_fn() if kind else None
            out_ids.append(ids)
            out_params.append(heal.apply(params, mask, self.eos_ids, self.vocab_size, self.context_length, len(ids)))
        return out_ids, out_params

    async def abuild(self, prompts, spec_of: Callable[[], RequestSpec], bias_entries: int = 0) -> Built:
        """`build` for an event loop of the spec `spec_of()` makes from a caller's options (`bias_entries`: the size of
        the logit bias it reads, slow to read too): on a thread of its own where either may be slow (module doc)."""
        if bias_entries > INLINE_PROMPTS or _much_text(prompts):
            return await self._off_loop(lambda: self.build(prompts, spec_of()))
        spec = spec_of()
        if spec.heal or spec.constraint is not None:
            return await self._off_loop(lambda: self.build(prompts, spec))
        return self.build(prompts, spec)

    @staticmethod
    async def _off_loop(build) -> Built:
        # on threads of its own: the loop's default pool also runs /health's check and other clients' work
        return await asyncio.get_running_loop().run_in_executor(_BUILDING, build)


def _much_text(prompts) -> bool:
    if isinstance(prompts, str):
        return len(prompts) > INLINE_CHARS
    if not isinstance(prompts, Sequence):
        return False
    return len(prompts) > INLINE_PROMPTS or sum(len(p) for p in prompts if isinstance(p, str)) > INLINE_CHARS
