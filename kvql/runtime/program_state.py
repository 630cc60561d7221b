"""LMQL's `ProgramState` (lmql.runtime.program_state): the view of a run's variables that decorators get as
`context` and output writers as `program_variables`.

It is a snapshot, made for each call: later holes do not change a state already handed out. While a
streaming decorator runs, the hole being generated is in it with its value so far, `final(name)` is "var",
and `get_diff(name)` is the text added since the previous call; every finished hole is "fin".
`runtime.root_state.query_head.result` is what LMQL programs read to learn whether the run has ended: None
until its result exists (an output writer's last call, kvql.output).
"""

from __future__ import annotations

from types import SimpleNamespace


class ProgramState:
    def __init__(self, prompt: str, values: dict, program_values: dict | None = None, *, tokens: dict | None = None,
                 diffs: dict | None = None, growing: str | None = None, result=None):
        self.prompt = prompt
        self.runtime = SimpleNamespace(root_state=SimpleNamespace(query_head=SimpleNamespace(result=result)))
        self.variable_values = dict(values)  # each hole's text, as the prompt has it
        self.variable_program_values = dict(program_values if program_values is not None else values)
        self.variable_tokens = dict(tokens or {})
        self.variable_diffs = dict(diffs or {})
        self.variable_monotonicity = {k: "var" if k == growing else "fin" for k in self.variable_values}

    def get(self, name: str, default=None):
        return self.variable_values.get(name, default)

    def __getitem__(self, name: str):
        return self.get(name)

    def get_program_value(self, name: str, default=None):
        return self.variable_program_values.get(name, default)

    def get_tokens(self, name: str):
        return self.variable_tokens.get(name)

    def get_diff(self, name: str, default=None):
        return self.variable_diffs.get(name, default)

    def final(self, name: str) -> str:
        """"fin" for a finished hole, "var" for one still growing (or unknown)."""
        return self.variable_monotonicity.get(name, "var")

    def __repr__(self) -> str:
        return f"ProgramState({self.variable_values!r})"


__all__ = ["ProgramState"]
