"""Output writers (LMQL's `output_writer=`): `lmql.printing`, `lmql.stream("VAR")`, `lmql.silent`,
`lmql.headless`, or any object with LMQL's `add_interpreter_head_state(...)` method; `TerminalWriter` is
`kvql run --stream`'s.

As LMQL does, kvql calls a writer after each generated token of a hole, with the prompt so far (the hole's
text included), `is_final=False` and the run's state with the hole growing (kvql.runtime.live: on the query's
event loop, never in the engine's; what happens when a writer is slow or raises), then once per finished run
of the query (once per sample) with the final prompt and variables, `is_final=True`. `is_valid` is always
True (kvql only returns values that satisfy their where clause). `program_variables.runtime.root_state
.query_head.result` is None until that last call, which has the run's result there.
"""

from __future__ import annotations

from .runtime import live
from .runtime.program_state import ProgramState


class BaseOutputWriter:
    """Writes nothing. `allows_input=False` (`lmql.headless`) also refuses `input()`."""

    def __init__(self, allows_input: bool = True):
        self.allows_input = allows_input

    async def input(self, *args) -> str:
        if not self.allows_input:
            raise RuntimeError("the output writer (lmql.headless) does not allow user input")
        return input(*args)

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables) -> None:
        pass

    def add_compiler_output(self, code) -> None:
        pass


class PrintingOutputWriter(BaseOutputWriter):
    """Prints each run's final prompt (`lmql.printing`)."""

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables) -> None:
        print(f"{prompt}\n\n valid={is_valid}, final={is_final}", flush=True)


class StreamingOutputWriter(BaseOutputWriter):
    """Prints the value of `variable` (a name, or a list of names, one per line) as it grows;
    without a variable, the prompt. `lmql.stream("ANSWER")` makes one."""

    def __init__(self, variable: str | list[str] | None = None):
        super().__init__()
        self.variable = variable
        self.last_value = ""

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables) -> None:
        if self.variable is None:
            print(prompt, flush=True)
            return
        names = self.variable if isinstance(self.variable, list) else [self.variable]
        value = "\n".join(str(program_variables.variable_values.get(v, "")).strip() for v in names)
        new = value[len(self.last_value):] if value.startswith(self.last_value) else value
        print(new, end="", flush=True)
        self.last_value = value


class TerminalWriter(BaseOutputWriter):
    """`kvql run --stream`'s output writer: the prompt on `out` as its holes fill, token by token, each piece
    written once (with several samples running at once, each one's prompt starts on a new line when it
    interleaves).

    A finished hole's value can differ from the text shown while it grew (`INT` strips ' 041' to 41, a stop
    phrase is cut off): the shown text then stands for the value, and writing goes on from the prompt after
    it, so the terminal never repeats the prompt (what the prompt holds is on stdout, in the result)."""

    def __init__(self, out):
        super().__init__()
        self.out, self.shown = out, ""
        self.hole: tuple[str, str] | None = None  # the hole last shown growing, and its text then

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables) -> None:
        self.out.write(self._unshown(prompt, program_variables) + ("\n" if is_final else ""))
        self.out.flush()
        if is_final:
            self.shown, self.hole = "", None
        else:
            self.shown, self.hole = prompt, (variable, str(program_variables.get(variable, "")))

    def _unshown(self, prompt: str, state) -> str:
        """The text to write for `prompt`: what it adds to the text shown; past a rewritten hole (class
        doc), what follows its value; else (another sample's prompt) all of it, on a new line."""
        if prompt.startswith(self.shown):
            return prompt[len(self.shown):]
        end = self._rewritten_hole_end(prompt, state)
        return prompt[end:] if end is not None else "\n" + prompt

    def _rewritten_hole_end(self, prompt: str, state) -> int | None:
        """Where, in `prompt`, the value of the hole last shown growing ends, when `prompt` is the shown text
        with that hole finished as a part of its shown text (a different sample's prompt is not); else None."""
        if self.hole is None:
            return None
        name, text = self.hole
        value = state.get(name)
        start = len(self.shown) - len(text)  # the shown text is the prompt before the hole, then `text`
        if value is None or state.final(name) != "fin" or str(value) not in text:
            return None
        if prompt[:start] != self.shown[:start] or not prompt.startswith(str(value), start):
            return None
        return start + len(str(value))


silent = BaseOutputWriter()
headless = BaseOutputWriter(allows_input=False)
printing = PrintingOutputWriter()
stream = StreamingOutputWriter


def check(writer) -> None:
    """Refuse, before a query runs, an `output_writer=` that is not one."""
    if writer is not None and not callable(getattr(writer, "add_interpreter_head_state", None)):
        raise TypeError(f"output_writer must have an add_interpreter_head_state method (e.g. lmql.printing, "
                        f"lmql.stream('VAR')), got {writer!r}")


async def report(writer, prompt: str, variables: dict, num_tokens: int, result=None) -> None:
    """Hand one finished run to `writer` (its method may be sync or async), with the run's `result`."""
    if writer is None:
        return
    last = next(reversed(variables), None) if variables else None
    await live.write(writer, last, prompt, ProgramState(prompt, variables, result=result), num_tokens, True)
