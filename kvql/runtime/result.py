"""What a query run returns when it has no `return` statement (LMQL's `LMQLResult`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


@dataclass
class LMQLResult:
    """`prompt`: the final prompt text; `variables`: every hole's value (and `P(VAR)` / `log P(VAR)` for a
    `distribution` clause); `distribution_variable` / `distribution_values` name that clause's hole and
    options; `cached_tokens` / `computed_tokens` count this run's prompt tokens served from / computed
    by the engine; `trace` shows them token by token (`trace.save("t.html")`)."""

    prompt: str
    variables: dict = field(default_factory=dict)
    distribution_variable: str | None = None
    distribution_values: list | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    trace: "Trace | None" = field(default=None, repr=False)  # see kvql.runtime.trace

    def __getitem__(self, index):
        """Legacy `result[0]`: before LMQL 0.7 a query returned a list of one result; as LMQL 0.7 does,
        index 0 is the result itself, with a DeprecationWarning (other indices raise IndexError)."""
        if index != 0:
            raise IndexError(f"an LMQLResult is one result: only the legacy index 0 exists, not {index!r}")
        warnings.warn("result[0] on a query result is deprecated: since LMQL 0.7 a query with one result "
                      "returns it directly", DeprecationWarning, stacklevel=2)
        return self

    def __getattr__(self, name):
        variables = self.__dict__.get("variables", {})
        if name in variables:
            return variables[name]
        raise AttributeError(name)
