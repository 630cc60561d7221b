"""Parse the text of one prompt string into parts: literal text, `{expr}`, `[VAR]` holes, `{:role}` tags.

Syntax (LMQL's):
- `{expr}` interpolates a Python expression (with optional `!r`/`!s`/`!a` and `:format_spec`);
- `{{` / `}}` and `[[` / `]]` are literal braces and brackets;
- `[VAR]` is a hole the model fills; `[VAR: type]` a typed hole (`int`, or a nested query, possibly
  called: `[A: other_query(x)]`); `[@fn VAR]` post-processes the value with `fn` (several allowed);
- `{:system}`, `{:user}`, `{:assistant}` start a chat message of that role.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
_HOLE = re.compile(r"\s*((?:@[^\s\]]+\s+)*)([A-Za-z_]\w*)\s*(?::\s*(.+?))?\s*$", re.S)


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


def _scan_expr(s: str, i: int) -> int:
    """Index of the `}` closing the interpolation whose body starts at `i` (strings and nesting aware)."""
    start, depth, quote = i - 1, 0, None
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif s.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif c in "\"'":
            quote = s[i:i + 3] if s[i:i + 3] in ('"""', "'''") else c
            i += len(quote) - 1
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c == "}":
                    return i
                raise PromptSyntaxError(f"unbalanced {c!r} in interpolation", i)
            depth -= 1
        i += 1
    raise PromptSyntaxError("'{' is never closed (write '{{' for a literal brace)", start)


def _check_python(source: str, offset: int, what: str) -> None:
    """Raise PromptSyntaxError, at its offset in the prompt string, if `source` (which starts at
    `offset`) is not a Python expression; the compiled query wraps it in parentheses, and so does this."""
    try:
        ast.parse(f"({source})", mode="eval")
    except SyntaxError as e:
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
    _check_python(source, offset + len(body[:end]) - len(body[:end].lstrip()), "expression")
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
            end = s.find("]", i + 1)
            depth = s.count("[", i + 1, end if end >= 0 else len(s))
            while end >= 0 and depth:  # nested brackets inside a hole's type, e.g. q(x[0])
                end, depth = s.find("]", end + 1), depth - 1
            if end < 0:
                raise PromptSyntaxError("'[' is never closed (write '[[' for a literal bracket)", i)
            m = _HOLE.match(s[i + 1:end])
            if not m:
                raise PromptSyntaxError(f"invalid hole [{s[i + 1:end]}]: expected [NAME], [NAME: type] or "
                                        "[@fn NAME] (write '[[' for a literal bracket)", i)
            for d in re.finditer(r"@(\S+)", m.group(1)):
                _check_python(d.group(1), i + 1 + m.start(1) + d.start(1), "post-processor")
            if m.group(3):
                _check_python(m.group(3), i + 1 + m.start(3), "hole type")
            flush()
            decorators = [d[1:] for d in m.group(1).split()]
            parts.append(Hole(m.group(2), m.group(3), decorators, i))
            i = end + 1
        elif c in "}]":
            raise PromptSyntaxError(f"single {c!r} (write {c * 2!r} for a literal one)", i)
        else:
            buf.append(c)
            i += 1
    flush()
    return parts
