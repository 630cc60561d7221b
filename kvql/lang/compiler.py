"""Compile LMQL query source into Python: a module that defines the query as a coroutine function.

The layout of clauses (prologue, decoder, body, from, where, distribution) is read by `clauses.py`;
prompt statements are found and rewritten by `statements.py`, where clauses by `where.py`.
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
import threading
from dataclasses import dataclass, field

from .clauses import DECODERS, split_clauses
from .prompt_string import Hole
from .source import QuerySyntaxError
from .statements import find_statements, statement_code
from .where import conjunction, distribution_clause, expression, where_ir

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
    statements = find_statements(body, source)
    holes = [p.name for st in statements for p in st.parts if isinstance(p, Hole)]
    _distribution(layout, statements, holes, source)
    # As in LMQL, a global where that constrains a variable no prompt generates fails when the query
    # is called (a TypeError naming it), also when the query has no prompt at all; never ignored.
    unresolved: list[str] = []
    if layout.where:
        where_ir(layout.where, set(holes), source, unresolved)
    query_body, returns = _query_body(layout, statements, holes, source, not unresolved)
    params = list(params or [])
    model_expr = ast.Constant(None) if layout.model is None else expression(layout.model, "from", source)
    literal = isinstance(model_expr, ast.Constant) and isinstance(model_expr.value, str)
    model = model_expr.value if literal else None
    model_source = None if literal or layout.model is None else ast.unparse(model_expr)
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


def _distribution(layout, statements: list, holes: list[str], source: str) -> None:
    """The `distribution` clause given to the statement that generates its variable; QuerySyntaxError where no
    prompt (or not that statement) generates it."""
    if layout.distribution is not None:
        var, values = distribution_clause(layout.distribution, source)
        at = layout.distribution.strip()
        if var not in holes:
            raise at.error(f"distribution over {var}, which no prompt generates", 1, 0, source)
        for st in statements:
            if var in [p.name for p in st.parts if isinstance(p, Hole)]:
                st.distribution = st.distribution or (var, values)
    for st in statements:
        if st.distribution and st.distribution[0] not in [p.name for p in st.parts if isinstance(p, Hole)]:
            raise QuerySyntaxError(f"distribution over {st.distribution[0]}, which this prompt does not generate",
                                   layout.body.at(st.first, 0)[0], 1, source)


def _query_body(layout, statements: list, holes: list[str], source: str, global_where: bool):
    """The query's body as Python statements (each prompt statement's code with its where clause and, where
    `global_where`, the global one), and whether it returns a value of its own."""
    body = layout.body
    lines = body.text.split("\n")
    for st in reversed(statements):
        # the global where clause applies to every statement, next to the statement's own (flattened)
        own = {p.name for p in st.parts if isinstance(p, Hole)}
        items = ([where_ir(layout.where, set(holes), source)] if layout.where and global_where else []) + \
                ([where_ir(st.where, own, source)] if st.where else [])
        lines[st.first - 1:st.last] = [statement_code(st, conjunction(items) if items else None)] + \
            [""] * (st.last - st.first)
    query_body = _parse_at("\n".join(lines), body.line, source, body.col)
    own_returns = [n for n in _walk_own(query_body) if isinstance(n, ast.Return)]
    for node in own_returns:
        if node.value is None:
            # a bare `return` ends the query with its result object, as the end of the body does (LMQL)
            node.value = ast.Await(ast.Call(ast.Attribute(ast.Name("__ctx", ast.Load()), "finish", ast.Load()), [], []))
    return query_body, bool(own_returns)


def _walk_own(stmts):
    """Nodes of these statements, not descending into nested function or class definitions."""
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    stack = [s for s in stmts if not isinstance(s, scopes)]
    while stack:
        node = stack.pop()
        yield node
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, scopes)]
