"""The runtime context of one query run: the prompt so far (as token ids), holes, roles, nesting.

The prompt is kept as the token ids actually fed to the model: literal text is tokenized in the
largest pieces available (everything between two holes at once), generated values keep the tokens
the model produced (unless a stop phrase or a post-processor changed the text). Running the same
query again therefore feeds the same ids, and the engine serves them from its radix cache.

What runs when: every run of a query (one per sample of `sample(n)` / `beam(n)`) executes the body
once, top to bottom; Python side effects happen once per run and are never replayed.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import functools
import json
import math
import random
import time
from dataclasses import dataclass, field

import torch

from ..engine.grammar import Grammar
from ..engine.request import SamplingParams
from .chat import role_wrapper
from .constraints import (INT_REGEX, And, Atom, ConstraintError, HolePlan, Node, Stop, fewest_tokens, from_json,
                          longest_token, plan_for)
from .decorators import Chain
from .result import LMQLResult
from .scoring import score_continuations
from .trace import Trace, TraceHole, TraceToken

DEFAULT_MAX_LEN = 2048
FLOAT_REGEX = r" ?-?[0-9]+(\.[0-9]+)?"


def _and(constraint, atom: Atom):
    """`constraint and atom`, flat (plan_for reads the top-level conjuncts)."""
    if not isinstance(constraint, Node):
        return atom
    return And((constraint.items if isinstance(constraint, And) else (constraint,)) + (atom,))


@functools.lru_cache(maxsize=256)
def _compiled(tokenizer, lark: str) -> Grammar:
    """Grammars are immutable: every run of a query (map over many inputs) shares one per hole plan."""
    return Grammar.lark(tokenizer, lark)


class QueryError(RuntimeError):
    """A query could not run as written (not a model error): names the hole and what is wrong."""


class UnmetConstraint(QueryError, ValueError):
    """Hole `hole` got no value that meets its where clause: its conditions contradict each other, or
    its bounds (token cap, max_len) leave too little room; `value` is what was generated (None when
    this was certain before generating, and nothing was). kvql raises this rather than return a
    value that breaks its where clause."""

    def __init__(self, hole: str, message: str, value: str | None = None):
        super().__init__(f"hole {hole}: {message}")
        self.hole, self.value = hole, value


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def _stop_name(name: str, stop: Stop) -> str:
    return f"{'STOPS_AT' if stop.include else 'STOPS_BEFORE'}({name}, {stop.phrase!r})"


DECODERS = ("argmax", "sample", "beam", "beam_search", "beam_sample", "best_k", "var", "beam_var")
SAMPLING_OPTIONS = ("top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
IGNORED_OPTIONS = ("chunksize", "verbose", "cache", "openai_chunksize", "openai_nonstop", "chunk_timeout",
                   "distribution_batch_size")
"""LMQL options about OpenAI requests, LMQL's own caches, logging and batching: accepted, no effect
(kvql caches every prefix in its engine, batches every request, and asks for tokens one at a time)."""
BEAM_OPTIONS = ("num_beams", "k", "b", "subdecoder", "budget", "kappa", "beta", "gamma", "max_heap_size",
                "top_k_continuations", "alpha", "prune", "inject_stop", "return_first")
"""Options of LMQL's beam-family decoders: `num_beams` / `k` / `b` set the width; the tuning knobs of
best_k / beam_var / var (LMQL's experimental decoders) are accepted and have no effect."""
DECODER_OPTIONS = frozenset({"n", "temperature", "max_len", "seed", *SAMPLING_OPTIONS, *IGNORED_OPTIONS,
                             *BEAM_OPTIONS})


@dataclass
class Decoding:
    """Decoder settings of a run, with LMQL's keyword arguments (see `decoding`).

    `name` is LMQL's decoder; every beam-family decoder (beam, beam_sample, best_k, var, beam_var)
    runs kvql's per-hole beam search of `width` beams (`sampled`: candidates are drawn, not the top
    ones) and gives `n` results."""

    name: str = "argmax"
    n: int = 1
    temperature: float = 1.0
    max_len: int = DEFAULT_MAX_LEN
    seed: int | None = None
    shared: dict = field(default_factory=dict)  # beam searches shared by the n runs of one call
    sampling: dict = field(default_factory=dict)  # top_k, top_p and the penalties, for the engine
    width: int = 1
    sampled: bool = False

    @property
    def beam(self) -> bool:
        return self.name not in ("argmax", "sample")

    @property
    def runs(self) -> int:
        """How many runs (results) one call makes."""
        return 1 if self.name == "argmax" else self.n


def decoding(name: str, opts: dict) -> Decoding:
    """Validate LMQL decoder `name` and its options; TypeError for an unknown option, ValueError for a
    bad value or an unknown decoder."""
    unknown = set(opts) - DECODER_OPTIONS
    if unknown:
        raise TypeError(f"unknown decoder options {sorted(unknown)}; known: {sorted(DECODER_OPTIONS)}")
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; use one of {', '.join(DECODERS)}")
    if name == "var" and opts.get("subdecoder", "sample") not in ("sample", "beam"):
        raise ValueError(f"var(subdecoder={opts['subdecoder']!r}) is not supported; use 'sample' or 'beam'")
    width = {"best_k": opts.get("k", 4), "var": opts.get("b", 2)}.get(name, opts.get("num_beams", opts.get("n", 1)))
    default_n = width if name not in ("argmax", "sample") else 1
    n, width = int(opts.get("n", default_n)), int(width)
    if n < 1 or width < 1:
        raise ValueError(f"n and the beam width must be >= 1, got n={n}, width={width}")
    sampling = {k: opts[k] for k in SAMPLING_OPTIONS if opts.get(k) is not None}
    temperature = float(opts.get("temperature", 1.0))
    probe = SamplingParams(max_tokens=1, temperature=temperature, **sampling)  # the engine's own checks
    probe.validate()
    sampled = name == "beam_sample" or (name == "var" and opts.get("subdecoder", "sample") == "sample")
    return Decoding(name, n, temperature, int(opts.get("max_len", DEFAULT_MAX_LEN)), opts.get("seed"),
                    sampling=sampling, width=width, sampled=sampled)


class Context:
    def __init__(self, model, decoding: Decoding, run_index: int = 0, *, ids: list[int] | None = None,
                 text: str = "", shown: str | None = None, role: str | None = None, roles_seen: bool = False):
        # The model is first touched when the prompt is tokenized (a hole, a trace, a result), so a
        # query that ends before that never loads it, as in LMQL (see `model_used`).
        self.model = model
        self.decoding = decoding
        self.run_index = run_index
        self._given_ids = ids
        self._text = text  # what the model sees (role tags rendered by its chat template)
        self._pending: list[str] = []  # model text not tokenized yet
        self._shown = text if shown is None else shown  # the prompt as LMQL shows it (<lmql:user/> tags)
        self._role, self._roles_seen = role, roles_seen
        self._holes = 0
        self.variables: dict = {}
        self._hole_log: list[TraceHole] = []
        self._started = time.perf_counter()
        self.dist_clause: tuple[str, list] | None = None
        self.cached_tokens = 0
        self.computed_tokens = 0

    @functools.cached_property
    def remote(self) -> bool:
        """A remote model (no local tokenizer): the prompt is kept as text and sent as text."""
        return not hasattr(self.model, "engine")

    @functools.cached_property
    def tokenizer(self):
        return None if self.remote else self.model.tokenizer

    @functools.cached_property
    def ids(self) -> list[int]:
        """The token ids of the prompt so far (without text not yet tokenized)."""
        ids = list(self._given_ids) if self._given_ids is not None else [] if self.remote else \
            self.tokenizer("", add_special_tokens=True).input_ids
        self._served: list[str | None] = [None] * len(ids)  # per prompt position, see runtime.trace
        self._hole_of: list[str | None] = [None] * len(ids)
        return ids

    @property
    def model_used(self) -> bool:
        """Whether this run has needed its model (tokenized its prompt) so far."""
        return "ids" in self.__dict__

    # -- prompt ----------------------------------------------------------------------------------
    @property
    def prompt(self) -> str:
        """The prompt so far as LMQL shows it: chat roles as `<lmql:ROLE/>` tags, not the template."""
        return self._shown

    async def text(self, s: str) -> None:
        self._pending.append(s)
        self._shown += s

    @staticmethod
    def fmt(value, conversion: str = "", spec: str = "") -> str:
        if conversion:
            value = {"r": repr, "s": str, "a": ascii}[conversion](value)
        return format(value, spec)

    async def role(self, role: str) -> None:
        if self.remote:
            raise QueryError("{:role} tags need the model's chat template; on a remote server use /v1/chat "
                             "directly or a local model")
        # the model sees its chat template's markup, the prompt shows LMQL's tag
        if self._role is not None:
            self._pending.append(role_wrapper(self.tokenizer, self._role, first=False)[1])
        before, _ = role_wrapper(self.tokenizer, role, first=not self._roles_seen)
        self._role, self._roles_seen = role, True
        self._pending.append(before)
        self._shown += f"<lmql:{role}/>"

    async def close_role(self) -> None:
        if self._role is not None:
            self._pending.append(role_wrapper(self.tokenizer, self._role, first=False)[1])
            self._role = None

    def _flush(self) -> list[int]:
        if self._pending:
            chunk = "".join(self._pending)
            self._pending.clear()
            self._text += chunk
            if not self.remote:
                self._extend(self.tokenizer.encode(chunk, add_special_tokens=False), None)
        return list(self.ids)

    def _extend(self, token_ids: list[int], hole: str | None) -> None:
        self.ids += token_ids
        self._served += [None] * len(token_ids)
        self._hole_of += [hole] * len(token_ids)

    def _sent(self, n: int, cached: int) -> None:
        """A request with the first `n` prompt tokens was served `cached` of them from the cache."""
        for i in range(n):
            if self._served[i] is None:
                self._served[i] = "cached" if i < cached else "computed"

    def _append_value(self, value: str, token_ids: list[int] | None, hole: str | None = None) -> None:
        self._flush()
        self._text += value
        self._shown += value
        if self.remote:
            return
        if token_ids is not None and self.tokenizer.decode(token_ids) == value:
            self._extend(token_ids, hole)  # keep the model's own tokens: their KV is already cached
        else:
            self._extend(self.tokenizer.encode(value, add_special_tokens=False), hole)

    def _count(self, completions) -> None:
        for c in completions:
            self.cached_tokens += c.cached_tokens
            self.computed_tokens += c.prompt_tokens - c.cached_tokens

    # -- holes -----------------------------------------------------------------------------------
    async def hole(self, name: str, constraint=None, type=None, post=()):
        from ..query import Query  # the nested-query type lives one layer up

        fixed = Chain(post).pre(name, self)
        if fixed is not None:  # a pre-stage decorator supplied the value: the model is not asked
            value, shown = fixed
            self._append_value(shown, None, name)
            self.variables[name] = value
            return value
        if isinstance(type, Query) or isinstance(getattr(type, "__func__", None), Query):  # a query, or a method
            return await self.nested(name, type, (), {}, post, constraint)
        if type is float:
            constraint = _and(constraint, Atom("regex", name, FLOAT_REGEX))
        elif isinstance(type, builtins.type) and dataclasses.is_dataclass(type):
            constraint = _and(constraint, Atom("type", name, type))  # [P: Person] is `where type(P) is Person`
        elif type not in (None, int, str):
            raise QueryError(f"[{name}: {getattr(type, '__name__', type)}]: a hole's type must be int, float, str, "
                             "a dataclass or a query")
        try:
            plan = plan_for(constraint, name)
        except ValueError as e:
            raise QueryError(f"constraint on {name}: {e}") from None
        if type is int:
            plan.require(INT_REGEX, f"[{name}: int]")
            plan.as_int = True
        plan.as_float = type is float
        if not plan.satisfiable():
            which = "its constraint can never hold" if len(plan.conditions) == 1 else \
                "its constraints cannot all hold"
            raise UnmetConstraint(name, f"{which}: {plan.describe()}")
        if self.remote:
            value, checked, why = await self._remote_sample(name, plan)
            self._check_value(name, plan, value, checked, lambda: why)
            return self._finish_hole(name, plan, value, None, post)
        ids = self._flush()
        if not ids:  # a hole at the very start, and a tokenizer that adds no BOS: give the model one token
            start = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
            self._extend([start], None)
            ids = list(self.ids)
        started = time.perf_counter()
        limit = min(self.decoding.max_len, self.model.context_length) - len(ids)
        if limit < 1:
            raise QueryError(f"the prompt before [{name}] has {len(ids)} tokens: no room left under "
                             f"max_len={self.decoding.max_len} / context {self.model.context_length}")
        max_tokens = min(plan.max_tokens or limit, limit)
        if plan.max_tokens == max_tokens:
            bound = f"{plan.cap} allows"
        elif self.decoding.max_len <= self.model.context_length:
            bound = f"max_len={self.decoding.max_len} leaves after the {len(ids)}-token prompt"
        else:
            bound = f"the model's {self.model.context_length}-token context leaves after the {len(ids)}-token prompt"
        self._check_room(name, plan, max_tokens, bound)
        if self.decoding.beam:
            value, tokens = await self._beam(name, plan, ids, max_tokens)
        else:
            value, tokens = await self._sample(name, plan, ids, max_tokens)
        self._hole_log.append(TraceHole(name, str(value), repr(plan), len(tokens), time.perf_counter() - started))
        full = self.tokenizer.decode(tokens, skip_special_tokens=True)
        checked = plan.constrained(full, self._guard_chars(plan, tokens))
        self._check_value(name, plan, value, checked, lambda: self._why_cut(name, plan, full, checked, tokens,
                                                                            max_tokens, bound))
        return self._finish_hole(name, plan, value, tokens, post)

    def _check_room(self, name: str, plan: HolePlan, max_tokens: int, bound: str) -> None:
        """Refuse, before generating, a hole that certainly cannot get a valid value in `max_tokens`
        tokens. Only certain cases: a token lower bound above it or above the bytes of every
        choice, every choice needing more tokens in its shortest tokenization, or a length needing
        more characters than that many of the tokenizer's longest tokens hold. Everything else is
        checked on the generated value."""
        if plan.min_tokens > max_tokens:
            raise UnmetConstraint(name, f"{plan.floor} needs at least {_tokens(plan.min_tokens)}, more than the "
                                        f"{max_tokens} that {bound}")
        if plan.choices and plan.min_tokens > max(len(c.encode()) for c in plan.choices):  # a token has a byte
            raise UnmetConstraint(name, f"{plan.floor} needs more tokens than any value of its constraint "
                                        f"({plan.describe()}) can have")
        if plan.choices:
            need = math.inf
            for choice in plan.choices:
                need = min(need, fewest_tokens(self.tokenizer, choice))
                if need <= max_tokens:
                    break
            if max_tokens < need < math.inf:
                raise UnmetConstraint(name, f"its constraint ({plan.describe()}) needs at least {need} tokens, "
                                            f"more than the {max_tokens} that {bound}")
        room = max_tokens * longest_token(self.tokenizer) if plan.min_chars else 0
        if plan.min_chars > room:
            raise UnmetConstraint(name, f"its constraint ({plan.describe()}) needs at least {plan.min_chars} "
                                        f"characters; the {_tokens(max_tokens)} that {bound} hold at most {room}")

    @staticmethod
    def _check_value(name: str, plan: HolePlan, value: str, checked: str, why_cut) -> None:
        """Raise UnmetConstraint unless the generated text behind `value` (`checked`, see
        `HolePlan.constrained`) meets every condition of the hole's grammar; `why_cut()` says what
        ended an incomplete value (the token cap, max_len, a stop phrase)."""
        state = plan.check(checked)
        if state == "complete":
            return
        if state == "no":  # the local mask only allows prefixes: a server that ignored the regex sent this
            raise UnmetConstraint(name, f"the value {value!r} does not satisfy its constraint ({plan.describe()})",
                                  value)
        raise UnmetConstraint(name, f"the value {value!r} is incomplete: its constraint ({plan.describe()}) "
                                    f"{why_cut()}", value)

    def _why_cut(self, name, plan, full, checked, tokens, max_tokens, bound) -> str:
        hit = plan.stop_index(full, self._guard_chars(plan, tokens)) if checked != full else None
        if hit is not None:
            return f"was cut short by {_stop_name(name, hit[1])}"
        if len(tokens) >= max_tokens:
            return f"needs more than the {_tokens(max_tokens)} that {bound}"
        return "was ended by the model"

    def _finish_hole(self, name, plan, value, tokens, post):
        text = value
        chain = Chain(post)
        if chain.streams:
            self._stream(chain, text, tokens)
        if plan.as_int or plan.as_float:
            try:
                value = (int if plan.as_int else float)(value.strip())
            except ValueError:
                kind = "an integer" if plan.as_int else "a number"
                raise QueryError(f"{name} should be {kind} but the model produced {value!r}") from None
        elif plan.value_type is not None:  # the grammar made it JSON under the type's schema
            try:
                value = from_json(plan.value_type, json.loads(value))
            except (ValueError, TypeError, KeyError) as e:
                raise QueryError(f"{name}: cannot read {value!r} as a {plan.describe()}: {e}") from None
        # a typed value stays in the prompt as the JSON the model wrote
        shown = text if plan.value_type is not None else str(value)
        if chain:  # [@f @g X] is f(g(X)), as Python applies stacked decorators
            value, shown = chain.post(value, shown, self)
        changed = plan.as_int or plan.as_float or shown != text
        self._append_value(shown, None if changed else tokens, name)
        self.variables[name] = value
        return value

    def _stream(self, chain: Chain, text: str, tokens: list[int] | None) -> None:
        """Streaming decorators see the hole's text grow: "", each token's prefix, then the final text
        (after the hole is generated: kvql does not call user code inside the engine's loop)."""
        chain.stream("", self)
        for i in range(1, len(tokens or ()) + 1):
            chain.stream(self.tokenizer.decode(tokens[:i], skip_special_tokens=True), self)
        chain.stream(text, self)

    async def _remote_sample(self, name: str, plan: HolePlan) -> tuple[str, str, str]:
        """One hole on a remote server: constraints as one regex, stop phrases as stop strings.
        -> (value, the text its grammar constrains, what ended it in words)."""
        if self.decoding.beam:
            raise QueryError(f"the {self.decoding.name} decoder runs on local models only")
        local_only = sorted(set(self.decoding.sampling) - {"top_p"})
        if local_only:
            raise QueryError(f"decoder options {local_only} need a local model (kvql's remote client sends top_p "
                             "only)")
        if plan.min_tokens or plan.min_chars:
            raise QueryError(f"{name}: lower length bounds and guarded stop phrases need a local model")
        try:
            regex = plan.regex()
        except ValueError as e:
            raise QueryError(f"constraint on {name}: {e}") from None
        self._flush()
        greedy = self.decoding.name == "argmax"
        options = dict(max_tokens=plan.max_tokens or min(self.decoding.max_len, 256),
                       temperature=0.0 if greedy else self.decoding.temperature,
                       stop=[s.phrase for s in plan.stops] or None, regex=regex)
        if not greedy and "top_p" in self.decoding.sampling:
            options["top_p"] = self.decoding.sampling["top_p"]
        if not greedy and self.decoding.seed is not None:
            options["seed"] = hash((self.decoding.seed, self.run_index, self._holes)) & 0x7FFFFFFF
        self._holes += 1
        (c,) = await self.model.agenerate([self._text], **options)
        self._count([c])
        kept = {s.phrase for s in plan.stops if s.include}
        value = c.text + c.stop_reason if c.stop_reason in kept else c.text
        checked = c.text + c.stop_reason if c.stop_reason in {s.phrase for s in plan.stops} else c.text
        if c.finish_reason == "length":
            why = f"needs more than the {_tokens(options['max_tokens'])} that " + \
                (f"{plan.cap} allows" if plan.max_tokens else f"max_len={self.decoding.max_len} (at most 256 on a "
                 "remote server) allows")
        elif isinstance(c.stop_reason, str):
            stop = next((s for s in plan.stops if s.phrase == c.stop_reason), Stop(c.stop_reason, False))
            why = f"was cut short by {_stop_name(name, stop)}"
        else:
            why = "was ended by the server"
        return value, checked, why

    def _mask(self, plan: HolePlan):
        lark = plan.lark()
        grammar = _compiled(self.tokenizer, lark).mask_fn() if lark else None
        if not plan.min_tokens:
            return grammar
        eos = list(self.model.engine.eos_ids)
        vocab = self.model.vocab_size

        def mask(ids):
            allowed = grammar(ids) if grammar else None
            if len(ids) < plan.min_tokens:
                allowed = torch.ones(vocab, dtype=torch.bool) if allowed is None else allowed.clone()
                allowed[[e for e in eos if e < allowed.numel()]] = False
            return allowed

        return mask

    async def _sample(self, name, plan, ids, max_tokens):
        greedy = self.decoding.name == "argmax"
        seed = None
        if not greedy:
            base = self.decoding.seed if self.decoding.seed is not None else random.getrandbits(32)
            seed = hash((base, self.run_index, self._holes)) & 0x7FFFFFFF
        self._holes += 1
        guard = {"chars": 0 if not plan.min_tokens else None}

        def stop_fn(out, text):
            if guard["chars"] is None and len(out) >= plan.min_tokens:
                guard["chars"] = len(text)  # the stop phrases count from here on
            return plan.stop_index(text, guard["chars"]) is not None

        mask = self._mask(plan)
        try:
            (c,) = await self.model.agenerate([ids], max_tokens=max_tokens, mask=mask,
                                              stop_fn=stop_fn if plan.stops else None,
                                              temperature=0.0 if greedy else self.decoding.temperature, seed=seed,
                                              **self.decoding.sampling)
        except ValueError as e:
            if mask is None:
                raise QueryError(f"while generating {name}: {e}") from e
            # the mask left no token: the value took a path that its conditions together cannot finish
            bounds = [b for b in (plan.floor, plan.cap) if b]
            raise UnmetConstraint(name, "no token could continue its value under all its constraints "
                                        f"({' and '.join(plan.conditions + bounds)}): {e}") from e
        self._count([c])
        self._sent(len(ids), c.cached_tokens)
        return plan.cut(c.text, guard["chars"]), c.token_ids

    def _guard_chars(self, plan: HolePlan, tokens: list[int]) -> int | None:
        if len(tokens) < plan.min_tokens:
            return None
        return len(self.tokenizer.decode(tokens[:plan.min_tokens], skip_special_tokens=True))

    async def _beam(self, name, plan, ids, max_tokens):
        key = (tuple(ids), name, repr(plan), max_tokens)
        shared = self.decoding.shared
        if key not in shared:
            shared[key] = asyncio.ensure_future(self._beam_search(plan, ids, max_tokens))
        beams = await shared[key]
        value, tokens, _ = beams[min(self.run_index, len(beams) - 1)]
        return value, tokens

    async def _beam_search(self, plan, ids, max_tokens):
        """Beam search over one hole: -> [(value, token ids, log-probability)], best first.

        Each step extends every beam by its `width` most likely tokens, or (`sampled`, LMQL's
        beam_sample) by `width` tokens drawn at the decoder's temperature, and keeps the `width` best
        sequences by log-probability (of the masked distribution)."""
        width, dec = self.decoding.width, self.decoding
        base = self._mask(plan)
        eos = self.model.engine.eos_ids
        active, done = [([], 0.0)], []
        base_seed = dec.seed if dec.seed is not None else random.getrandbits(32)
        for step in range(max_tokens):
            def mask_for(prefix):
                return (lambda out: base(prefix + out)) if base else None
            if dec.sampled:  # seeded per (call, hole, step, beam): every run of the call shares this search
                options = [dict(n=width, logprobs=0, temperature=dec.temperature, **dec.sampling,
                                seed=hash((base_seed, tuple(ids), step, i)) & 0x7FFFFFFF) for i in range(len(active))]
            else:
                options = [dict(logprobs=width, **{k: v for k, v in dec.sampling.items() if "penalty" in k})] * len(active)
            results = await asyncio.gather(*(
                self.model.agenerate([ids + g], max_tokens=1, masked_logprobs=True, mask=mask_for(g), ignore_eos=True,
                                     **opt) for (g, _), opt in zip(active, options)))
            if not done and len(active) == 1 and not active[0][0]:  # the first step sent the prompt itself
                self._sent(len(ids), results[0][0].cached_tokens)
            candidates = []
            for (g, score), cs in zip(active, results):
                self._count(cs[:1])  # the samples of one request share its prompt
                top = {c.logprobs[0].token_id: c.logprobs[0].logprob for c in cs} if dec.sampled else cs[0].logprobs[0].top
                for tok, lp in top.items():
                    if lp == -math.inf:
                        continue
                    new, s = g + [tok], score + lp
                    seq = g if tok in eos else new
                    text = self.tokenizer.decode(seq, skip_special_tokens=True)
                    finished = tok in eos or len(new) >= max_tokens or \
                        plan.stop_index(text, self._guard_chars(plan, seq)) is not None
                    candidates.append((s, seq, text, finished))
            candidates.sort(key=lambda x: -x[0])
            active = []
            for s, g, text, finished in candidates[:width]:
                if finished:
                    done.append((plan.cut(text, self._guard_chars(plan, g)), g, s))
                else:
                    active.append((g, s))
            done.sort(key=lambda x: -x[2])
            if not active or (len(done) >= width and done[width - 1][2] >= max(s for _, s in active)):
                break
        done += [(plan.cut(self.tokenizer.decode(g, skip_special_tokens=True), self._guard_chars(plan, g)), g, s)
                 for g, s in active]
        done.sort(key=lambda x: -x[2])
        return done[:width]

    # -- nested queries and distributions --------------------------------------------------------
    async def nested(self, name: str, query, args: tuple, kwargs: dict, post=(), constraint=None):
        """Run `query` inside this prompt; its own prompt text is removed afterwards and its return
        value (or, without a return, the text it added) is inserted instead. The statement's `where`
        conditions on the hole are checked on that value (see `_check_nested`)."""
        try:
            plan = plan_for(constraint, name)
        except ConstraintError as e:
            raise QueryError(f"constraint on {name}: {e}") from None
        if plan.stops:  # the nested query decides where its own values end
            raise QueryError(f"cannot enforce {_stop_name(name, plan.stops[0])} on [{name}: "
                             f"{getattr(query, 'name', 'query')}]: a nested query's value is what it returns; put "
                             "stop phrases on the holes inside it")
        from ..query import Query

        if isinstance(getattr(query, "__func__", None), Query):  # a query defined as a method: bind `self`
            query, args = query.__func__, (query.__self__, *args)
        ids = self._flush() if not self.remote else None
        child = Context(self.model, self.decoding, self.run_index, ids=ids, text=self._text, shown=self._shown,
                        role=self._role, roles_seen=self._roles_seen)
        value = await query._execute(child, args, kwargs)
        if ids is not None:
            self._served[:len(ids)] = child._served[:len(ids)]
            self._hole_log += child._hole_log
        if isinstance(value, LMQLResult):
            value = value.prompt[len(self._shown):]
        self._check_nested(name, plan, value)
        value, shown = Chain(post).post(value, str(value), self)
        self.cached_tokens += child.cached_tokens
        self.computed_tokens += child.computed_tokens
        self.variables[name] = value
        await self.text(shown)
        return value

    def _check_nested(self, name: str, plan: HolePlan, value) -> None:
        """Raise UnmetConstraint unless a nested query's value meets the where conditions on its hole:
        the grammar conditions on its text, token bounds on its tokens (this model's tokenization),
        a type constraint on its type. (LMQL constrains the text while the nested query generates it;
        kvql checks the value it returns, and never returns one that breaks the clause.)"""
        if plan.value_type is not None:
            if not isinstance(value, plan.value_type):
                raise UnmetConstraint(name, f"the nested query returned {value!r}, not a "
                                            f"{getattr(plan.value_type, '__name__', plan.value_type)}", str(value))
            return
        text = str(value)
        if plan.terms and plan.check(text) != "complete":
            raise UnmetConstraint(name, f"the nested query's value {text!r} does not satisfy {plan.describe()}", text)
        if plan.max_tokens is None and not plan.min_tokens:
            return
        if self.remote:
            raise QueryError(f"{plan.cap or plan.floor} on a nested query's hole counts tokens: it needs a local model")
        n = len(self.tokenizer.encode(text, add_special_tokens=False))
        if plan.max_tokens is not None and n > plan.max_tokens:
            raise UnmetConstraint(name, f"the nested query's value {text!r} has {_tokens(n)}; {plan.cap} allows "
                                        f"{plan.max_tokens}", text)
        if n < plan.min_tokens:
            raise UnmetConstraint(name, f"the nested query's value {text!r} has {_tokens(n)}; {plan.floor} needs "
                                        f"{plan.min_tokens}", text)

    async def distribution(self, name: str, values):
        """Score every value as the continuation of the prompt; the most likely becomes the hole's value."""
        if self.remote:
            raise QueryError("distribution clauses score with the model's logits: they need a local model")
        values = list(values)
        if not values:
            raise QueryError(f"distribution {name} in []: no values to choose from")
        ids = self._flush()
        logps, completions = await score_continuations(self.model, ids, [str(v) for v in values])
        self._count(completions)
        if completions:
            self._sent(len(ids), min(c.cached_tokens for c in completions))
        top = max(logps)
        z = top + math.log(sum(math.exp(lp - top) for lp in logps))
        self.variables[f"log P({name})"] = [(v, lp - z) for v, lp in zip(values, logps)]
        self.variables[f"P({name})"] = [(v, math.exp(lp - z)) for v, lp in zip(values, logps)]
        best = values[logps.index(top)]
        self.dist_clause = (name, values)
        self._append_value(str(best), None)
        self.variables[name] = best
        self._hole_of[len(ids):] = [name] * (len(self.ids) - len(ids))
        return best

    def trace(self) -> Trace | None:
        """This run's trace (None on a remote model: it has no tokens to show)."""
        if self.remote:
            return None
        self._flush()
        tokens = [TraceToken(t, self.tokenizer.decode([t]), served or "unsent", hole)
                  for t, served, hole in zip(self.ids, self._served, self._hole_of)]
        return Trace(tokens, list(self._hole_log), time.perf_counter() - self._started)

    def result(self) -> LMQLResult:
        name, values = self.dist_clause or (None, None)
        if not self.model_used:  # the run never needed its model: nothing to tokenize or trace
            return LMQLResult(self._shown, dict(self.variables), name, values, 0, 0, None)
        self._flush()
        return LMQLResult(self._shown, dict(self.variables), name, values, self.cached_tokens, self.computed_tokens,
                          self.trace())
