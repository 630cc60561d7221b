"""Compile LMQL query source into Python: a module that defines the query as a coroutine function.

The layout of clauses (prologue, decoder, body, from, where, distribution) is read by `clauses.py`.
A prompt statement is a statement of the query body itself (not of a `def` or `class` inside it)
made only of string literals, optionally followed by `where COND` and `distribution VAR in VALUES`.
It is rewritten, on its own first line so that line numbers stay those of the query, into calls on
the runtime context `__ctx`: `text`, `role`, `hole`, `nested`, `distribution`. Everything else is
ordinary Python, run as is (the body becomes the body of an `async def`, so `await` and `return`
work; a `return` inside a nested `def` returns from that function only).

The compiled module (run in the query's defining scope) defines:
- `__kvql_query__(__ctx, __args)`: the body, with the inputs `__args` bound as locals;
- `__kvql_decoder__(__args)`: the decoder clause's keyword arguments, evaluated (`argmax(n=n)`);
- `__kvql_model__(__args)`: the `from` clause's model, evaluated (`from lmql.model(...)`), or None;
and runs the prologue (Python lines before the decoder clause) at its top level, as LMQL does.
"""

from __future__ import annotations

import ast
import linecache
import re
import threading
import tokenize
from dataclasses import dataclass, field

from ..runtime.constraints import BUILDERS, Var
from .clauses import DECODERS, Body, split_clauses, starts_scope
from .prompt_string import Expr, Hole, PromptSyntaxError, Role, Text, parse_prompt
from .source import QuerySyntaxError, Span, logical_lines, tokens

__all__ = ["compile_query", "CompiledQuery", "Decoder", "QuerySyntaxError", "DECODERS"]
_counter = iter(range(1, 1 << 62))


@dataclass
class Decoder:
    name: str = "argmax"
    kwargs: dict = field(default_factory=dict)  # the arguments that are literals (checked at definition)
    dynamic: list = field(default_factory=list)  # names of arguments that are expressions (`n=n`)


@dataclass
class CompiledQuery:
    code: object                # code object of the module (see the module docstring)
    params: list[str]
    decoder: Decoder | None
    model: str | None           # the `from` clause, when it is a string literal
    holes: list[str]
    returns: bool               # the body has a `return` (of its own, not of a nested def)
    source: str
    model_source: str | None = None  # the `from` clause's expression, when it is not a literal
    unresolved: tuple[str, ...] = ()  # names the global `where` constrains that no prompt generates


def _strip_marker(source: str) -> str:
    lines = source.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    if lines and lines[0].strip() == "lmql":  # docstrings written '''lmql ...'''
        lines.pop(0)
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
    return "\n".join(x[indent:] if x.strip() else "" for x in lines)


def _decoder(layout, source: str) -> tuple[Decoder | None, dict]:
    """The decoder clause, and the source of each of its keyword arguments."""
    if layout.decoder is None:
        return None, {}
    sources, kwargs, dynamic = {}, {}, []
    if layout.decoder_args is not None:
        span = layout.decoder_args
        try:
            call = ast.parse(f"f{span.text}", mode="eval").body
        except SyntaxError as e:
            raise span.error(f"invalid decoder clause: {e.msg}", 1, max((e.offset or 2) - 2, 0), source) from None
        if call.args:
            raise span.error("decoder arguments must be keywords, e.g. sample(n=2)", 1, 0, source)
        for k in call.keywords:
            if k.arg is None:
                raise span.error("decoder arguments must be keywords, e.g. sample(n=2)", 1, 0, source)
            sources[k.arg] = ast.unparse(k.value)
            try:
                kwargs[k.arg] = ast.literal_eval(k.value)
            except ValueError:
                dynamic.append(k.arg)
    return Decoder(layout.decoder, kwargs, dynamic), sources


def _expression(span: Span, what: str, source: str) -> ast.expr:
    """The Python expression in `span` (which may continue over lines), parsed; errors point into the query."""
    span = span.strip()
    if not span.text:
        raise span.error(f"the {what} clause is empty", 1, 0, source)
    try:
        return ast.parse(f"({span.text}\n)", mode="eval").body
    except SyntaxError as e:
        row, col = e.lineno or 1, (e.offset or 1) - 1 - ((e.lineno or 1) == 1)
        lines = span.text.split("\n")
        if row > len(lines):
            row, col = len(lines), len(lines[-1])
        raise span.error(f"invalid {what} clause: {e.msg}", row, max(col, 0), source) from None


def _distribution(span: Span, source: str) -> tuple[str, str]:
    """`VAR in VALUES` -> (VAR, VALUES as one line of Python)."""
    node = _expression(span, "distribution", source)
    if not (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In)):
        raise span.strip().error("expected 'distribution VAR in [values]'", 1, 0, source)
    return node.left.id, ast.unparse(node.comparators[0])


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
        if isinstance(node.op, ast.And):
            return _conjunction([self.visit(v) for v in node.values])
        return ast.Call(self._c("OR"), [self.visit(v) for v in node.values], [])

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            return ast.Call(self._c("NOT"), [self.visit(node.operand)], [])
        return self.generic_visit(node)

    def visit_Compare(self, node):
        names = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
        if isinstance(node.ops[0], (ast.Is, ast.IsNot)) and len(node.ops) == 1 and isinstance(node.left, ast.Call) \
                and isinstance(node.left.func, ast.Name) and node.left.func.id == "type" and len(node.left.args) == 1 \
                and isinstance(node.left.args[0], ast.Name) and node.left.args[0].id in self.holes:
            # `type(X) is T` (LMQL's type constraint): Python's `is` cannot be overloaded, so it becomes a call
            if isinstance(node.ops[0], ast.IsNot):
                raise _NodeError("'type(X) is not T' is not supported; write 'type(X) is T'", node)
            return ast.Call(self._c("TYPE"), [self.visit(node.left.args[0]), self.visit(node.comparators[0])], [])
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


def _where_ir(span: Span, holes: set[str], source: str, missing: list[str] | None = None) -> ast.expr:
    """An expression building the IR of the where clause in `span`; errors point into the query.
    `missing`: collect the constrained names no prompt generates there instead of raising."""
    span = span.strip()
    try:
        for _ in tokens(span.text):
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
                    if isinstance(a, ast.Name) and a.id not in holes and missing is not None:
                        missing += [a.id] if a.id not in missing else []
                    elif isinstance(a, ast.Name) and a.id not in holes:
                        raise _NodeError(f"{fn}({a.id}, ...): no prompt here generates a variable named {a.id}", a)
                if fn in ("STOPS_AT", "STOPS_BEFORE") and len(node.args) > 1 \
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value == "":
                    raise _NodeError(f'{fn}({ast.unparse(node.args[0])}, ""): the stop phrase is empty',
                                     node.args[1])
        _check_hole_uses(tree.body, holes)
        return _WhereRewriter(holes).visit(tree).body
    except _NodeError as e:
        raise QuerySyntaxError(str(e), *span.node_at(e.node), source) from None


_VAR_METHODS = {n for n in dir(Var) if not n.startswith("_")}
_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def _check_hole_uses(tree: ast.expr, holes: set[str]) -> None:
    """Refuse, at its node, a generated variable used where the constraint IR cannot follow it
    (`X.startswith(..)`, `X[0]`, `f(X)`, `X + 1`, ...): the condition would otherwise be evaluated as
    plain Python on a placeholder and silently mean something else."""
    def allowed(parent, grandparent) -> bool:
        if isinstance(parent, ast.Compare):
            return all(isinstance(op, _ORDER) for op in parent.ops)
        if isinstance(parent, ast.Attribute):  # the IR's methods of a variable: X.startswith("a")
            return parent.attr in _VAR_METHODS and isinstance(grandparent, ast.Call) and grandparent.func is parent
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
            return parent.func.id in BUILDERS or parent.func.id == "len" or \
                parent.func.id == "type" and isinstance(grandparent, ast.Compare)
        return False

    def walk(node, parent, grandparent):
        if isinstance(node, ast.Name) and node.id in holes and not allowed(parent, grandparent):
            shown = parent if parent is not None else node
            if isinstance(parent, ast.Attribute) and isinstance(grandparent, ast.Call) and grandparent.func is parent:
                shown = grandparent  # the whole method call, X.upper()
            raise _NodeError(f"cannot enforce '{ast.unparse(shown)}': a generated variable ({node.id}) can only "
                             "appear in comparisons, 'in', len(), type(V) is T, V.startswith() and the constraint "
                             f"functions {', '.join(sorted(BUILDERS))}", shown)
        for child in ast.iter_child_nodes(node):
            walk(child, node, parent)

    walk(tree, None, None)


def _conjunction(items: list[ast.expr]) -> ast.expr:
    """`__C.AND(*items)`, flat: conjunctions among the items are spliced in (the runtime reads a
    hole's conditions as the top-level conjuncts of its constraint)."""
    flat = []
    for item in items:
        is_and = isinstance(item, ast.Call) and isinstance(item.func, ast.Attribute) and item.func.attr == "AND" \
            and isinstance(item.func.value, ast.Name) and item.func.value.id == "__C"
        flat += item.args if is_and else [item]
    return flat[0] if len(flat) == 1 else ast.Call(_WhereRewriter._c("AND"), flat, [])


# -- prompt statements ---------------------------------------------------------------------------
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
    where: Span | None
    distribution: tuple[str, str] | None  # (VAR, values source)


def _find_statements(body: Body, source: str) -> list[_Statement]:
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
                    distribution = _distribution(span(rest[dist_at].end, rest[-1].end), source)
            line_text = text.split("\n")[toks[0].start[0] - 1]
            out.append(_Statement(toks[0].start[0], toks[-1].end[0],
                                  line_text[:len(line_text) - len(line_text.lstrip())], parts, where,
                                  distribution))
    except tokenize.TokenError as e:
        raise error(e.args[0], *e.args[1]) from None
    except IndentationError as e:
        raise error(e.msg, e.lineno or 1, max((e.offset or 1) - 1, 0)) from None
    return out


def _one_line(src: str) -> str:
    """A Python expression's source on one line (prompt statements must keep their line count)."""
    return ast.unparse(ast.parse(f"({src})", mode="eval").body)


def _is_regex(type_source: str) -> bool:
    """`[V: r'[0-9]+']`: a string literal as a hole's tactic is a regex it must match (LMQL's)."""
    t = ast.parse(f"({type_source})", mode="eval").body
    return isinstance(t, ast.Constant) and isinstance(t.value, str)


def _hole_call(h: Hole, dist: tuple[str, str] | None, constraint: str) -> str:
    if dist and dist[0] == h.name:
        return f"{h.name} = await __ctx.distribution({h.name!r}, {dist[1]})"
    post = "[" + ", ".join(_one_line(d) for d in h.decorators) + "]"
    if h.type_source and not _is_regex(h.type_source):
        t = ast.parse(f"({h.type_source})", mode="eval").body
        if isinstance(t, ast.Call):
            args = ", ".join([ast.unparse(a) for a in t.args])
            kwargs = ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in t.keywords)
            return (f"{h.name} = await __ctx.nested({h.name!r}, {ast.unparse(t.func)}, ({args}{',' if args else ''}), "
                    f"{{{kwargs}}}, post={post}, constraint={constraint})")
        return f"{h.name} = await __ctx.hole({h.name!r}, {constraint}, type={ast.unparse(t)}, post={post})"
    return f"{h.name} = await __ctx.hole({h.name!r}, {constraint}, post={post})"


def _statement_code(st: _Statement, where: ast.expr | None) -> str:
    """The statement as one line of calls on `__ctx`; `where` is the IR expression of its constraint."""
    calls = [f"__c = {ast.unparse(where) if where is not None else None}"]
    for p in st.parts:
        if isinstance(p, Text):
            calls.append(f"await __ctx.text({p.text!r})")
        elif isinstance(p, Expr):
            calls.append(f"await __ctx.text(__ctx.fmt(({_one_line(p.source)}), {p.conversion!r}, {p.spec!r}))")
        elif isinstance(p, Role):
            calls.append(f"await __ctx.role({p.role!r})")
        elif p.type_source and _is_regex(p.type_source):
            regex = ast.parse(f"__C.REGEX(__C.Var({p.name!r}), {_one_line(p.type_source)})", mode="eval").body
            own = ast.unparse(_conjunction(([where] if where is not None else []) + [regex]))
            calls.append(_hole_call(p, st.distribution, own))
        else:
            calls.append(_hole_call(p, st.distribution, "__c"))
    return st.indent + "; ".join(calls)


_lock = threading.Lock()


def compile_query(source: str, params: list[str] | None = None, name: str = "query") -> CompiledQuery:
    """Compile query `source` into a module (see the module docstring), with `params` bound as
    locals. Serialized: CPython 3.11's `ast` module is not safe to use from several threads at once
    (its recursion-depth counter is shared, gh-106905)."""
    with _lock:
        return _compile(source, params, name)


def _function(name: str, params: list[str], body: list[ast.stmt], line: int, is_async: bool = False):
    """`[async] def name(__args)` (or `(__ctx, __args)`) binding `params` from `__args`, then `body`;
    the added lines are placed on query line `line`."""
    binds = ast.parse("\n".join((["context = __ctx"] if is_async else []) + [f"{p} = __args[{p!r}]" for p in params]))
    for node in ast.walk(binds):
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = line
    args = ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in (["__ctx"] if is_async else []) + ["__args"]],
                         kwonlyargs=[], kw_defaults=[], defaults=[])
    cls = ast.AsyncFunctionDef if is_async else ast.FunctionDef
    return cls(name=name, args=args, body=binds.body + (body or [ast.Pass()]), decorator_list=[], returns=None,
               type_params=[], lineno=line, col_offset=0)


def _parse_at(text: str, line: int, source: str, col: int = 0) -> list[ast.stmt]:
    """Statements of `text`, which starts on query line `line` (at column `col` for errors)."""
    try:
        tree = ast.parse(text, filename="<query>")
    except SyntaxError as e:
        raise QuerySyntaxError(e.msg, (e.lineno or 1) + line - 1, (e.offset or 1) + col, source) from None
    ast.increment_lineno(tree, line - 1)
    return tree.body


def _compile(source: str, params: list[str] | None, name: str) -> CompiledQuery:
    source = _strip_marker(source)
    layout = split_clauses(source)
    body = layout.body
    decoder, decoder_args = _decoder(layout, source)
    statements = _find_statements(body, source)
    holes = [p.name for st in statements for p in st.parts if isinstance(p, Hole)]
    if layout.distribution is not None:
        var, values = _distribution(layout.distribution, source)
        at = layout.distribution.strip()
        if var not in holes:
            raise at.error(f"distribution over {var}, which no prompt generates", 1, 0, source)
        for st in statements:
            if var in [p.name for p in st.parts if isinstance(p, Hole)]:
                st.distribution = st.distribution or (var, values)
    for st in statements:
        if st.distribution and st.distribution[0] not in [p.name for p in st.parts if isinstance(p, Hole)]:
            raise QuerySyntaxError(f"distribution over {st.distribution[0]}, which this prompt does not generate",
                                   body.at(st.first, 0)[0], 1, source)

    # As in LMQL, a global where that constrains a variable no prompt generates fails when the query
    # is called (a TypeError naming it), also when the query has no prompt at all; never ignored.
    unresolved: list[str] = []
    if layout.where:
        _where_ir(layout.where, set(holes), source, unresolved)
    lines = body.text.split("\n")
    for st in reversed(statements):
        # the global where clause applies to every statement, next to the statement's own (flattened)
        own = {p.name for p in st.parts if isinstance(p, Hole)}
        items = ([_where_ir(layout.where, set(holes), source)] if layout.where and not unresolved else []) + \
                ([_where_ir(st.where, own, source)] if st.where else [])
        lines[st.first - 1:st.last] = [_statement_code(st, _conjunction(items) if items else None)] + \
            [""] * (st.last - st.first)
    query_body = _parse_at("\n".join(lines), body.line, source, body.col)
    returns = any(isinstance(n, ast.Return) for n in _walk_own(query_body))

    params = list(params or [])
    model = model_source = None
    model_expr = ast.Constant(None)
    if layout.model is not None:
        model_expr = _expression(layout.model, "from", source)
        if isinstance(model_expr, ast.Constant) and isinstance(model_expr.value, str):
            model = model_expr.value
        else:
            model_source = ast.unparse(model_expr)
    model_line = layout.model.strip().line if layout.model is not None else body.line
    dec_line = layout.decoder_args.line if layout.decoder_args is not None else body.line
    decoder_dict = ast.parse("{" + ", ".join(f"{k!r}: ({v})" for k, v in decoder_args.items()) + "}", mode="eval").body
    prologue = _parse_at(layout.prologue.text, 1, source) if layout.prologue is not None else []
    module = ast.Module(body=prologue + [
        _function("__kvql_query__", params, query_body, body.line, is_async=True),
        _function("__kvql_decoder__", params, [ast.Return(decoder_dict)], dec_line),
        _function("__kvql_model__", params, [ast.Return(model_expr)], model_line),
    ], type_ignores=[])
    for node in ast.walk(decoder_dict):  # generated nodes: on the line of the clause they come from
        if isinstance(node, ast.expr):
            node.lineno = node.end_lineno = dec_line
    ast.fix_missing_locations(module)
    for node in ast.walk(module):
        if "lineno" in node._attributes and (node.end_lineno or 0) < node.lineno:
            node.end_lineno, node.end_col_offset = node.lineno, node.col_offset
    filename = f"<kvql query {name} #{next(_counter)}>"
    # tracebacks through the query show its own lines
    linecache.cache[filename] = (len(source), None, [ln + "\n" for ln in source.split("\n")], filename)
    code = compile(module, filename, "exec")
    return CompiledQuery(code, params, decoder, model, holes, returns, source, model_source, tuple(unresolved))


def _walk_own(stmts):
    """Nodes of these statements, not descending into nested function or class definitions."""
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    stack = [s for s in stmts if not isinstance(s, scopes)]
    while stack:
        node = stack.pop()
        yield node
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, scopes)]
