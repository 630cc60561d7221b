"""Where clauses: a `where` expression rewritten so that evaluating it builds the constraint IR
(`kvql.runtime.constraints`): hole names become `Var`s, `and` / `or` / `not`, comparisons and `in` become IR
builders, everything else stays Python, read from the query's scope when the prompt runs (`where_ir`);
also the decoder's and `distribution`'s expressions, parsed where they stand so errors name their place.
"""

from __future__ import annotations

import ast
import tokenize

from ..runtime.constraints import BUILDERS, Var
from ..runtime.hole_plan import regex_problem
from .source import QuerySyntaxError, Span, tokens


def expression(span: Span, what: str, source: str) -> ast.expr:
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


def distribution_clause(span: Span, source: str) -> tuple[str, str]:
    """`VAR in VALUES` -> (VAR, VALUES as one line of Python)."""
    node = expression(span, "distribution", source)
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
            return conjunction([self.visit(v) for v in node.values])
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


def where_ir(span: Span, holes: set[str], source: str, missing: list[str] | None = None) -> ast.expr:
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
                if fn == "REGEX" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                        and isinstance(node.args[1].value, str):
                    problem = regex_problem(node.args[1].value)
                    if problem is not None:
                        raise _NodeError(f"{fn}({ast.unparse(node.args[0])}, {node.args[1].value!r}): invalid "
                                         f"regex: {problem}", node.args[1])
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


def conjunction(items: list[ast.expr]) -> ast.expr:
    """`__C.AND(*items)`, flat: conjunctions among the items are spliced in (the runtime reads a
    hole's conditions as the top-level conjuncts of its constraint)."""
    flat = []
    for item in items:
        is_and = isinstance(item, ast.Call) and isinstance(item.func, ast.Attribute) and item.func.attr == "AND" \
            and isinstance(item.func.value, ast.Name) and item.func.value.id == "__C"
        flat += item.args if is_and else [item]
    return flat[0] if len(flat) == 1 else ast.Call(_WhereRewriter._c("AND"), flat, [])
