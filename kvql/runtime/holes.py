"""The holes of a query run (`Holes`, one per `kvql.runtime.context.Context`): a hole's plan from its
where clause, its token budget and room, one request per hole to the backend (sampled, or by beam search),
and its value checked against the clause before the program sees it.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import logging
import math
import random
import time

from ..backends import base  # the contract only: no torch, no engine
from .beam import beam_search
from .constraints import INT_REGEX, And, Atom, Node
from .decorators import Chain
from .errors import QueryError, UnmetConstraint
from .hole_plan import HolePlan, hole_plan
from .hole_result import HoleResult, check, stop_name, tokens_text
from .json_types import from_json
from .live import LiveHole, UserCodeFailed
from .program import Program
from .trace import LONG_HOLE, where_text
from .value_check import fewest_tokens, longest_token

FLOAT_REGEX = r" ?-?[0-9]+(\.[0-9]+)?"
TEXT_MODE_MAX_TOKENS = 256
"""Without a tokenizer the prompt's length in tokens is unknown: a hole with no token cap asks for at
most this many tokens (or max_len, if smaller)."""
log = logging.getLogger("kvql.query")


def _and(constraint, atom: Atom):
    """`constraint and atom`, flat (plan_for reads the top-level conjuncts)."""
    if not isinstance(constraint, Node):
        return atom
    return And((constraint.items if isinstance(constraint, And) else (constraint,)) + (atom,))


def _constraint(plan: HolePlan, model, heal: bool = False) -> dict:
    """The hole's grammar as one backend constraint option: a value among finitely many choices in their
    canonical tokenizations where the backend reads token ids in grammars; else a plain regex where one
    says it all (every server takes those), else the Lark grammar (intersections, complements, JSON).
    Healed (`heal`), such a value goes as `choices`: the backend tokenizes the backed-up text + each choice."""
    if heal:
        choices = plan.admitted()
        if choices:
            return {"choices": choices}
    elif base.TOKEN_GRAMMAR in model.capabilities:
        tokens = plan.token_lark(model.tokenizer)
        if tokens is not None:
            return {"grammar": tokens}
    regex = plan.single_regex()
    if regex is not None:
        return {"regex": regex}
    lark = plan.lark()
    return {"grammar": lark} if lark else {}


def _stops(plan: HolePlan, guard: dict) -> dict:
    """The request's stop option: the phrases, or, where the hole has a length lower bound, a `stop_fn`
    guarded by it: stop phrases count once the length conditions hold (`guard["chars"]` is set to the
    text's length when the value reaches min_tokens)."""
    if not plan.stops:
        return {}
    if not (plan.min_tokens or plan.min_chars):
        return {"stop": [s.phrase for s in plan.stops]}

    def stop_fn(out, text):
        if guard["chars"] is None and len(out) >= plan.min_tokens:
            guard["chars"] = len(text)
        return plan.stop_index(text, guard["chars"]) is not None
    return {"stop_fn": stop_fn}


def _progress(name: str, room: int):
    """A stop function that never stops: it logs a hole with no token bound of its own as it grows past
    `LONG_HOLE` tokens, and past each doubling (`room`: the most it may take)."""
    mark = [LONG_HOLE]

    def stop_fn(ids, text) -> bool:
        if len(ids) >= mark[0]:
            mark[0] *= 2
            log.warning("hole %s has generated %s tokens and has no token bound of its own (it may take up to %s); "
                        "add one to end it sooner, e.g. where len(TOKENS(%s)) < 100", name, f"{len(ids):,}",
                        f"{room:,}", name)
        return False
    return stop_fn


def _is_query(type) -> bool:
    """`[X: q]` names a query `q`, or a query defined as a method: the hole is a nested query."""
    return isinstance(type, Program) or isinstance(getattr(type, "__func__", None), Program)


def _typed(name: str, constraint, type):
    """The hole's constraint with what its type adds: `[X: float]` a number's regex, `[P: Person]` (a
    dataclass) `where type(P) is Person`; QueryError for a type a hole cannot have."""
    if type is float:
        return _and(constraint, Atom("regex", name, FLOAT_REGEX))
    if isinstance(type, builtins.type) and dataclasses.is_dataclass(type):
        return _and(constraint, Atom("type", name, type))
    if type not in (None, int, str):
        raise QueryError(f"[{name}: {getattr(type, '__name__', type)}]: a hole's type must be int, float, str, "
                         "a dataclass or a query")
    return constraint


def _plan(name: str, constraint, type) -> HolePlan:
    """The hole's plan (`constraint` already `_typed`); UnmetConstraint when no value can meet it, before
    anything is generated."""
    plan = hole_plan(constraint, name)
    if type is int:
        plan.require(INT_REGEX, f"[{name}: int]")
        plan.as_int = True
    plan.as_float = type is float
    if not plan.satisfiable():
        which = "its constraint can never hold" if len(plan.conditions) == 1 else "its constraints cannot all hold"
        raise UnmetConstraint(name, f"{which}: {plan.describe()}")
    return plan


def _converted(name: str, plan: HolePlan, text: str):
    """The generated text as the hole's type: an int, a float, or a dataclass read from its JSON."""
    if plan.as_int or plan.as_float:
        try:
            return (int if plan.as_int else float)(text.strip())
        except ValueError:
            kind = "an integer" if plan.as_int else "a number"
            raise QueryError(f"{name} should be {kind} but the model produced {text!r}") from None
    if plan.value_type is not None:  # the grammar made it JSON under the type's schema
        try:
            return from_json(plan.value_type, json.loads(text))
        except (ValueError, TypeError, KeyError) as e:
            raise QueryError(f"{name}: cannot read {text!r} as a {plan.describe()}: {e}") from None
    return text


class Holes:
    """The holes of one query run: `hole(name, constraint, type, post)` and what it needs. `ctx`: the run's
    context (`kvql.runtime.context.Context`), whose prompt, variables and trace it reads and writes; `sampled`:
    holes sampled so far (each one's seed differs: `_seed`). A hole's own data passes from step to step as values
    (its `HolePlan`, its budget, its `HoleResult`), never through attributes."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.sampled = 0

    async def hole(self, name: str, constraint=None, type=None, post=()):
        """The value of hole `name`: planned from its where clause and type, given its room under the
        token budget, generated (sampled, or by beam search), logged in the trace, checked against its
        clause and added to the prompt. QueryError / UnmetConstraint where no valid value can come."""
        chain = Chain(post)
        fixed = chain.pre(name, self.ctx.program_state())
        if fixed is not None:  # a pre-stage decorator supplied the value: the model is not asked
            return self._supplied(name, *fixed)
        if _is_query(type):
            return await self.ctx.nested(name, type, (), {}, post, constraint)
        constraint = _typed(name, constraint, type)
        plan = _plan(name, constraint, type)
        heal = self._heals(name, plan)
        self.ctx.buffer.ensure_start()
        prompt = self.ctx.buffer.flush()
        started = time.perf_counter()
        max_tokens, bound = self._budget(name, plan)
        self._check_room(name, plan, max_tokens, bound, heal)
        setup = time.perf_counter() - started  # the checks before the request (a first use reads the vocabulary)
        # shown as it is generated where someone watches (a healed value's first token also spells prompt
        # text, and beams grow side by side: those are shown whole, once generated)
        watched = chain.streams or self.ctx.writer is not None
        ctx = self.ctx
        live = LiveHole(ctx, name, chain, ctx.writer) if watched and not heal and not ctx.decoding.beam else None
        if self.ctx.decoding.beam:
            out = await self._beam(name, plan, prompt, max_tokens)
        else:
            out = await self._sample(name, plan, prompt, max_tokens, heal, live)
        if len(out.tokens) >= max_tokens and plan.max_tokens != max_tokens:
            self.ctx._filled_by = (name, len(out.tokens), bound)  # the budget, not the hole's own bound, ended it
        where = where_text(constraint, name, plan)
        self.ctx._hole_log.append(out.trace_row(name, where, time.perf_counter() - started, setup,
                                            unbounded=plan.max_tokens is None))
        check(name, plan, out, max_tokens, bound)
        return await self._finish_hole(name, plan, out, chain, live)

    def _supplied(self, name: str, value, shown: str):
        """A value a pre-stage decorator supplied: added to the prompt as `shown`, no tokens of the model's."""
        self.ctx._append_value(shown, None, name)
        self.ctx.variables[name] = value
        return value

    def _heals(self, name: str, plan: HolePlan) -> bool:
        """Whether the hole is token-healed (its HEAL(name), or the call's token_healing=True); QueryError
        where it cannot be (a beam decoder, a backend without healing)."""
        if not (plan.heal or self.ctx.decoding.heal):
            return False
        how = f"HEAL({name})" if plan.heal else "token_healing=True"
        if self.ctx.decoding.beam:
            raise QueryError(f"{name}: token healing ({how}) does not combine with the {self.ctx.decoding.name} "
                             "decoder (its beams extend the prompt token by token)")
        try:
            self.ctx.model.require(base.HEAL, f"token healing of {name} ({how})")
        except base.Unsupported as e:
            raise QueryError(str(e)) from None
        return True

    def _budget(self, name: str, plan: HolePlan) -> tuple[int, str]:
        """-> (the most tokens the hole may take, the bound that sets it, in words)."""
        n, max_len, context = len(self.ctx.buffer), self.ctx.decoding.max_len, self.ctx.model.context_length
        if self.ctx.buffer.ids is None:
            limit = min(max_len, TEXT_MODE_MAX_TOKENS)
            default = f"max_len={max_len} (at most {TEXT_MODE_MAX_TOKENS} without a tokenizer) allows"
        else:
            limit = min(max_len, context or max_len) - n
            default = f"max_len={max_len} leaves after the {n}-token prompt" if context is None or max_len <= context \
                else f"the model's {context}-token context leaves after the {n}-token prompt"
            if limit < 1:
                why = ""
                if self.ctx._filled_by is not None:
                    hole, k, bound = self.ctx._filled_by
                    why = (f"; hole {hole} used it up: with no token bound of its own (e.g. len(TOKENS({hole})) < 20) "
                           f"it generated {tokens_text(k)}, all that {bound}")
                raise QueryError(f"the prompt before [{name}] has {n} tokens: no room left under "
                                 f"max_len={max_len}" + (f" / context {context}" if context else "") + why)
        max_tokens = min(plan.max_tokens or limit, limit)
        return max_tokens, f"{plan.cap} allows" if plan.max_tokens == max_tokens else default

    def _check_room(self, name: str, plan: HolePlan, max_tokens: int, bound: str, heal: bool = False) -> None:
        """Refuse, before generating, a hole that certainly cannot get a valid value in `max_tokens`
        tokens. Only certain cases: a token lower bound above it or above the bytes of every
        choice, every choice needing more tokens in its shortest tokenization, or a length needing
        more characters than that many of the tokenizer's longest tokens hold. Everything else is
        checked on the generated value."""
        if plan.min_tokens > max_tokens:
            raise UnmetConstraint(name, f"{plan.floor} needs at least {tokens_text(plan.min_tokens)}, more than the "
                                        f"{max_tokens} that {bound}")
        if plan.choices and plan.min_tokens > max(len(c.encode()) for c in plan.choices):  # a token has a byte
            raise UnmetConstraint(name, f"{plan.floor} needs more tokens than any value of its constraint "
                                        f"({plan.describe()}) can have")
        tok = self.ctx.model.tokenizer
        if tok is None or not hasattr(tok, "get_vocab"):  # the checks below read every token's bytes (a
            return                                        # server's tokenizer does not show its vocabulary)
        if plan.choices and not heal:  # healed, one token may spell backed-up text and several of the value's
            need = math.inf
            for choice in plan.choices:
                need = min(need, fewest_tokens(tok, choice))
                if need <= max_tokens:
                    break
            if max_tokens < need < math.inf:
                raise UnmetConstraint(name, f"its constraint ({plan.describe()}) needs at least {need} tokens, "
                                            f"more than the {max_tokens} that {bound}")
        room = max_tokens * longest_token(tok) if plan.min_chars else 0
        if plan.min_chars > room:
            raise UnmetConstraint(name, f"its constraint ({plan.describe()}) needs at least {plan.min_chars} "
                                        f"characters; the {tokens_text(max_tokens)} that {bound} hold at most {room}")

    async def _finish_hole(self, name: str, plan: HolePlan, out: HoleResult, chain: Chain, live: LiveHole | None):
        """The value the program sees (typed, then through the hole's decorators), added to the prompt:
        with the model's own tokens unless typing or a decorator changed its text. Streaming decorators see
        the final value (`live`: they saw it grow; else they see it now, grown a token at a time)."""
        if chain.streams:
            try:
                if live is None:
                    await self._shown_after(chain, name, out.value, None if out.healed else out.tokens)
                else:
                    await live.end(out.value)
            except UserCodeFailed as e:
                raise e.error
        value = _converted(name, plan, out.value)
        # a typed value stays in the prompt as the JSON the model wrote
        shown = out.value if plan.value_type is not None else str(value)
        if chain:  # [@f @g X] is f(g(X)), as Python applies stacked decorators
            value, shown = chain.post(value, shown, self.ctx.program_state())
        changed = plan.as_int or plan.as_float or shown != out.value
        # healed, the backed-up prompt tokens go and the tokens generated in their place come
        self.ctx._append_value(shown, None if changed else out.added, name, out.healed_prefix, out.forced,
                           out.drafted_at)
        self.ctx.variables[name] = value
        return value

    async def _shown_after(self, chain: Chain, name: str, text: str, tokens: list[int] | None) -> None:
        """Streaming decorators of a value generated whole (beams, a healed value) see it grow as LMQL shows it
        (kvql.runtime.live): "" twice, each token's prefix, then the final text again."""
        shown = LiveHole(self.ctx, name, chain, None)
        await shown.start()
        for i in range(1, len(tokens or ()) + 1):
            await shown.grow(self.ctx.model.tokenizer.decode(tokens[:i], skip_special_tokens=True))
        await shown.end(text)

    def _seed(self) -> int | None:
        """Per (call seed, run, hole): the runs of a `sample(n)` differ, and a seeded call repeats."""
        if self.ctx.decoding.name == "argmax":
            return None
        base_seed = self.ctx.decoding.seed if self.ctx.decoding.seed is not None else random.getrandbits(32)
        return hash((base_seed, self.ctx.run_index, self.sampled)) & 0x7FFFFFFF

    async def _sample(self, name: str, plan: HolePlan, prompt, max_tokens: int, heal: bool = False,
                      live: LiveHole | None = None) -> HoleResult:
        """One request for the hole's value: sampled (greedy under argmax), under its constraint; streamed
        and shown as it comes with `live`."""
        greedy = self.ctx.decoding.name == "argmax"
        seed = self._seed()
        self.sampled += 1
        guard = {"chars": 0 if not plan.min_tokens else None}  # set by `_stops`' stop_fn once min_tokens are out
        constraint = _constraint(plan, self.ctx.model, heal)
        options = dict(max_tokens=max_tokens, temperature=0.0 if greedy else self.ctx.decoding.temperature, seed=seed,
                       **self.ctx.decoding.sampling, **constraint, **_stops(plan, guard))
        if heal:
            options["heal"] = True
        if plan.min_tokens:
            options["min_tokens"] = plan.min_tokens
        if plan.max_tokens is None and max_tokens > LONG_HOLE and getattr(self.ctx.model, "base_url", None) is None:
            told, user = _progress(name, max_tokens), options.get("stop_fn")
            options["stop_fn"] = told if user is None else lambda ids, text: told(ids, text) or user(ids, text)
        c = await self._request(name, plan, prompt, options, bool(constraint), live)
        self.ctx.count([c])
        self.ctx.sent(len(self.ctx.buffer) - c.healed_prompt_tokens, c.cached_tokens)
        return HoleResult.sampled(c, plan, guard["chars"])

    async def _request(self, name: str, plan: HolePlan, prompt, options: dict, constrained: bool,
                       live: LiveHole | None = None):
        """The backend's one completion (`live`: streamed, each token shown); its refusals as the query's
        errors: a constrained request the mask left without a token is the hole's UnmetConstraint; what a
        writer or decorator raised, as it is (its request cancelled)."""
        try:
            if live is None:
                (c,) = await self.ctx.model.agenerate([prompt], **options)
            else:
                await live.start()
                c = await live.follow(self.ctx.model.stream(prompt, **options))
        except UserCodeFailed as e:
            raise e.error
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        except ValueError as e:
            if isinstance(e, base.BackendError) or (not constrained and not plan.min_tokens):
                raise QueryError(f"while generating {name}: {e}") from e
            # the mask left no token: the value took a path that its conditions together cannot finish
            bounds = [b for b in (plan.floor, plan.cap) if b]
            raise UnmetConstraint(name, "no token could continue its value under all its constraints "
                                        f"({' and '.join(plan.conditions + bounds)}): {e}") from e
        return c

    async def _beam(self, name: str, plan: HolePlan, prompt, max_tokens: int) -> HoleResult:
        """The hole's value by beam search (`kvql.runtime.beam`): one search per (prompt, hole), shared by
        the call's runs, each of which takes the beam of its index."""
        try:
            self.ctx.model.require(base.TOKEN_IDS, f"the {self.ctx.decoding.name} decoder (it extends token sequences)")
            self.ctx.model.require(base.LOGPROBS, f"the {self.ctx.decoding.name} decoder (top-k log-probabilities)")
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        key = (tuple(prompt), name, repr(plan), max_tokens)
        shared = self.ctx.decoding.shared
        if key not in shared:
            search = beam_search(self.ctx, plan, prompt, max_tokens, _constraint(plan, self.ctx.model))
            shared[key] = asyncio.ensure_future(search)
        try:
            beams = await shared[key]
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        value, tokens, _ = beams[min(self.ctx.run_index, len(beams) - 1)]
        full = self.ctx.model.tokenizer.decode(tokens, skip_special_tokens=True)
        return HoleResult(value, tokens, full, self.ctx.guard_chars(plan, tokens), added=tokens)
