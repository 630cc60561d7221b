"""The holes of a query run (`Holes`, mixed into `kvql.runtime.context.Context`): a hole's plan from its
where clause, its token budget and room, one request per hole to the backend (sampled, or by beam search),
and its value checked against the clause before the program sees it.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import math
import random
import time

from ..backends import base  # the contract only: no torch, no engine
from .beam import beam_search
from .constraints import INT_REGEX, And, Atom, Node
from .decorators import Chain
from .errors import InvalidCondition, QueryError, UnmetConstraint
from .hole_plan import HolePlan, Stop, plan_for
from .json_types import from_json
from .program import Program
from .trace import TraceHole, where_text
from .value_check import fewest_tokens, longest_token

FLOAT_REGEX = r" ?-?[0-9]+(\.[0-9]+)?"
TEXT_MODE_MAX_TOKENS = 256
"""Without a tokenizer the prompt's length in tokens is unknown: a hole with no token cap asks for at
most this many tokens (or max_len, if smaller)."""


def _and(constraint, atom: Atom):
    """`constraint and atom`, flat (plan_for reads the top-level conjuncts)."""
    if not isinstance(constraint, Node):
        return atom
    return And((constraint.items if isinstance(constraint, And) else (constraint,)) + (atom,))


def tokens_text(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def stop_name(name: str, stop: Stop) -> str:
    return f"{'STOPS_AT' if stop.include else 'STOPS_BEFORE'}({name}, {stop.phrase!r})"


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


class Holes:
    """`hole(name, constraint, type, post)` and what it needs; the state it reads and writes is the
    context's (`kvql.runtime.context.Context`)."""

    async def hole(self, name: str, constraint=None, type=None, post=()):
        fixed = Chain(post).pre(name, self.program_state())
        if fixed is not None:  # a pre-stage decorator supplied the value: the model is not asked
            value, shown = fixed
            self._append_value(shown, None, name)
            self.variables[name] = value
            return value
        if isinstance(type, Program) or isinstance(getattr(type, "__func__", None), Program):  # a query, or a method
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
        except InvalidCondition:
            raise
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
        heal = plan.heal or self.decoding.heal
        if heal:
            how = f"HEAL({name})" if plan.heal else "token_healing=True"
            if self.decoding.beam:
                raise QueryError(f"{name}: token healing ({how}) does not combine with the {self.decoding.name} "
                                 "decoder (its beams extend the prompt token by token)")
            try:
                self.model.require(base.HEAL, f"token healing of {name} ({how})")
            except base.Unsupported as e:
                raise QueryError(str(e)) from None
        self.buffer.ensure_start()
        prompt = self.buffer.flush()
        started = time.perf_counter()
        max_tokens, bound = self._budget(name, plan)
        self._check_room(name, plan, max_tokens, bound, heal)
        setup = time.perf_counter() - started  # the checks before the request (a first use reads the vocabulary)
        self._healed, self._forced, self._prepared, self._drafts = None, ([], 0), 0.0, (0, 0)
        if self.decoding.beam:
            value, tokens, full, guard = await self._beam(name, plan, prompt, max_tokens)
        else:
            value, tokens, full, guard = await self._sample(name, plan, prompt, max_tokens, heal)
        if len(tokens) >= max_tokens and plan.max_tokens != max_tokens:
            self._filled_by = (name, len(tokens), bound)  # the budget, not the hole's own bound, ended it
        # the row counts what the trace marks as this hole's: healed, also the tokens re-generating backed-up text
        generated, healed = (len(self._healed[2]), self._healed[0]) if self._healed else (len(tokens), 0)
        self._hole_log.append(TraceHole(name, str(value), where_text(constraint, name, plan), generated,
                                        time.perf_counter() - started, self._forced[1], healed,
                                        setup + self._prepared, *self._drafts))
        checked = plan.constrained(full, guard)
        self._check_value(name, plan, value, checked, plan.stop_index(full, guard) is not None,
                          lambda: self._why_cut(tokens, max_tokens, bound))
        if plan.min_tokens and (tokens or not full) and len(tokens) < plan.min_tokens:
            # a server lets a complete grammar end the value before min_tokens (vLLM's rule); kvql's engine
            # would have found no token to continue with
            raise UnmetConstraint(name, f"the value {value!r} has {tokens_text(len(tokens))}; {plan.floor} needs "
                                        f"{plan.min_tokens}, and its constraint ({plan.describe()}) allowed no more",
                                  value)
        return self._finish_hole(name, plan, value, tokens, post)

    def _budget(self, name: str, plan: HolePlan) -> tuple[int, str]:
        """-> (the most tokens the hole may take, the bound that sets it, in words)."""
        n, max_len, context = len(self.buffer), self.decoding.max_len, self.model.context_length
        if self.buffer.ids is None:
            limit = min(max_len, TEXT_MODE_MAX_TOKENS)
            default = f"max_len={max_len} (at most {TEXT_MODE_MAX_TOKENS} without a tokenizer) allows"
        else:
            limit = min(max_len, context or max_len) - n
            default = f"max_len={max_len} leaves after the {n}-token prompt" if context is None or max_len <= context \
                else f"the model's {context}-token context leaves after the {n}-token prompt"
            if limit < 1:
                why = ""
                if self._filled_by is not None:
                    hole, k, bound = self._filled_by
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
        tok = self.model.tokenizer
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

    @staticmethod
    def _check_value(name: str, plan: HolePlan, value: str, checked: str, stopped: bool, why_cut) -> None:
        """Raise UnmetConstraint unless the generated text behind `value` (`checked`, see
        `HolePlan.constrained`) meets every condition of the hole's grammar, or is a prefix of a value
        that does and a stop phrase ended it (`stopped`): a stop phrase ends the value wherever it
        appears, also inside a value its grammar would have continued (LMQL's rule: `STOPS_BEFORE(X, "b")
        and X == "abc"` gives "a"). `why_cut()` says what ended an incomplete value (the token cap, max_len)."""
        state = plan.check(checked)
        if state == "complete" or (stopped and state != "no"):
            return
        if state == "no":  # the local mask only allows prefixes: a server that ignored the regex sent this
            raise UnmetConstraint(name, f"the value {value!r} does not satisfy its constraint ({plan.describe()})",
                                  value)
        raise UnmetConstraint(name, f"the value {value!r} is incomplete: its constraint ({plan.describe()}) "
                                    f"{why_cut()}", value)

    @staticmethod
    def _why_cut(tokens, max_tokens, bound) -> str:
        if len(tokens) >= max_tokens:
            return f"needs more than the {tokens_text(max_tokens)} that {bound}"
        return "was ended by the model"

    def _finish_hole(self, name, plan, value, tokens, post):
        text = value
        chain = Chain(post)
        if chain.streams:  # a healed value's first token also spells prompt text: shown whole at the end
            self._stream(chain, name, text, None if self._healed else tokens)
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
            value, shown = chain.post(value, shown, self.program_state())
        changed = plan.as_int or plan.as_float or shown != text
        healed, self._healed = self._healed, None
        (forced, _), self._forced = self._forced, ([], 0)
        if healed is not None:  # the backed-up prompt tokens go, the tokens generated in their place come
            k, prefix, generated = healed
            self._append_value(shown, None if changed else generated, name, (k, prefix), forced)
        else:
            self._append_value(shown, None if changed else tokens, name, forced=forced)
        self.variables[name] = value
        return value

    def _stream(self, chain: Chain, name: str, text: str, tokens: list[int] | None) -> None:
        """Streaming decorators see the hole's text grow as LMQL shows it: "" twice, each token's prefix, then
        the final text again (after the hole is generated: kvql does not call user code inside the engine's
        loop); their `context` is the state at that point (`get_diff(name)`: the text the latest token
        added, measured against LMQL 0.7.3)."""
        grown = ["", ""] + [self.model.tokenizer.decode(tokens[:i], skip_special_tokens=True)
                            for i in range(1, len(tokens or ()) + 1)] + [text]
        before = diff = ""
        for now in grown:
            if now != before:
                diff = now[len(before):] if now.startswith(before) else now
            chain.stream(now, self.program_state(name, now, diff))
            before = now

    def _seed(self) -> int | None:
        """Per (call seed, run, hole): the runs of a `sample(n)` differ, and a seeded call repeats."""
        if self.decoding.name == "argmax":
            return None
        base_seed = self.decoding.seed if self.decoding.seed is not None else random.getrandbits(32)
        return hash((base_seed, self.run_index, self._holes)) & 0x7FFFFFFF

    async def _sample(self, name, plan, prompt, max_tokens, heal: bool = False):
        """-> (value, the value's token ids, generated text up to where the value ended, guard chars)."""
        greedy = self.decoding.name == "argmax"
        seed = self._seed()
        self._holes += 1
        guard = {"chars": 0 if not plan.min_tokens else None}
        constraint = _constraint(plan, self.model, heal)
        options = dict(max_tokens=max_tokens, temperature=0.0 if greedy else self.decoding.temperature, seed=seed,
                       **self.decoding.sampling, **constraint)
        if heal:
            options["heal"] = True
        if plan.min_tokens:
            options["min_tokens"] = plan.min_tokens
        if plan.stops and (plan.min_tokens or plan.min_chars):
            def stop_fn(out, text):  # guarded: stop phrases count once the length conditions hold
                if guard["chars"] is None and len(out) >= plan.min_tokens:
                    guard["chars"] = len(text)
                return plan.stop_index(text, guard["chars"]) is not None
            options["stop_fn"] = stop_fn
        elif plan.stops:
            options["stop"] = [s.phrase for s in plan.stops]
        try:
            (c,) = await self.model.agenerate([prompt], **options)
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        except ValueError as e:
            if isinstance(e, base.BackendError) or (not constraint and not plan.min_tokens):
                raise QueryError(f"while generating {name}: {e}") from e
            # the mask left no token: the value took a path that its conditions together cannot finish
            bounds = [b for b in (plan.floor, plan.cap) if b]
            raise UnmetConstraint(name, "no token could continue its value under all its constraints "
                                        f"({' and '.join(plan.conditions + bounds)}): {e}") from e
        self.count([c])
        self._prepared = c.prepare_seconds  # the backend's share: options checked, constraint compiled
        self.sent(len(self.buffer) - c.healed_prompt_tokens, c.cached_tokens)
        tokens = c.token_ids[c.healed_output_tokens:]  # the value's: a token spanning the healed text counts
        if c.healed_prompt_tokens:
            self._healed = (c.healed_prompt_tokens, c.healed, list(c.token_ids))
        # indices into the tokens the value is added with: all generated ones when healed, else `tokens`
        own = [i - c.healed_output_tokens for i in c.forced if i >= c.healed_output_tokens]
        self._forced = (list(c.forced) if c.healed_prompt_tokens else own, len(own))
        self._drafts = (c.drafted_tokens, len(c.accepted))
        full = c.text + c.stop_reason if isinstance(c.stop_reason, str) else c.text
        return plan.cut(full, guard["chars"]), tokens, full, guard["chars"]

    async def _beam(self, name, plan, prompt, max_tokens):
        try:
            self.model.require(base.TOKEN_IDS, f"the {self.decoding.name} decoder (it extends token sequences)")
            self.model.require(base.LOGPROBS, f"the {self.decoding.name} decoder (top-k log-probabilities)")
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        key = (tuple(prompt), name, repr(plan), max_tokens)
        shared = self.decoding.shared
        if key not in shared:
            shared[key] = asyncio.ensure_future(beam_search(self, plan, prompt, max_tokens, _constraint(plan, self.model)))
        try:
            beams = await shared[key]
        except base.Unsupported as e:
            raise QueryError(f"{name}: {e}") from None
        value, tokens, _ = beams[min(self.run_index, len(beams) - 1)]
        guard = self.guard_chars(plan, tokens)
        return value, tokens, self.model.tokenizer.decode(tokens, skip_special_tokens=True), guard
