"""Compile LMQL query source into a Python coroutine function over a runtime context.

Accepted forms (LMQL's):
- modern: an optional decoder clause on the first line (`argmax`, `sample(n=2, temperature=0.8)`,
  `beam(n=3)`), then Python statements and prompt statements with inline `where` / `distribution`;
- standalone: `decoder` / indented body / `from "model"` / `where ...` / `distribution VAR in [...]`
  (clause keywords case-insensitive).

A prompt statement is a line made only of string literals, optionally followed by `where COND` and
`distribution VAR in VALUES`. It is rewritten, on its own first line so that line numbers stay those
of the query, into calls on the runtime context `__ctx`: `text`, `role`, `hole`, `nested`,
`distribution`. Everything else is ordinary Python, run as is (the body becomes the body of an
`async def`, so `await` and `return` work).
"""

from __future__ import annotations

import ast
import io
import linecache
import re
import textwrap
import threading
import tokenize
from dataclasses import dataclass, field

from ..runtime.constraints import BUILDERS
from .prompt_string import Expr, Hole, PromptSyntaxError, Role, Text, parse_prompt

DECODERS = ("argmax", "sample", "beam")
_DECODER_LINE = re.compile(r"^(argmax|sample|beam)\s*(\(.*\))?\s*:?\s*$", re.I | re.S)
_CLAUSE = re.compile(r"^(from|where|distribution)\b(?!\s*[=.(\[])(.*)$", re.I | re.S)
_counter = iter(range(1, 1 << 62))


class QuerySyntaxError(SyntaxError):
    """An error in query source; `lineno` / `offset` are 1-based line and column in the query."""

    def __init__(self, message: str, line: int, column: int, source: str = ""):
        text = source.splitlines()[line - 1] if source and 0 < line <= len(source.splitlines()) else ""
        super().__init__(f"{message} (query line {line}, column {column})", ("<query>", line, column, text))
        self.msg_only = message


@dataclass
class Decoder:
    name: str = "argmax"
    kwargs: dict = field(default_factory=dict)


@dataclass
class CompiledQuery:
    code: object                # code object of a module defining `__kvql_query__(__ctx, __args)`
    params: list[str]
    decoder: Decoder | None
    model: str | None
    holes: list[str]
    returns: bool               # the body has a `return`
    source: str


def _strip_marker(source: str) -> str:
    source = textwrap.dedent(source)
    lines = source.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and lines[0].strip() == "lmql":  # docstrings written '''lmql ...'''
        lines.pop(0)
    return textwrap.dedent("\n".join(lines))


def _parse_decoder(line: str, lineno: int, source: str) -> Decoder:
    m = _DECODER_LINE.match(line.strip())
    name, args = m.group(1).lower(), m.group(2)
    kwargs = {}
    if args:
        try:
            call = ast.parse(f"f{args}", mode="eval").body
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            if call.args:
                raise ValueError("decoder arguments must be keywords, e.g. sample(n=2)")
        except (SyntaxError, ValueError) as e:
            raise QuerySyntaxError(f"invalid decoder clause {line.strip()!r}: {e}", lineno, 1, source) from None
    return Decoder(name, kwargs)


def split_clauses(source: str):
    """-> (decoder, body, body_first_line, body_indent, model, where, distribution) for either form."""
    lines = source.split("\n")
    i = 0
    while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
        i += 1
    decoder = None
    if i < len(lines) and _DECODER_LINE.match(lines[i].strip()):
        decoder = _parse_decoder(lines[i], i + 1, source)
        i += 1
    start = i
    model = where = distribution = None
    end = len(lines)
    j = start
    while j < len(lines):
        line = lines[j]
        m = _CLAUSE.match(line) if line[:1] not in (" ", "\t") else None
        if m and not (m.group(1).lower() == "from" and re.match(r"\s*[\w.]+\s+import\b", m.group(2))):
            end = min(end, j)
            kind = m.group(1).lower()
            k = j + 1
            while k < len(lines) and (not lines[k].strip() or lines[k][:1] in (" ", "\t")):
                k += 1
            text = (m.group(2) + "\n" + "\n".join(lines[j + 1:k])).strip()
            if kind == "from":
                try:
                    model = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    raise QuerySyntaxError(f"'from' needs a model name in quotes, got {text!r}", j + 1, 1,
                                           source) from None
            elif kind == "where":
                where = _Span(m.group(2) + "\n" + "\n".join(lines[j + 1:k]), j + 1, m.start(2), 0)
            else:
                distribution = (text, j + 1)
            j = k
            continue
        j += 1
    body_lines = lines[start:end]
    body = textwrap.dedent("\n".join(body_lines))
    indent = 0
    for raw, ded in zip(body_lines, body.split("\n")):
        if raw.strip():
            indent = len(raw) - len(ded)
            break
    return decoder, body, start + 1, indent, model, where, distribution


# -- where clauses -------------------------------------------------------------------------------
@dataclass
class _Span:
    """A piece of query text (a where clause) and where it lies: its first character at 1-based
    `line`, 0-based `col` of the query; its later lines start `indent` columns into theirs."""

    text: str
    line: int
    col: int
    indent: int

    def at(self, line: int, col: int) -> tuple[int, int]:
        """(query line, 1-based query column) of 1-based `line`, 0-based character `col` in the text."""
        return self.line + line - 1, (self.col if line == 1 else self.indent) + col + 1

    def node_at(self, node: ast.AST) -> tuple[int, int]:
        """Position of an AST node parsed from the text (its col_offset counts UTF-8 bytes)."""
        line = self.text.split("\n")[node.lineno - 1]
        return self.at(node.lineno, len(line.encode()[:node.col_offset].decode(errors="ignore")))

    def lstrip(self) -> "_Span":
        """The same text without leading whitespace (which `ast.parse(..., mode="eval")` refuses)."""
        lead = self.text[:len(self.text) - len(self.text.lstrip())]
        rows = lead.split("\n")
        line, col = self.line + len(rows) - 1, (self.col if len(rows) == 1 else self.indent) + len(rows[-1])
        return _Span(self.text[len(lead):], line, col, self.indent)


class _NodeError(ValueError):
    """An error about one node of a where clause; the caller turns it into a positioned QuerySyntaxError."""

    def __init__(self, message: str, node: ast.AST):
        super().__init__(message)
        self.node = node


class _WhereRewriter(ast.NodeTransformer):
    """Turn a where expression into code that builds the constraint IR (see runtime.constraints)."""

    def __init__(self, holes: set[str]):
        self.holes = holes

    @staticmethod
    def _c(name: str) -> ast.expr:
        return ast.Attribute(ast.Name("__C", ast.Load()), name, ast.Load())

    def visit_Name(self, node):
        if node.id in self.holes:
            return ast.Call(self._c("Var"), [ast.Constant(node.id)], [])
        if node.id in BUILDERS:
            return self._c(node.id)
        return node

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "len":
            return ast.Call(self._c("LEN"), [self.visit(a) for a in node.args], [])
        if isinstance(node.func, ast.Name) and node.func.id.isupper() and node.func.id not in BUILDERS \
                and any(isinstance(a, ast.Name) and a.id in self.holes for a in node.args):
            raise _NodeError(f"unknown constraint {node.func.id}(); kvql knows "
                             f"{', '.join(sorted(BUILDERS))}, len(), in, ==, <, >, and, or, not", node)
        return self.generic_visit(node)

    def visit_BoolOp(self, node):
        fn = "AND" if isinstance(node.op, ast.And) else "OR"
        return ast.Call(self._c(fn), [self.visit(v) for v in node.values], [])

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            return ast.Call(self._c("NOT"), [self.visit(node.operand)], [])
        return self.generic_visit(node)

    def visit_Compare(self, node):
        names = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
        left, parts = self.visit(node.left), []
        for op, right in zip(node.ops, node.comparators):
            right = self.visit(right)
            if isinstance(op, (ast.In, ast.NotIn)):
                args = [left, right] + ([ast.Constant(True)] if isinstance(op, ast.NotIn) else [])
                parts.append(ast.Call(self._c("IN"), args, []))
            elif type(op) in names:
                parts.append(ast.Call(self._c("CMP"), [ast.Constant(names[type(op)]), left, right], []))
            else:
                parts.append(ast.Compare(left, [op], [right]))
            left = right
        return parts[0] if len(parts) == 1 else ast.Call(self._c("AND"), parts, [])


def _where_code(span: _Span, holes: set[str], source: str) -> str:
    """Python source building the IR of the where clause in `span`; errors point into the query."""
    span = _Span(span.text.rstrip(), span.line, span.col, span.indent).lstrip()
    try:
        for _ in _tokens(span.text):
            pass
    except tokenize.TokenError as e:
        (row, col) = e.args[1]
        raise QuerySyntaxError(f"invalid where clause: {e.args[0]}", *span.at(row, col), source) from None
    except IndentationError:
        pass  # indentation does not matter inside the brackets added below
    try:
        # in brackets, so that a standalone `where` clause may continue on following lines
        tree = ast.parse(f"({span.text}\n)", mode="eval")
    except SyntaxError as e:
        lines = span.text.split("\n")
        row, col = e.lineno or 1, (e.offset or 1) - 1 - ((e.lineno or 1) == 1)
        if row > len(lines):  # at the closing bracket added above: the clause ended too early
            row, col = len(lines), len(lines[-1])
        raise QuerySyntaxError(f"invalid where clause: {e.msg}", *span.at(row, max(col, 0)), source) from None
    for node in ast.walk(tree):  # positions as in the text itself, without the added bracket
        if getattr(node, "lineno", None) == 1:
            node.col_offset -= 1
        if getattr(node, "end_lineno", None) == 1:
            node.end_col_offset -= 1
    try:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BUILDERS:
                fn = node.func.id
                for a in node.args[:1]:
                    if isinstance(a, ast.Name) and a.id not in holes:
                        raise _NodeError(f"{fn}({a.id}, ...): no prompt here generates a variable named {a.id}", a)
                if fn in ("STOPS_AT", "STOPS_BEFORE") and len(node.args) > 1 \
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value == "":
                    raise _NodeError(f'{fn}({ast.unparse(node.args[0])}, ""): the stop phrase is empty',
                                     node.args[1])
        out = _WhereRewriter(holes).visit(tree)
    except _NodeError as e:
        raise QuerySyntaxError(str(e), *span.node_at(e.node), source) from None
    return ast.unparse(ast.fix_missing_locations(out))


# -- prompt statements ---------------------------------------------------------------------------
_PAIRS = {")": "(", "]": "[", "}": "{"}


def _tokens(text: str):
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


def _logical_lines(body: str):
    """Yield lists of significant tokens, one list per logical line."""
    line: list = []
    for tok in _tokens(body):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if line:
                yield line
            line = []
        elif tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            line.append(tok)


# one escape sequence (or character) of a string literal's body
_UNIT = re.compile(r"\\(?:\n|N\{[^}]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|.)|.", re.S)


def _char_positions(toks) -> list[tuple[int, int]]:
    """(row, col) in the body of each character of the value of these adjacent string tokens, and
    one more for the end, so that an error at an offset of the value points at its source."""
    out = []
    for tok in toks:
        s = tok.string
        prefix = re.match(r"[A-Za-z]*", s).group(0)
        quote = 3 if s[len(prefix):len(prefix) + 3] in ('"""', "'''") else 1
        where, (row, col) = [], tok.start
        for c in s:
            where.append((row, col))
            row, col = (row + 1, 0) if c == "\n" else (row, col + 1)
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
    s = tok.string
    prefix = re.match(r"[A-Za-z]*", s).group(0)
    if "b" in prefix.lower():
        raise ValueError("byte strings cannot be prompts")
    return ast.literal_eval(prefix.replace("f", "").replace("F", "") + s[len(prefix):])


@dataclass
class _Statement:
    first: int                    # 1-based line in the body
    last: int
    indent: str
    parts: list
    where: _Span | None
    distribution: tuple[str, str] | None  # (VAR, values source)


def _find_statements(body: str, source: str, line0: int, col0: int) -> list[_Statement]:
    offsets = [0]
    for line in body.split("\n"):
        offsets.append(offsets[-1] + len(line) + 1)

    def text_between(a, b):
        return body[offsets[a[0] - 1] + a[1]:offsets[b[0] - 1] + b[1]]

    def error(message, row, col):  # row, col: 1-based line, 0-based column of the body
        return QuerySyntaxError(message, row + line0 - 1, col + col0 + 1, source)

    out = []
    try:
        for toks in _logical_lines(body):
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
                    end = rest[dist_at].start if dist_at < len(rest) else rest[-1].end
                    row, col = rest[0].end
                    where = _Span(text_between(rest[0].end, end), row + line0 - 1, col + col0, col0)
                if dist_at < len(rest):
                    dsrc = text_between(rest[dist_at].end, rest[-1].end).strip()
                    m = re.match(r"([A-Za-z_]\w*)\s+in\s+(.+)$", dsrc, re.S)
                    if not m:
                        raise error("expected 'distribution VAR in [values]'", *rest[dist_at].start)
                    distribution = (m.group(1), m.group(2))
            line_text = body.split("\n")[toks[0].start[0] - 1]
            out.append(_Statement(toks[0].start[0], toks[-1].end[0],
                                  line_text[:len(line_text) - len(line_text.lstrip())], parts, where,
                                  distribution))
    except tokenize.TokenError as e:
        raise error(e.args[0], *e.args[1]) from None
    except IndentationError as e:
        raise error(e.msg, e.lineno or 1, max((e.offset or 1) - 1, 0)) from None
    return out


def _hole_call(h: Hole, dist: tuple[str, str] | None) -> str:
    if dist and dist[0] == h.name:
        return f"{h.name} = await __ctx.distribution({h.name!r}, {dist[1]})"
    post = "[" + ", ".join(h.decorators) + "]"
    if h.type_source:
        t = ast.parse(h.type_source, mode="eval").body
        if isinstance(t, ast.Call):
            args = ", ".join([ast.unparse(a) for a in t.args])
            kwargs = ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in t.keywords)
            return (f"{h.name} = await __ctx.nested({h.name!r}, {ast.unparse(t.func)}, ({args}{',' if args else ''}), "
                    f"{{{kwargs}}}, post={post})")
        return f"{h.name} = await __ctx.hole({h.name!r}, __c, type={h.type_source}, post={post})"
    return f"{h.name} = await __ctx.hole({h.name!r}, __c, post={post})"


def _statement_code(st: _Statement, where_code: str) -> str:
    calls = [f"__c = {where_code}"]
    for p in st.parts:
        if isinstance(p, Text):
            calls.append(f"await __ctx.text({p.text!r})")
        elif isinstance(p, Expr):
            calls.append(f"await __ctx.text(__ctx.fmt(({p.source}), {p.conversion!r}, {p.spec!r}))")
        elif isinstance(p, Role):
            calls.append(f"await __ctx.role({p.role!r})")
        else:
            calls.append(_hole_call(p, st.distribution))
    return st.indent + "; ".join(calls)


_lock = threading.Lock()


def compile_query(source: str, params: list[str] | None = None, name: str = "query") -> CompiledQuery:
    """Compile query `source` into a module defining `__kvql_query__(__ctx, __args)`, with `params`
    bound as locals. Serialized: CPython 3.11's `ast` module is not safe to use from several threads
    at once (its recursion-depth counter is shared, gh-106905)."""
    with _lock:
        return _compile(source, params, name)


def _compile(source: str, params: list[str] | None, name: str) -> CompiledQuery:
    source = _strip_marker(source)
    decoder, body, line0, col0, model, where, distribution = split_clauses(source)
    statements = _find_statements(body, source, line0, col0)
    holes = [p.name for st in statements for p in st.parts if isinstance(p, Hole)]
    if distribution is not None:
        text, dline = distribution
        m = re.match(r"([A-Za-z_]\w*)\s+in\s+(.+)$", text, re.S)
        if not m:
            raise QuerySyntaxError("expected 'distribution VAR in [values]'", dline, 1, source)
        if m.group(1) not in holes:
            raise QuerySyntaxError(f"distribution over {m.group(1)}, which no prompt generates", dline, 1, source)
        for st in statements:
            if m.group(1) in [p.name for p in st.parts if isinstance(p, Hole)]:
                st.distribution = st.distribution or (m.group(1), m.group(2))
    for st in statements:
        if st.distribution and st.distribution[0] not in [p.name for p in st.parts if isinstance(p, Hole)]:
            raise QuerySyntaxError(f"distribution over {st.distribution[0]}, which this prompt does not generate",
                                   st.first + line0 - 1, 1, source)
    global_where = _where_code(where, set(holes), source) if where else "None"

    lines = body.split("\n")
    for st in reversed(statements):
        own = {p.name for p in st.parts if isinstance(p, Hole)}
        code = _where_code(st.where, own, source) if st.where else "None"
        if where and st.where:
            code = f"__C.AND({global_where}, {code})"
        elif where:
            code = global_where
        lines[st.first - 1:st.last] = [_statement_code(st, code)] + [""] * (st.last - st.first)
    transformed = "\n".join(lines)
    try:
        module = ast.parse(transformed, filename="<query>")
    except SyntaxError as e:
        raise QuerySyntaxError(e.msg, (e.lineno or 1) + line0 - 1, (e.offset or 1) + col0, source) from None
    returns = any(isinstance(n, ast.Return) for n in _walk_own(module.body))
    params = list(params or [])
    prologue = ast.parse("\n".join(["context = __ctx"] + [f"{p} = __args[{p!r}]" for p in params]))
    fn = ast.AsyncFunctionDef(
        name="__kvql_query__",
        args=ast.arguments(posonlyargs=[], args=[ast.arg("__ctx"), ast.arg("__args")], kwonlyargs=[],
                           kw_defaults=[], defaults=[]),
        body=prologue.body + (module.body or [ast.Pass()]), decorator_list=[], returns=None, type_params=[])
    module = ast.Module(body=[fn], type_ignores=[])
    ast.increment_lineno(module, line0 - 1)
    for node in ast.walk(prologue):
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = line0
    ast.fix_missing_locations(module)
    filename = f"<kvql query {name} #{next(_counter)}>"
    # tracebacks through the query show its own lines
    linecache.cache[filename] = (len(source), None, [ln + "\n" for ln in source.split("\n")], filename)
    code = compile(module, filename, "exec")
    return CompiledQuery(code, params, decoder, model, holes, returns, source)


def _walk_own(stmts):
    """Nodes of these statements, not descending into nested function or class definitions."""
    stack = list(stmts)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)
