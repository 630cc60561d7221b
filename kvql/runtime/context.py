"""The runtime context of one query run: the prompt so far, roles, the trace and the result; its holes
(`kvql.runtime.holes`) and nested queries and distributions (`kvql.runtime.nested`) are objects it holds, each
given the context; the compiled query calls them through the context (`__ctx.hole(...)`).

A context talks to its model only through the backend contract (`kvql.backends.base`): the same code
runs a query on kvql's local engine and on a remote server. The prompt is kept as token ids when the
backend has a tokenizer, as text otherwise (see `kvql.runtime.prompt`).

What runs when: every run of a query (one per sample of `sample(n)` / `beam(n)`) executes the body
once, top to bottom; Python side effects happen once per run and are never replayed.
"""

from __future__ import annotations

import asyncio
import functools
import time

from ..backends import base  # the contract only: no torch, no engine
from .chat import role_wrapper
from .decoding import Decoding
from .errors import QueryError
from .hole_plan import HolePlan
from .holes import Holes
from .nested import Nested
from .program import Program
from .program_state import ProgramState
from .prompt import Prompt
from .result import LMQLResult
from .trace import Trace, TraceHole


class Context:
    def __init__(self, model, decoding: Decoding, run_index: int = 0, *, ids: list[int] | None = None,
                 text: str = "", shown: str | None = None, role: str | None = None, roles_seen: bool = False,
                 writer=None):
        # The model is first touched when the prompt is made (a hole, a trace, a result), so a query
        # that ends before that never loads it, as in LMQL (see `model_used`).
        self.model = model
        self.decoding = decoding
        self.run_index = run_index
        self.writer = writer  # the call's output writer: it sees each hole grow (kvql.runtime.live)
        self._given = (ids, text)
        self._early: list[tuple[str, bool]] = []  # model text before the prompt exists, and whether it is content
        self._shown = text if shown is None else shown  # the prompt as LMQL shows it (<lmql:user/> tags)
        self._role, self._roles_seen = role, roles_seen
        self.holes, self.nesting = Holes(self), Nested(self)
        self.variables: dict = {}
        self._hole_log: list[TraceHole] = []
        self._started = time.perf_counter()
        self.dist_clause: tuple[str, list] | None = None
        self.cached_tokens = 0  # prompt tokens of every request of the run, as the backend served them
        self.computed_tokens = 0
        self.disk_tokens = 0  # of the cached ones, read back from the engine's disk tier (Completion.disk_tokens)
        self.requests = 0
        # (hole, tokens, bound): a hole the budget ended, named when a later hole finds no room
        self._filled_by: tuple[str, int, str] | None = None

    @functools.cached_property
    def buffer(self) -> Prompt:
        """The prompt as the backend is sent it (token ids, or text without a tokenizer)."""
        ids, text = self._given
        buffer = Prompt(self.model.tokenizer, ids, text, plain=getattr(self.model, "plain_content", False))
        for s, content in self._early:
            buffer.add(s, content)
        self._early.clear()
        return buffer

    @property
    def model_used(self) -> bool:
        """Whether this run has needed its model (made its prompt) so far."""
        return "buffer" in self.__dict__

    @property
    def ids(self) -> list[int]:
        """The prompt's token ids so far ([] when the backend takes text)."""
        return list(self.buffer.ids or ())

    # -- prompt ----------------------------------------------------------------------------------
    @property
    def prompt(self) -> str:
        """The prompt so far as LMQL shows it: chat roles as `<lmql:ROLE/>` tags, not the template."""
        return self._shown

    def _add(self, s: str, content: bool = False) -> None:
        if self.model_used:
            self.buffer.add(s, content)
        else:
            self._early.append((s, content))

    async def text(self, s: str) -> None:
        self._add(s, content=self._role is not None)  # a role's content: plain text under plain_content
        self._shown += s

    @staticmethod
    def fmt(value, conversion: str = "", spec: str = "") -> str:
        if conversion:
            value = {"r": repr, "s": str, "a": ascii}[conversion](value)
        return format(value, spec)

    def _wrapper(self, role: str, first: bool) -> tuple[str, str]:
        try:
            self.model.require(base.TOKEN_IDS, "{:role} tags (rendered by the model's chat template)")
            return role_wrapper(self.model.tokenizer, role, first)
        except ValueError as e:
            raise QueryError(str(e)) from None

    async def role(self, role: str) -> None:
        # the model sees its chat template's markup, the prompt shows LMQL's tag
        if self._role is not None:
            self._add(self._wrapper(self._role, first=False)[1])
        before, _ = self._wrapper(role, first=not self._roles_seen)
        self._role, self._roles_seen = role, True
        self._add(before)
        self._shown += f"<lmql:{role}/>"

    async def close_role(self) -> None:
        if self._role is not None:
            self._add(self._wrapper(self._role, first=False)[1])
            self._role = None

    def _append_value(self, value: str, token_ids: list[int] | None, hole: str | None = None,
                      healed: tuple[int, str] | None = None, forced: list[int] = (), drafted: list[int] = ()) -> None:
        self.buffer.add_value(value, token_ids, hole, healed, forced, drafted)
        self._shown += value

    def sent(self, n: int, cached: int) -> None:
        self.buffer.sent(n, cached)

    def count(self, completions) -> None:
        self.requests += len(completions)
        for c in completions:
            self.cached_tokens += c.cached_tokens
            self.computed_tokens += c.prompt_tokens - c.cached_tokens
            self.disk_tokens += c.disk_tokens

    def guard_chars(self, plan: HolePlan, tokens: list[int]) -> int | None:
        """Characters of a value's first `plan.min_tokens` tokens (None while it has fewer): stop
        phrases count only after them."""
        if len(tokens) < plan.min_tokens:
            return None
        if not plan.min_tokens:
            return 0
        return len(self.model.tokenizer.decode(tokens[:plan.min_tokens], skip_special_tokens=True))

    def trace(self) -> Trace | None:
        """This run's trace (None when the backend takes text: there are no tokens to show)."""
        tokens = self.buffer.trace_tokens()
        if tokens is None:
            return None
        return Trace(tokens, list(self._hole_log), time.perf_counter() - self._started, model=self.model.name,
                     sample=self.run_index, server=getattr(self.model, "base_url", None), requests=self.requests,
                     request_cached=self.cached_tokens, request_tokens=self.cached_tokens + self.computed_tokens,
                     request_disk=self.disk_tokens)

    def program_state(self, growing: str | None = None, value: str = "", diff: str = "") -> ProgramState:
        """The run's state as LMQL hands it to decorators and output writers; `growing`: a hole being
        generated, its `value` so far and the `diff` added since the last look."""
        values = {**self.variables, growing: value} if growing is not None else self.variables
        return ProgramState(self.prompt, values, diffs={growing: diff} if growing is not None else None,
                            growing=growing)

    # -- the statements that ask the model (their objects: module doc) --------------------------
    async def hole(self, name: str, constraint=None, type=None, post=()):
        """The value of hole `name` (`Holes.hole`)."""
        return await self.holes.hole(name, constraint, type, post)

    async def nested(self, name: str, query, args: tuple, kwargs: dict, post=(), constraint=None):
        """`query` run inside this prompt as hole `name`'s value (`Nested.nested`)."""
        return await self.nesting.nested(name, query, args, kwargs, post, constraint)

    async def distribution(self, name: str, values):
        """The `distribution` clause scored over `values` (`Nested.distribution`)."""
        return await self.nesting.distribution(name, values)

    async def finish(self) -> LMQLResult:
        """End the run (a bare `return`): its open role closed, its result."""
        await self.close_role()
        return self.result()

    # -- LMQL's `context` inside a query ---------------------------------------------------------
    async def get_var(self, name: str):
        """The value of hole `name` so far (KeyError if it has none yet)."""
        return self.variables[name]

    async def get_all_vars(self) -> dict:
        return dict(self.variables)

    @property
    def num_calls(self) -> int:
        """Model calls this run made so far (one per hole)."""
        return len(self._hole_log)

    def result(self) -> LMQLResult:
        name, values = self.dist_clause or (None, None)
        if not self.model_used:  # the run never needed its model: nothing to tokenize or trace
            return LMQLResult(self._shown, dict(self.variables), name, values, 0, 0, None)
        self.buffer.flush()
        return LMQLResult(self._shown, dict(self.variables), name, values, self.cached_tokens, self.computed_tokens,
                          self.trace())


async def run_all(program: Program, model, decoding: Decoding, inputs: dict, body, writer=None) -> tuple[list, list]:
    """All runs of one call of `program` (one per sample or beam), concurrently: -> (results, their contexts).
    `body`: `program.body(inputs)`, made once for the whole call; `writer`: its output writer (or None)."""
    contexts = [Context(model, decoding, k, writer=writer) for k in range(decoding.runs)]
    results = await asyncio.gather(*(program.execute(ctx, (), inputs, body) for ctx in contexts))
    return list(results), contexts
