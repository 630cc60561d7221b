"""Constraints of `where` clauses: a small IR built by the compiled query (its nodes and the builders the
compiled clause calls), and `describe` (a node as a where clause writes it). The rest of the story:
`hole_plan` (what the engine enforces of a hole's conditions), `json_types` (type constraints),
`value_check` (checking a value against a plan's grammar).

The query compiler rewrites a `where` expression so that evaluating it builds this IR: hole names
become `Var`s, `and`/`or`/`not`, comparisons and `in` become IR nodes, and everything else stays a
Python value (so `where len(TOKENS(X)) < n` reads `n` from the query's scope when the prompt runs).

A hole's `HolePlan` (hole_plan.py) splits the constraints on it into what the engine can enforce:
- a Lark grammar for the whole value (choices, `==`, `INT`, `REGEX`, `startswith`, `"s" in V`,
  `len(V)`, and their `and`/`or`/`not` combinations as terminal intersection / union / complement),
  compiled to a token mask by llguidance;
- stop phrases (`STOPS_AT` keeps the phrase in the value, `STOPS_BEFORE` drops it), each firing only
  once the other length conditions on the hole hold;
- token-count bounds (`len(TOKENS(V)) < n` etc.);
- a type (`type(V) is Person`, a dataclass): the value is JSON under the schema of its fields, parsed
  into an instance (see `type_schema` / `from_json`).

An `or` may join stop phrases and token bounds (LMQL's `STOPS_AT(V, "a") or STOPS_AT(V, "b")`,
`len(TOKENS(V)) > 20 or STOPS_AT(V, "The")`), see `_plan_or`; any other condition that kvql cannot
enforce raises ConstraintError naming it, it is never dropped.

The plan also says whether a value meets the grammar (`HolePlan.check`, on the text itself,
whatever the tokenization) and whether any value can (`HolePlan.satisfiable`), so that the runtime
never returns a value that breaks its where clause and explains a clause that cannot hold.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from .errors import ConstraintError
from .json_types import type_name, type_schema

INT_REGEX = r" ?-?[0-9]+"
ANY = r"[\s\S]"
"""Any character, newlines included, written without inline flags: vLLM's default structured-output
backend (xgrammar) rejects `(?s)` with a 500."""

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


class Node:
    def vars(self) -> set[str]:
        raise NotImplementedError


@dataclass(frozen=True)
class Var:
    name: str

    def startswith(self, prefix: str) -> "Atom":
        return Atom("startswith", self.name, prefix)

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Tokens:
    var: Var


@dataclass(frozen=True)
class Len:
    var: Var
    unit: str  # "tokens" | "chars"


@dataclass(frozen=True)
class Atom(Node):
    kind: str  # stops_at, stops_before, regex, int, in, eq, contains, startswith, len, type, heal, invalid
    var: str
    arg: object = None

    def vars(self) -> set[str]:
        return {self.var}


@dataclass(frozen=True)
class And(Node):
    items: tuple

    def vars(self):
        return set().union(*(i.vars() for i in self.items))


@dataclass(frozen=True)
class Or(Node):
    items: tuple

    def vars(self):
        return set().union(*(i.vars() for i in self.items))


@dataclass(frozen=True)
class Not(Node):
    item: Node

    def vars(self):
        return self.item.vars()


# -- builders called by compiled where clauses ---------------------------------------------------
def _var(x, fn: str) -> str:
    if isinstance(x, Var):
        return x.name
    raise ConstraintError(f"{fn}() takes a variable that the prompt generates, got {x!r}")


def invalid(var: str, message: str) -> Atom:
    """A condition on `var` that the values it reads do not make valid now. A global where is evaluated
    at every prompt statement with the program's values at that moment (LMQL evaluates a hole's
    condition when the hole is generated), so the error is raised by `plan_for` when `var` is
    generated, never at another hole's statement (`B in opts`, with `opts` filled after hole A)."""
    return Atom("invalid", var, message)


def _stop(kind: str, fn: str, var, phrase) -> Atom:
    name = _var(var, fn)
    if not str(phrase):  # it would match before the first token: the value would always be empty
        return invalid(name, f'{fn}({name}, ""): the stop phrase is empty')
    return Atom(kind, name, str(phrase))


def STOPS_AT(var, phrase: str) -> Atom:
    return _stop("stops_at", "STOPS_AT", var, phrase)


def STOPS_BEFORE(var, phrase: str) -> Atom:
    return _stop("stops_before", "STOPS_BEFORE", var, phrase)


def INT(var) -> Atom:
    return Atom("int", _var(var, "INT"))


def REGEX(var, pattern: str) -> Atom:
    return Atom("regex", _var(var, "REGEX"), pattern)


def TYPE(var, t) -> Atom:
    """`type(V) is t`: V is JSON under `type_schema(t)`, parsed into a `t` (see `from_json`)."""
    name = _var(var, "type")
    type_schema(t)  # an unsupported type fails here, at the where clause
    return Atom("type", name, t)


def HEAL(var) -> Atom:
    """`HEAL(V)`: token healing for hole V (the backend contract's `heal` option); combines with other conditions by `and`."""
    return Atom("heal", _var(var, "HEAL"))


def TOKENS(var) -> Tokens:
    return Tokens(Var(_var(var, "TOKENS")))


def LEN(x):
    if isinstance(x, Tokens):
        return Len(x.var, "tokens")
    if isinstance(x, Var):
        return Len(x, "chars")
    return len(x)


def _keep(items):
    out = []
    for x in items:
        if isinstance(x, Node):
            out.append(x)
        elif not x:
            raise ConstraintError("a condition of the where clause is always false")
    return tuple(out)


def AND(*items):
    # flat: a global where with `and` next to an inline where is one conjunction (plan_for reads its items)
    kept = tuple(j for i in _keep(items) for j in (i.items if isinstance(i, And) else (i,)))
    return kept[0] if len(kept) == 1 else And(kept) if kept else True


def OR(*items):
    if any(not isinstance(x, Node) and x for x in items):
        return True
    kept = tuple(x for x in items if isinstance(x, Node))
    if not kept:
        raise ConstraintError("a condition of the where clause is always false")
    return kept[0] if len(kept) == 1 else Or(kept)


def NOT(x):
    return Not(x) if isinstance(x, Node) else not x


def CMP(op: str, a, b):
    if isinstance(b, (Len, Var)) and not isinstance(a, (Len, Var)):
        a, b, op = b, a, _FLIP[op]
    if isinstance(a, Len):
        if not isinstance(b, int):
            return invalid(a.var.name, f"len({a.var}) must be compared with an integer, got {b!r}")
        return Atom("len", a.var.name, (a.unit, op, b))
    if isinstance(a, Var):
        if op in ("==", "!=") and isinstance(b, str):
            atom = Atom("eq", a.name, b)
            return atom if op == "==" else Not(atom)
        return invalid(a.name, f"unsupported comparison {a.name} {op} {b!r}: compare a variable with == / != "
                               "and a string, or its len() / len(TOKENS()) with a number")
    return _OPS[op](a, b)


def IN(a, b, negate: bool = False):
    if isinstance(a, Var):
        if not isinstance(b, (list, tuple, set, frozenset)) or not all(isinstance(o, str) for o in b):
            return invalid(a.name, f"'{a.name} in ...' needs a list of strings, got {b!r}")
        if not b:
            return invalid(a.name, f"'{a.name} in []': the list of choices is empty")
        atom = Atom("in", a.name, tuple(b))
    elif isinstance(b, Var):
        atom = Atom("contains", b.name, str(a))
    else:
        return (a not in b) if negate else (a in b)
    return Not(atom) if negate else atom


BUILDERS = {"STOPS_AT": STOPS_AT, "STOPS_BEFORE": STOPS_BEFORE, "INT": INT, "REGEX": REGEX, "TOKENS": TOKENS,
            "HEAL": HEAL}


def first_invalid(node) -> Atom | None:
    """The first `invalid` condition in `node`, if any."""
    if isinstance(node, (And, Or)):
        return next(filter(None, map(first_invalid, node.items)), None)
    if isinstance(node, Not):
        return first_invalid(node.item)
    return node if isinstance(node, Atom) and node.kind == "invalid" else None


def describe(node) -> str:
    """A condition as a where clause would write it (for error messages)."""
    if isinstance(node, (And, Or)):
        word = " and " if isinstance(node, And) else " or "
        return word.join(f"({describe(i)})" if isinstance(i, (And, Or)) else describe(i) for i in node.items)
    if isinstance(node, Not):
        inner = describe(node.item)
        return f"not ({inner})" if isinstance(node.item, (And, Or)) else f"not {inner}"
    v, arg = node.var, node.arg
    return {
        "stops_at": lambda: f"STOPS_AT({v}, {arg!r})",
        "stops_before": lambda: f"STOPS_BEFORE({v}, {arg!r})",
        "regex": lambda: f"REGEX({v}, {arg!r})",
        "int": lambda: f"INT({v})",
        "in": lambda: f"{v} in {list(arg)!r}",
        "eq": lambda: f"{v} == {arg!r}",
        "contains": lambda: f"{arg!r} in {v}",
        "startswith": lambda: f"{v}.startswith({arg!r})",
        "len": lambda: f"len({'TOKENS(' + v + ')' if arg[0] == 'tokens' else v}) {arg[1]} {arg[2]}",
        "type": lambda: f"type({v}) is {type_name(arg)}",
        "heal": lambda: f"HEAL({v})",
        "invalid": lambda: arg,
    }[node.kind]()


def finite_values(node) -> frozenset[str] | None:
    """A finite set holding every value `node` admits (its `in` / `==` choices), or None."""
    if isinstance(node, Atom) and node.kind in ("in", "eq"):
        return frozenset(node.arg) if node.kind == "in" else frozenset([node.arg])
    if isinstance(node, Or):
        parts = [finite_values(i) for i in node.items]
        return None if None in parts else frozenset().union(*parts)
    if isinstance(node, And):
        parts = [p for p in map(finite_values, node.items) if p is not None]
        return frozenset.intersection(*parts) if parts else None
    return None
