"""Prompt statements: the statements of a query body made only of string literals (optionally followed by
`where` and `distribution`), found in the body (`find_statements`) and rewritten, on their own first line,
into calls on the runtime context `__ctx` (`statement_code`): `text`, `role`, `hole`, `nested`,
`distribution`.
"""

from __future__ import annotations

import ast
import re
import tokenize
from dataclasses import dataclass

from .clauses import Body, starts_scope
from .prompt_string import Expr, Hole, PromptSyntaxError, Role, Text, parse_prompt
from .source import QuerySyntaxError, Span, logical_lines
from .where import conjunction, distribution_clause


# one escape sequence (or character) of a string literal's body
_UNIT = re.compile(r"\\(?:\n|N\{[^}]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|.)|.", re.S)


def _without_blank_lines(s: str) -> tuple[str, list[int]]:
    """A string token's source with its blank (empty or whitespace-only) lines removed, and where each
    kept character is in `s`. LMQL's compiler drops them: a triple-quoted `A`, blank line, `B` is the
    prompt "A" newline "B" (measured against LMQL 0.7.3; an escaped newline is kept)."""
    kept, where, at = [], [], 0
    for k, line in enumerate(s.split("\n")):
        if k and line.strip() == "":
            at += len(line) + 1
            continue
        piece = ("\n" if k else "") + line
        start = at - 1 if k else at
        kept.append(piece)
        where += range(start, start + len(piece))
        at += len(line) + 1
    return "".join(kept), where


def _char_positions(toks) -> list[tuple[int, int]]:
    """(row, col) in the body of each character of the value of these adjacent string tokens, and
    one more for the end, so that an error at an offset of the value points at its source."""
    out = []
    for tok in toks:
        s, source_index = _without_blank_lines(tok.string)
        prefix = re.match(r"[A-Za-z]*", s).group(0)
        quote = 3 if s[len(prefix):len(prefix) + 3] in ('"""', "'''") else 1
        at, (row, col) = [], tok.start
        for c in tok.string:
            at.append((row, col))
            row, col = (row + 1, 0) if c == "\n" else (row, col + 1)
        where = [at[i] for i in source_index]
        start = len(prefix) + quote
        body = s[start:len(s) - quote]
        units = re.finditer(".", body, re.S) if "r" in prefix.lower() else _UNIT.finditer(body)
        for u in units:
            text = u.group(0)
            n = 0 if text == "\\\n" else 2 if text[0] == "\\" and text[1] not in "\\'\"abfnrtvxuUN01234567" else 1
            out += [where[start + u.start()]] * n
        end = tok.end
    return out + [end]


def _string_value(tok) -> str:
    s = _without_blank_lines(tok.string)[0]
    prefix = re.match(r"[A-Za-z]*", s).group(0)
    if "b" in prefix.lower():
        raise ValueError("byte strings cannot be prompts")
    return ast.literal_eval(prefix.replace("f", "").replace("F", "") + s[len(prefix):])


@dataclass
class Statement:
    first: int                    # 1-based line in the body
    last: int
    indent: str
    parts: list
    where: Span | None
    distribution: tuple[str, str] | None  # (VAR, values source)


def find_statements(body: Body, source: str) -> list[Statement]:
    """The prompt statements of the query body: lines of its own made of string literals (and
    their `where` / `distribution`); the bodies of functions and classes defined in it are skipped."""
    text = body.text
    offsets = [0]
    for line in text.split("\n"):
        offsets.append(offsets[-1] + len(line) + 1)

    def text_between(a, b):
        return text[offsets[a[0] - 1] + a[1]:offsets[b[0] - 1] + b[1]]

    def error(message, row, col):  # row, col: 1-based line, 0-based column of the body
        return QuerySyntaxError(message, *body.at(row, col), source)

    def span(start, end):
        line, col = body.at(*start)
        return Span(text_between(start, end), line, col - 1, body.col)

    out = []
    nested_at = None  # block depth of the def / class whose body is being skipped
    try:
        for depth, toks in logical_lines(text):
            if nested_at is not None and depth > nested_at:
                continue
            nested_at = depth if starts_scope(toks) else None
            k = 0
            while k < len(toks) and toks[k].type == tokenize.STRING:
                k += 1
            if k == 0:
                continue
            rest = toks[k:]
            if rest and not (rest[0].type == tokenize.NAME and rest[0].string in ("where", "distribution")):
                continue  # a Python expression that merely starts with a string
            try:
                value = "".join(_string_value(t) for t in toks[:k])
            except (ValueError, SyntaxError) as e:
                raise error(f"in prompt string: {e}", *toks[0].start) from None
            try:
                parts = parse_prompt(value)
            except PromptSyntaxError as e:
                raise error(f"in prompt string: {e}", *_char_positions(toks[:k])[e.offset]) from None
            where = distribution = None
            if rest:
                dist_at = next((i for i, t in enumerate(rest) if t.type == tokenize.NAME
                                and t.string == "distribution"), len(rest))
                if rest[0].string == "where":
                    where = span(rest[0].end, rest[dist_at].start if dist_at < len(rest) else rest[-1].end)
                if dist_at < len(rest):
                    distribution = distribution_clause(span(rest[dist_at].end, rest[-1].end), source)
            line_text = text.split("\n")[toks[0].start[0] - 1]
            out.append(Statement(toks[0].start[0], toks[-1].end[0],
                                  line_text[:len(line_text) - len(line_text.lstrip())], parts, where,
                                  distribution))
    except tokenize.TokenError as e:
        raise error(e.args[0], *e.args[1]) from None
    except IndentationError as e:
        raise error(e.msg, e.lineno or 1, max((e.offset or 1) - 1, 0)) from None
    return out


def one_line(src: str) -> str:
    """A Python expression's source on one line (prompt statements must keep their line count)."""
    return ast.unparse(ast.parse(f"({src})", mode="eval").body)


def _is_regex(type_source: str) -> bool:
    """`[V: r'[0-9]+']`: a string literal as a hole's tactic is a regex it must match (LMQL's)."""
    t = ast.parse(f"({type_source})", mode="eval").body
    return isinstance(t, ast.Constant) and isinstance(t.value, str)


def _hole_call(h: Hole, dist: tuple[str, str] | None, constraint: str) -> str:
    if dist and dist[0] == h.name:
        return f"{h.name} = await __ctx.distribution({h.name!r}, {dist[1]})"
    post = "[" + ", ".join(one_line(d) for d in h.decorators) + "]"
    if h.type_source and not _is_regex(h.type_source):
        t = ast.parse(f"({h.type_source})", mode="eval").body
        if isinstance(t, ast.Call):
            args = ", ".join([ast.unparse(a) for a in t.args])
            kwargs = ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in t.keywords)
            return (f"{h.name} = await __ctx.nested({h.name!r}, {ast.unparse(t.func)}, ({args}{',' if args else ''}), "
                    f"{{{kwargs}}}, post={post}, constraint={constraint})")
        return f"{h.name} = await __ctx.hole({h.name!r}, {constraint}, type={ast.unparse(t)}, post={post})"
    return f"{h.name} = await __ctx.hole({h.name!r}, {constraint}, post={post})"


def statement_code(st: Statement, where: ast.expr | None) -> str:
    """The statement as one line of calls on `__ctx`; `where` is the IR expression of its constraint."""
    calls = [f"__c = {ast.unparse(where) if where is not None else None}"]
    for p in st.parts:
        if isinstance(p, Text):
            calls.append(f"await __ctx.text({p.text!r})")
        elif isinstance(p, Expr):
            calls.append(f"await __ctx.text(__ctx.fmt(({one_line(p.source)}), {p.conversion!r}, {p.spec!r}))")
        elif isinstance(p, Role):
            calls.append(f"await __ctx.role({p.role!r})")
        elif p.type_source and _is_regex(p.type_source):
            regex = ast.parse(f"__C.REGEX(__C.Var({p.name!r}), {one_line(p.type_source)})", mode="eval").body
            own = ast.unparse(conjunction(([where] if where is not None else []) + [regex]))
            calls.append(_hole_call(p, st.distribution, own))
        else:
            calls.append(_hole_call(p, st.distribution, "__c"))
    return st.indent + "; ".join(calls)

