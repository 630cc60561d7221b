"""Programs: what the runtime executes. A compiled query (`kvql.query.Query`, the public face) is a
`Program`; the runtime runs it, and runs it nested inside another one's prompt, through this interface
alone, so it never imports the query layer or the language."""

from __future__ import annotations

import abc
from typing import Awaitable, Callable

Body = Callable[..., Awaitable]
"""A program's body for one call: `await body(ctx, inputs)` runs it once in context `ctx`."""


class Program(abc.ABC):
    name: str = "query"

    @abc.abstractmethod
    def bind(self, args: tuple, kwargs: dict) -> dict:
        """The inputs of one call (TypeError when they do not fit the program's parameters)."""

    @abc.abstractmethod
    def body(self, inputs: dict) -> tuple[Body, bool]:
        """-> (the body to run for these inputs, whether it returns a value: if not, a run's result is
        its `LMQLResult`)."""

    async def execute(self, ctx, args: tuple, kwargs: dict, body: tuple[Body, bool] | None = None):
        """Run the program once in `ctx` (every run of a call, and a nested query inside a prompt);
        `body`: one `body(inputs)` made for the whole call, shared by its runs."""
        inputs = self.bind(args, kwargs)
        fn, returns = body if body is not None else self.body(inputs)
        value = await fn(ctx, inputs)
        await ctx.close_role()
        return value if returns else ctx.result()
