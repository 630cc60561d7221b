"""Nested queries and distributions of a query run (`Nested`, one per `kvql.runtime.context.Context`):
a query run inside this prompt as a hole's value, and a `distribution` clause scored over its values."""

from __future__ import annotations

import math

from ..backends import base  # the contract only: no torch, no engine
from .decorators import Chain
from .errors import QueryError, UnmetConstraint
from .hole_plan import HolePlan, hole_plan
from .hole_result import stop_name, tokens_text
from .program import Program
from .result import LMQLResult
from .scoring import normalized


class Nested:
    """The nested queries and distributions of one query run: `nested(...)` and `distribution(...)`. `ctx`: the
    run's context (`kvql.runtime.context.Context`), whose prompt, variables and counts they read and write."""

    def __init__(self, ctx):
        self.ctx = ctx

    async def nested(self, name: str, query, args: tuple, kwargs: dict, post=(), constraint=None):
        """Run `query` (a `Program`) inside this prompt; its own prompt text is removed afterwards and its
        return value (or, without a return, the text it added) is inserted instead. The statement's
        `where` conditions on the hole are checked on that value (see `_check_nested`)."""
        plan = hole_plan(constraint, name)
        if plan.heal:
            raise QueryError(f"cannot heal [{name}: {getattr(query, 'name', 'query')}] (HEAL({name})): a nested "
                             "query's value is what it returns; heal the holes inside it")
        if plan.stops:  # the nested query decides where its own values end
            raise QueryError(f"cannot enforce {stop_name(name, plan.stops[0])} on [{name}: "
                             f"{getattr(query, 'name', 'query')}]: a nested query's value is what it returns; put "
                             "stop phrases on the holes inside it")
        if isinstance(getattr(query, "__func__", None), Program):  # a query defined as a method: bind `self`
            query, args = query.__func__, (query.__self__, *args)
        prompt = self.ctx.buffer.flush()
        ids = prompt if isinstance(prompt, list) else None
        ctx = self.ctx
        child = type(ctx)(ctx.model, ctx.decoding, ctx.run_index, ids=ids, text=ctx.buffer.text,
                          shown=ctx._shown, role=ctx._role, roles_seen=ctx._roles_seen)
        value = await query.execute(child, args, kwargs)
        if ids is not None and child.model_used:
            self.ctx.buffer.served[:len(ids)] = child.buffer.served[:len(ids)]
        self.ctx._hole_log += child._hole_log
        if isinstance(value, LMQLResult):
            value = value.prompt[len(self.ctx._shown):]
        self._check_nested(name, plan, value)
        value, shown = Chain(post).post(value, str(value), self.ctx.program_state())
        self.ctx.cached_tokens += child.cached_tokens
        self.ctx.computed_tokens += child.computed_tokens
        self.ctx.disk_tokens += child.disk_tokens
        self.ctx.variables[name] = value
        await self.ctx.text(shown)
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
        try:
            self.ctx.model.require(base.TOKEN_IDS, f"{plan.cap or plan.floor} on a nested query's hole (counts tokens)")
        except base.Unsupported as e:
            raise QueryError(str(e)) from None
        n = len(self.ctx.model.tokenizer.encode(text, add_special_tokens=False))
        if plan.max_tokens is not None and n > plan.max_tokens:
            raise UnmetConstraint(name, f"the nested query's value {text!r} has {tokens_text(n)}; {plan.cap} allows "
                                        f"{plan.max_tokens}", text)
        if n < plan.min_tokens:
            raise UnmetConstraint(name, f"the nested query's value {text!r} has {tokens_text(n)}; {plan.floor} needs "
                                        f"{plan.min_tokens}", text)

    async def distribution(self, name: str, values):
        """Score every value as the continuation of the prompt; the most likely becomes the hole's value."""
        values = list(values)
        if not values:
            raise QueryError(f"distribution {name} in []: no values to choose from")
        try:
            self.ctx.model.require(base.TOKEN_IDS, "a distribution clause (scores token sequences)")
            self.ctx.model.require(base.SCORE, "a distribution clause (prompt log-probabilities)")
        except base.Unsupported as e:
            raise QueryError(str(e)) from None
        ids = self.ctx.buffer.flush()
        tok = self.ctx.model.tokenizer
        per_token, completions = await self.ctx.model.ascore(
            ids, [tok.encode(str(v), add_special_tokens=False) for v in values])
        logps = [float(sum(lps)) for lps in per_token]
        self.ctx.count(completions)
        if completions:
            self.ctx.sent(len(ids), min(c.cached_tokens for c in completions))
        self.ctx.variables[f"log P({name})"] = list(zip(values, normalized(logps)))
        self.ctx.variables[f"P({name})"] = [(v, math.exp(lp)) for v, lp in self.ctx.variables[f"log P({name})"]]
        best = values[logps.index(max(logps))]
        self.ctx.dist_clause = (name, values)
        self.ctx._append_value(str(best), None)
        self.ctx.variables[name] = best
        self.ctx.buffer.hole_of[len(ids):] = [name] * (len(self.ctx.buffer) - len(ids))
        return best
