"""Query source text: its tokens, pieces of it with their positions, and errors pointing into it."""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass


class QuerySyntaxError(SyntaxError):
    """An error in query source; `lineno` / `offset` are 1-based line and column in the query."""

    def __init__(self, message: str, line: int, column: int, source: str = ""):
        text = source.splitlines()[line - 1] if source and 0 < line <= len(source.splitlines()) else ""
        super().__init__(f"{message} (query line {line}, column {column})", ("<query>", line, column, text))
        self.msg_only = message


@dataclass
class Span:
    """A piece of query text and where it lies: its first character at 1-based `line`, 0-based
    `col` of the query; its later lines start `indent` columns into theirs."""

    text: str
    line: int
    col: int
    indent: int = 0

    def at(self, line: int, col: int) -> tuple[int, int]:
        """(query line, 1-based query column) of 1-based `line`, 0-based character `col` in the text."""
        return self.line + line - 1, (self.col if line == 1 else self.indent) + col + 1

    def node_at(self, node) -> tuple[int, int]:
        """Position of an AST node parsed from the text (its col_offset counts UTF-8 bytes)."""
        line = self.text.split("\n")[node.lineno - 1]
        return self.at(node.lineno, len(line.encode()[:node.col_offset].decode(errors="ignore")))

    def lstrip(self) -> "Span":
        """The same text without leading whitespace and line continuations (`where \\`)."""
        text = self.text
        while text[:1].isspace() or text.startswith("\\\n"):
            text = text[2:] if text.startswith("\\\n") else text[1:]
        rows = self.text[:len(self.text) - len(text)].split("\n")
        line, col = self.line + len(rows) - 1, (self.col if len(rows) == 1 else self.indent) + len(rows[-1])
        return Span(text, line, col, self.indent)

    def strip(self) -> "Span":
        """`lstrip()`, also without trailing whitespace and line continuations."""
        span = self.lstrip()
        text = span.text.rstrip()
        while text.endswith("\\"):
            text = text[:-1].rstrip()
        return Span(text, span.line, span.col, span.indent)

    def error(self, message: str, line: int, col: int, source: str) -> QuerySyntaxError:
        return QuerySyntaxError(message, *self.at(line, col), source)


_PAIRS = {")": "(", "]": "[", "}": "{"}


def tokens(text: str):
    """Python's tokens of `text`; a bracket that is never closed, or closes nothing or the wrong
    one, raises TokenError(message, (row, col)) at that bracket, as Python's own parser reports it
    (tokenize alone would say "EOF in multi-line statement" at the end of the text)."""
    opened: list = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                opened.append(tok)
            elif tok.type == tokenize.OP and tok.string in _PAIRS:
                if not opened:
                    raise tokenize.TokenError(f"unmatched {tok.string!r}", tok.start)
                if opened[-1].string != _PAIRS[tok.string]:
                    raise tokenize.TokenError(f"closing parenthesis {tok.string!r} does not match opening "
                                              f"parenthesis {opened[-1].string!r}", tok.start)
                opened.pop()
            yield tok
    except tokenize.TokenError as e:
        if opened and "statement" in e.args[0]:
            raise tokenize.TokenError(f"{opened[-1].string!r} was never closed", opened[-1].start) from None
        raise


def logical_lines(text: str):
    """Yield (depth, tokens) per logical line: its block depth (counted from INDENT / DEDENT) and
    its significant tokens (no comments, newlines or indentation)."""
    line: list = []
    depth = 0
    for tok in tokens(text):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if line:
                yield depth, line
            line = []
        elif tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type not in (tokenize.NL, tokenize.COMMENT):
            line.append(tok)
