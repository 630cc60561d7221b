"""A hole's text shown as it grows: to the hole's streaming decorators and to the run's output writer, in
LMQL's call order, on the query's own event loop (never in the engine's loop or thread).

`LiveHole` follows one hole. Its streaming decorators see "" twice, then the text after each generated token,
then the final value once more; each call's `context.get_diff(name)` is the text added since the previous
call, so the diffs add up to the final value (a call whose text is unchanged gets ""). The output writer
(`add_interpreter_head_state`) is called after each token with the prompt so far (the hole's text included),
`is_final=False`, and the run's `ProgramState` with the hole growing; kvql.output's `report` makes the
final call once the run is done.

The rule for user code: a writer or decorator runs between two tokens of its own hole, one call at a time,
in order. A synchronous one runs on a worker thread, so that a slow one holds up only its own query, never
its event loop's other queries or the engine (which keeps generating; the hole ends once its writer has seen
every token). One that raises ends its own query with that exception, and its request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect

from .program_state import ProgramState


class UserCodeFailed(Exception):
    """A writer or streaming decorator raised `error` while a hole was shown."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


async def call(fn, *args):
    """`fn(*args)` for user code: a coroutine function awaited here, any other on a worker thread (its
    result awaited if it is awaitable)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(out):
        out = await out
    return out


async def write(writer, variable, prompt: str, state: ProgramState, num_tokens: int, final: bool) -> None:
    """One call of an output writer (LMQL's `add_interpreter_head_state`)."""
    await call(writer.add_interpreter_head_state, variable, 0, prompt, None, None, True, final, None, num_tokens,
               state)


class LiveHole:
    """One hole's text as it grows (module doc). `ctx`: the run's context (`prompt`, `program_state`),
    `chain`: the hole's decorators, `writer`: the run's output writer or None."""

    def __init__(self, ctx, name: str, chain, writer):
        self.ctx, self.name, self.chain, self.writer = ctx, name, chain, writer
        self.text = self.shown = ""
        self.tokens = 0

    async def start(self) -> None:
        await self._decorate("")
        await self._decorate("")

    async def follow(self, chunks):
        """The completion of a backend's `stream` of the hole's request (`chunks`), each chunk shown as it
        comes; UserCodeFailed (the stream closed: its request cancelled) where a writer or decorator raises."""
        done = None
        async with contextlib.aclosing(chunks) as stream:
            async for chunk in stream:
                if chunk.completion is not None:
                    done = chunk.completion
                if chunk.text or chunk.token_id >= 0:
                    self.text += chunk.text
                    self.tokens += 1
                    await self.grow(self.text)
        return done

    async def grow(self, text: str) -> None:
        """The hole's text is now `text`: its decorators and the writer see it."""
        state = await self._decorate(text)
        if self.writer is not None:
            try:
                await write(self.writer, self.name, self.ctx.prompt + text, state, self.tokens, False)
            except Exception as e:  # noqa: BLE001 -- user code: it ends this query (module doc)
                raise UserCodeFailed(e) from e

    async def end(self, value: str) -> None:
        """The hole's final value, once more to its decorators."""
        await self._decorate(value)

    async def _decorate(self, now: str) -> ProgramState:
        """The hole's decorators see `now`; -> the state they saw (the diff since the previous look)."""
        diff = now[len(self.shown):] if now.startswith(self.shown) else now
        self.shown = now
        state = self.ctx.program_state(self.name, now, diff)
        if self.chain.streams:
            try:
                await call(self.chain.stream, now, state)
            except Exception as e:  # noqa: BLE001 -- user code: it ends this query (module doc)
                raise UserCodeFailed(e) from e
        return state
