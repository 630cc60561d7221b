"""Errors of a query run that are the query's, not the model's."""

from __future__ import annotations


class ConstraintError(ValueError):
    """A `where` clause kvql cannot enforce, with the reason."""


class InvalidCondition(ConstraintError):
    """A condition whose values, as the program made them, are wrong (an empty list of choices, an empty
    stop phrase): raised as is when its hole is generated."""


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
