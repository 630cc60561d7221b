"""Split a query into its clauses, for both of LMQL's layouts.

    [prologue]  [decoder[(kwargs)]]  body  [from MODEL]  [where COND]  [distribution VAR in VALUES]

- The decoder clause (`argmax`, `sample(n=2)`, `beam(n=n)`, ...) opens at the start of a line (at
  any indentation, as LMQL finds it by its tokens) before the first prompt statement, and is followed
  by the end of its line or by a prompt string (the one-line form: `argmax "Hi [X]" where len(X) < 9
  from "m"`). Python lines before it are the prologue, run at module level as in LMQL (their names
  are the query's globals).
- `from`, `where` and `distribution` (any case) end the body where they start a line, at any
  indentation (`from` not as an import, `where` / `distribution` not as a name being assigned or read), and
  `from` also after a prompt string on its line (the one-line form). A `where` or `distribution`
  after a prompt string on its line belongs to that statement. Each clause runs to the next clause
  keyword: on its own line, on indented lines below it, or continued with `\\`.
"""

from __future__ import annotations

import tokenize
from dataclasses import dataclass

from .source import QuerySyntaxError, Span, logical_lines

# LMQL 0.7.3's decoder names (lmql.runtime.dclib): all of them open a decoder clause; which ones
# run is up to the runtime
DECODERS = ("argmax", "sample", "beam", "beam_search", "beam_sample", "beam_var", "var", "best_k")
CLAUSES = ("from", "where", "distribution")


@dataclass
class Body:
    """The query body, dedented: row 1 starts `first_col` columns into query line `line` (the rest
    of the decoder's line, in the one-line form), later rows `col` columns into theirs."""

    text: str
    line: int
    first_col: int
    col: int

    def at(self, row: int, col: int) -> tuple[int, int]:
        """(query line, 1-based query column) of 1-based `row`, 0-based `col` of the body text."""
        return self.line + row - 1, (self.first_col if row == 1 else self.col) + col + 1


@dataclass
class Layout:
    prologue: Span | None        # Python statements before the decoder clause
    decoder: str | None          # the decoder's name, lowercased
    decoder_args: Span | None    # "(n=2, ...)" after it
    body: Body
    model: Span | None           # the text after `from`, `where`, `distribution`
    where: Span | None
    distribution: Span | None


def starts_scope(toks) -> bool:
    """A `def`, `async def` or `class` line: the block below it is plain Python, not the query's own."""
    return toks[0].string in ("def", "class") or (toks[0].string == "async" and len(toks) > 1
                                                  and toks[1].string == "def")


def _closing(toks, k: int) -> int:
    """Index of the bracket closing the one at `toks[k]` (brackets balance within a logical line)."""
    depth = 0
    for i in range(k, len(toks)):
        if toks[i].type == tokenize.OP and toks[i].string in "([{":
            depth += 1
        elif toks[i].type == tokenize.OP and toks[i].string in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(toks) - 1


def _decoder_end(toks) -> int | None:
    """If this logical line opens with a decoder clause, the index of the first token after it."""
    if toks[0].type != tokenize.NAME or toks[0].string.lower() not in DECODERS:
        return None
    k = 1
    if k < len(toks) and toks[k].type == tokenize.OP and toks[k].string == "(":
        k = _closing(toks, k) + 1
    if k < len(toks) and toks[k].string == ":":
        k += 1
    return k if k == len(toks) or toks[k].type == tokenize.STRING else None


def _opens_clause(toks, i: int, in_body: bool, first_in_line: bool) -> bool:
    """Whether NAME token `toks[i]` (at bracket depth 0) is a clause keyword."""
    kw = toks[i].string.lower()
    if kw not in CLAUSES:
        return False
    if not in_body:  # inside a clause, the others' keywords cannot be part of its expression
        return True
    at_line_start = i == 0 and first_in_line  # at any indentation: LMQL finds clauses by their tokens
    if kw == "from":
        if at_line_start:
            return not any(t.type == tokenize.NAME and t.string == "import" for t in toks)
        return toks[0].type == tokenize.STRING  # `"Hi [X]" from "m"`; never `yield from`, `raise .. from`
    nxt = toks[i + 1] if i + 1 < len(toks) else None
    return at_line_start and not (nxt is not None and nxt.type == tokenize.OP and nxt.string not in "([{-~")


def _text(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return "\n".join([lines[r0 - 1][c0:]] + lines[r0:r1 - 1] + [lines[r1 - 1][:c1]])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _body(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> Body:
    if start >= end:  # a decoder clause and nothing after it
        return Body("", min(start[0], len(lines)), 0, 0)
    rows = _text(lines, start, end).split("\n")
    rest = rows if start[1] == 0 else rows[1:]
    d = min((_indent(r) for r in rest if r.strip()), default=0)
    out = [r[d:] if r.strip() else "" for r in rest]
    if start[1]:
        out.insert(0, rows[0])
    return Body("\n".join(out), start[0], start[1] or d, d)


def split_clauses(source: str) -> Layout:
    """The clauses of `source` (see the module docstring); token errors raise QuerySyntaxError."""
    lines = source.split("\n")
    try:
        with_depth = list(logical_lines(source))
    except tokenize.TokenError as e:
        raise QuerySyntaxError(e.args[0], e.args[1][0], e.args[1][1] + 1, source) from None
    except IndentationError as e:
        raise QuerySyntaxError(e.msg, e.lineno or 1, max(e.offset or 1, 1), source) from None

    logical = [toks for _, toks in with_depth]
    first, decoder_end = _decoder_line(with_depth)
    decoder = args = prologue = None
    start = (1, 0)
    if first is not None:
        toks = logical[first]
        decoder = toks[0].string.lower()
        if decoder_end > 1 and toks[1].string == "(":
            args = Span(_text(lines, toks[1].start, toks[_closing(toks, 1)].end), *toks[1].start)
        row = toks[0].start[0]
        if row > 1:
            prologue = Span("\n".join(lines[:row - 1]), 1, 0)
        if decoder_end < len(toks):
            start = toks[decoder_end].start
        else:
            start = (toks[-1].end[0] + 1, 0)
        logical = [toks[decoder_end:]] + logical[first + 1:] if decoder_end < len(toks) else logical[first + 1:]

    found = _keywords(logical, start, source)
    end_of_source = (len(lines), len(lines[-1]))
    body_end = found[0][1].start if found else end_of_source
    clauses = {}
    for k, (kw, tok) in enumerate(found):
        stop = found[k + 1][1].start if k + 1 < len(found) else end_of_source
        clauses[kw] = Span(_text(lines, tok.end, stop), *tok.end)
    return Layout(prologue, decoder, args, _body(lines, start, body_end),
                  clauses.get("from"), clauses.get("where"), clauses.get("distribution"))


def _decoder_line(with_depth: list) -> tuple[int | None, int | None]:
    """(index of the decoder's logical line, of its first token after the decoder), or (None, None): a decoder
    is looked for before the first prompt statement or clause, past the prologue's def / class blocks."""
    first = decoder_end = None  # index of the decoder's logical line, and of its first token after it
    nested_at = None  # block depth of a def / class of the prologue, whose lines are skipped
    for n, (depth, toks) in enumerate(with_depth):
        if nested_at is not None and depth > nested_at:
            continue
        nested_at = depth if starts_scope(toks) else None
        if toks[0].type == tokenize.STRING:  # a prompt statement: the body has begun
            break
        if _opens_clause(toks, 0, True, True):
            break
        decoder_end = _decoder_end(toks)
        if decoder_end is not None:
            first = n
            break
    return first, decoder_end


def _keywords(logical: list, start: tuple[int, int], source: str) -> list:
    """The clauses' keywords at bracket depth 0, in order: `(keyword, token)`; QuerySyntaxError for a second one
    of a kind."""
    found: list = []  # (clause, keyword token), in order
    for n, toks in enumerate(logical):
        depth = 0
        for i, tok in enumerate(toks):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif depth == 0 and tok.type == tokenize.NAME and \
                    _opens_clause(toks, i, not found, not (n == 0 and start[1])):
                kw = tok.string.lower()
                if any(k == kw for k, _ in found):
                    raise QuerySyntaxError(f"a second '{kw}' clause", tok.start[0], tok.start[1] + 1, source)
                found.append((kw, tok))
    return found
