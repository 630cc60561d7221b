"""Variable decorators (`[@f @g VAR]`, LMQL's `lmql.decorators`): hooks at three stages of a hole.

- pre: before the hole is generated. `@lmql.decorators.pre def f(variable[, context])` gets a
  `TemplateVariable` (`.name`); returning it unchanged generates as usual, returning anything else
  uses that as the value instead (a `(value, prompt_value)` tuple sets the prompt text separately),
  and the model is not called for this hole.
- stream: `@lmql.decorators.streaming def f(value, context)` is called with the hole's text as it
  grows, as LMQL calls it: "" twice, then after each generated token, then the final text once more,
  while the hole is generated (kvql.runtime.live: on the query's event loop, never in the engine's).
- post (a plain function): `f(value)` or `f(value, prompt_value, context)` after generation; returns the
  new value (`str(value)` goes into the prompt), a `(value, prompt_value)` tuple, or None (unchanged).

A chain `[@a @b @c X]` runs pre in order a, b, c (stopping at the first that supplies a value),
stream and post in reverse order c, b, a: as Python applies stacked decorators.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class TemplateVariable:
    """The hole a pre-stage decorator is asked about."""

    name: str


def _arity(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 1


class LMQLDecorator:
    """Base class of decorators with several stages; override any of `pre`, `stream`, `post`."""

    def pre(self, variable: TemplateVariable, context):
        return variable

    def stream(self, value: str, context):
        return value

    def post(self, value, prompt_value: str, context):
        return value, prompt_value


class _PostFunction(LMQLDecorator):
    """A plain function used as a decorator: the post stage."""

    def __init__(self, fn):
        self.fn, self.nargs = fn, _arity(fn)

    def post(self, value, prompt_value, context):
        r = self.fn(value) if self.nargs == 1 else self.fn(value, prompt_value, context)
        if r is None:
            return value, prompt_value
        return r if isinstance(r, tuple) else (r, str(r))


class pre(LMQLDecorator):
    """Marks a function as a pre-stage decorator (see the module docstring)."""

    def __init__(self, fn):
        self.fn, self.nargs = fn, _arity(fn)

    def pre(self, variable, context):
        return self.fn(variable) if self.nargs == 1 else self.fn(variable, context)


class streaming(LMQLDecorator):
    """Marks a function as a streaming-stage decorator (see the module docstring)."""

    def __init__(self, fn):
        self.fn, self.nargs = fn, _arity(fn)

    def stream(self, value, context):
        r = self.fn(value) if self.nargs == 1 else self.fn(value, context)
        return value if r is None else r


def wrap(decorator) -> LMQLDecorator:
    if isinstance(decorator, LMQLDecorator):
        return decorator
    if callable(decorator):
        return _PostFunction(decorator)
    raise TypeError(f"not a valid variable decorator: {decorator!r}")


class Chain:
    """The decorators of one hole, in the order written; the runtime calls its three stages."""

    def __init__(self, decorators):
        self.decorators = [wrap(d) for d in decorators]

    def __bool__(self) -> bool:
        return bool(self.decorators)

    @property
    def streams(self) -> bool:
        return any(type(d).stream is not LMQLDecorator.stream for d in self.decorators)

    def pre(self, name: str, context):
        """None to generate the hole, or `(value, prompt_value)` supplied by a decorator."""
        variable = TemplateVariable(name)
        for d in self.decorators:
            r = d.pre(variable, context)
            if r is not variable:
                return r if isinstance(r, tuple) else (r, str(r))
        return None

    def stream(self, value: str, context) -> None:
        for d in reversed(self.decorators):
            value = d.stream(value, context)

    def post(self, value, prompt_value: str, context):
        """-> (value, prompt_value) after every decorator's post stage."""
        for d in reversed(self.decorators):
            value, prompt_value = d.post(value, prompt_value, context)
        return value, prompt_value
