"""Parse the text of one prompt string into parts: literal text, `{expr}`, `[VAR]` holes, `{:role}` tags.

Syntax (LMQL's):
- `{expr}` interpolates a Python expression (with optional `!r`/`!s`/`!a` and `:format_spec`);
- `{{` / `}}` and `[[` / `]]` are literal braces and brackets;
- `[VAR]` is a hole the model fills; `[VAR: tactic]` a typed hole (`int`, a regex as a string literal
  `[D: r'[0-9]+']`, or a nested query, possibly called: `[A: other_query(x)]`); `[@fn VAR]`
  post-processes the value with `fn` (several allowed; any Python expression, `[@prefix('A: ') X]`);
- `{:system}`, `{:user}`, `{:assistant}` start a chat message of that role.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from .clauses import DECODERS

ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[A-Za-z_]\w*")


class PromptSyntaxError(ValueError):
    """An error in a prompt string; `offset` is the index in the string's value where it is."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


@dataclass
class Text:
    text: str


@dataclass
class Expr:
    source: str          # a Python expression
    conversion: str = ""  # "r", "s", "a" or ""
    spec: str = ""


@dataclass
class Hole:
    name: str
    type_source: str | None = None         # Python source after ":" (int, a query, a query call)
    decorators: list[str] = field(default_factory=list)  # Python sources of the @fn post-processors
    offset: int = 0


@dataclass
class Role:
    role: str


def _scan(s: str, i: int, stop) -> int:
    """Index of the first character at or after `i` for which `stop(c)` holds outside quotes and
    brackets (len(s) if none). A bracket closing one not opened here raises PromptSyntaxError."""
    depth, quote = 0, None
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif s.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif depth == 0 and stop(c):
            return i
        elif c in "\"'":
            quote = s[i:i + 3] if s[i:i + 3] in ('"""', "'''") else c
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                raise PromptSyntaxError(f"unbalanced {c!r}", i)
            depth -= 1
        i += 1
    return len(s)


def _scan_expr(s: str, i: int) -> int:
    """Index of the `}` closing the interpolation whose body starts at `i` (strings and nesting aware)."""
    try:
        end = _scan(s, i, lambda c: c == "}")
    except PromptSyntaxError as e:
        raise PromptSyntaxError(f"{e} in interpolation", e.offset) from None
    if end == len(s):
        raise PromptSyntaxError("'{' is never closed (write '{{' for a literal brace)", i - 1)
    return end


def _parse_hole(s: str, start: int, end: int) -> Hole:
    """The hole `s[start:end]` (between its brackets): `[@dec ... NAME]` or `[@dec ... NAME: tactic]`."""
    body, i, decorators = s[start:end], 0, []

    def skip_space(i):
        while i < len(body) and body[i].isspace():
            i += 1
        return i

    def invalid():
        return PromptSyntaxError(f"invalid hole [{body}]: expected [NAME], [NAME: type] or [@fn NAME] "
                                 "(write '[[' for a literal bracket)", start - 1)

    i = skip_space(i)
    while body.startswith("@", i):  # a decorator is a Python expression, up to a space outside brackets
        stop = _scan(body, i + 1, str.isspace)
        decorators.append(_check_python(body[i + 1:stop], start + i + 1, "decorator"))
        i = skip_space(stop)
    m = _NAME.match(body, i)
    if not m:
        raise invalid()
    rest = skip_space(m.end())
    if rest < len(body) and body[rest] == "(" or rest > m.end() and _NAME.match(body, rest):
        if m.group(0) in DECODERS:
            raise PromptSyntaxError(f"[{body}]: a decoder for one variable is not supported by kvql; set the "
                                    "decoder of the whole query", start - 1)
        raise invalid()
    if rest == len(body):
        return Hole(m.group(0), None, decorators, start - 1)
    if body[rest] != ":":
        raise invalid()
    tactic = body[rest + 1:].strip()
    if not tactic:
        raise invalid()
    at = start + rest + 1 + len(body[rest + 1:]) - len(body[rest + 1:].lstrip())
    return Hole(m.group(0), _check_python(tactic, at, "hole type"), decorators, start - 1)


def _check_python(source: str, offset: int, what: str) -> str:
    """`source` (which starts at `offset` of the prompt string) as a Python expression, or
    PromptSyntaxError at its offset; the compiled query wraps it in parentheses, and so does this.
    A newline inside one of its string literals came from a `\\n` escape of the prompt string
    itself (`[X: q(s='a\\nb')]`): it is escaped again, as the writer meant."""
    try:
        ast.parse(f"({source})", mode="eval")
        return source
    except SyntaxError as e:
        escaped = source.replace("\n", "\\n")
        if escaped != source:
            try:
                ast.parse(f"({escaped})", mode="eval")
                return escaped
            except SyntaxError:
                pass
        at = offset + max((e.offset or 1) - 2, 0) if (e.lineno or 1) == 1 else offset
        raise PromptSyntaxError(f"invalid {what} {source!r}: {e.msg}", min(at, offset + len(source))) from None


def _split_expr(body: str, offset: int) -> Expr:
    """`body` of a `{...}` interpolation that starts at `offset` of the prompt string."""
    depth, quote, i = 0, None, 0
    conv_at = spec_at = None
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "!" and body[i + 1:i + 2] != "=":
            if not (body[i + 1:i + 2] in ("r", "s", "a") and body[i + 2:i + 3] in ("", ":")):
                bad = re.match(r"![^:]*", body[i:]).group(0)
                raise PromptSyntaxError(f"invalid conversion {bad!r} in {{{body}}}: use !r, !s or !a", offset + i)
            conv_at = i
        elif depth == 0 and c == ":" and spec_at is None:
            spec_at = i
            break
        i += 1
    end = conv_at if conv_at is not None else spec_at if spec_at is not None else len(body)
    source = body[:end].strip()
    source = _check_python(source, offset + len(body[:end]) - len(body[:end].lstrip()), "expression")
    return Expr(source, body[conv_at + 1] if conv_at is not None else "",
                body[spec_at + 1:] if spec_at is not None else "")


def parse_prompt(s: str) -> list[Text | Expr | Hole | Role]:
    parts: list = []
    buf: list[str] = []
    i = 0

    def flush():
        if buf:
            parts.append(Text("".join(buf)))
            buf.clear()

    while i < len(s):
        c = s[i]
        if s.startswith("{{", i) or s.startswith("}}", i) or s.startswith("[[", i) or s.startswith("]]", i):
            buf.append(c)
            i += 2
        elif c == "{":
            end = _scan_expr(s, i + 1)
            body = s[i + 1:end]
            flush()
            if body.startswith(":"):
                role = body[1:].strip()
                if role not in ROLES:
                    raise PromptSyntaxError(f"unknown role tag {{:{role}}}; use one of {', '.join(ROLES)}", i)
                parts.append(Role(role))
            elif not body.strip():
                raise PromptSyntaxError("empty interpolation '{}' (write '{{}}' for literal braces)", i)
            else:
                parts.append(_split_expr(body, i + 1))
            i = end + 1
        elif c == "[":
            try:
                end = _scan(s, i + 1, lambda ch: ch == "]")
            except PromptSyntaxError:
                end = len(s)
            if end == len(s):
                raise PromptSyntaxError("'[' is never closed (write '[[' for a literal bracket)", i)
            hole = _parse_hole(s, i + 1, end)
            flush()
            parts.append(hole)
            i = end + 1
        elif c in "}]":
            raise PromptSyntaxError(f"single {c!r} (write {c * 2!r} for a literal one)", i)
        else:
            buf.append(c)
            i += 1
    flush()
    return parts
