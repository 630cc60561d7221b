"""Constraints of `where` clauses: a small IR built by the compiled query, and per-hole decoding plans.

The query compiler rewrites a `where` expression so that evaluating it builds this IR: hole names
become `Var`s, `and`/`or`/`not`, comparisons and `in` become IR nodes, and everything else stays a
Python value (so `where len(TOKENS(X)) < n` reads `n` from the query's scope when the prompt runs).

A hole's `HolePlan` splits the constraints on it into what the engine can enforce:
- a Lark grammar for the whole value (choices, `==`, `INT`, `REGEX`, `startswith`, `"s" in V`,
  `len(V)`, and their `and`/`or`/`not` combinations as terminal intersection / union / complement),
  compiled to a token mask by llguidance;
- stop phrases (`STOPS_AT` keeps the phrase in the value, `STOPS_BEFORE` drops it), each firing only
  once the other length conditions on the hole hold;
- token-count bounds (`len(TOKENS(V)) < n` etc.).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from llguidance import regex_to_lark

INT_REGEX = r" ?-?[0-9]+"

_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
        "!=": operator.ne}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


class ConstraintError(ValueError):
    """A `where` clause kvql cannot enforce, with the reason."""


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
    kind: str  # stops_at, stops_before, regex, int, in, eq, contains, startswith, len
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


def STOPS_AT(var, phrase: str) -> Atom:
    return Atom("stops_at", _var(var, "STOPS_AT"), str(phrase))


def STOPS_BEFORE(var, phrase: str) -> Atom:
    return Atom("stops_before", _var(var, "STOPS_BEFORE"), str(phrase))


def INT(var) -> Atom:
    return Atom("int", _var(var, "INT"))


def REGEX(var, pattern: str) -> Atom:
    return Atom("regex", _var(var, "REGEX"), pattern)


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
    kept = _keep(items)
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
            raise ConstraintError(f"len({a.var}) must be compared with an integer, got {b!r}")
        return Atom("len", a.var.name, (a.unit, op, b))
    if isinstance(a, Var):
        if op in ("==", "!=") and isinstance(b, str):
            atom = Atom("eq", a.name, b)
            return atom if op == "==" else Not(atom)
        raise ConstraintError(f"unsupported comparison {a.name} {op} {b!r}: compare a variable with == / != "
                              "and a string, or its len() / len(TOKENS()) with a number")
    return _OPS[op](a, b)


def IN(a, b, negate: bool = False):
    if isinstance(a, Var):
        if not isinstance(b, (list, tuple, set, frozenset)) or not all(isinstance(o, str) for o in b):
            raise ConstraintError(f"'{a.name} in ...' needs a list of strings, got {b!r}")
        if not b:
            raise ConstraintError(f"'{a.name} in []': the list of choices is empty")
        atom = Atom("in", a.name, tuple(b))
    elif isinstance(b, Var):
        atom = Atom("contains", b.name, str(a))
    else:
        return (a not in b) if negate else (a in b)
    return Not(atom) if negate else atom


BUILDERS = {"STOPS_AT": STOPS_AT, "STOPS_BEFORE": STOPS_BEFORE, "INT": INT, "REGEX": REGEX, "TOKENS": TOKENS}


# -- per-hole plans ------------------------------------------------------------------------------
_META = set("\\.+*?()|[]{}^$#&~-")


def escape(text: str) -> str:
    """Escape text for an llguidance (Rust-syntax) regular expression."""
    return "".join("\\" + c if c in _META else c for c in text)


def _atom_regex(node: Atom) -> str:
    kind, arg = node.kind, node.arg
    if kind == "in":
        return "|".join(escape(o) for o in arg)
    if kind == "eq":
        return escape(arg)
    if kind == "startswith":
        return escape(arg) + r"(?s:.*)"
    if kind == "contains":
        return r"(?s:.*)" + escape(arg) + r"(?s:.*)"
    if kind == "int":
        return INT_REGEX
    if kind == "regex":
        return arg
    if kind == "len" and arg[0] == "chars":
        _, op, n = arg
        lo, hi = {"<": (0, n - 1), "<=": (0, n), "==": (n, n), ">": (n + 1, None), ">=": (n, None)}.get(op, (None, None))
        if lo is None or (hi is not None and hi < 0):
            raise ConstraintError(f"unsupported length condition len({node.var}) {op} {n}")
        return f"(?s:.{{{lo},{'' if hi is None else hi}}})"
    raise ConstraintError(f"{kind} constraint on {node.var} cannot be combined with or/not")


def _term(node: Node) -> str:
    """A Lark terminal expression (llguidance dialect: `&` intersection, `~` complement) for `node`."""
    if isinstance(node, And):
        return "(" + " & ".join(_term(i) for i in node.items) + ")"
    if isinstance(node, Or):
        return "(" + " | ".join(_term(i) for i in node.items) + ")"
    if isinstance(node, Not):
        return f"(/(?s:.*)/ & ~{_term(node.item)})"  # ~ alone would also admit invalid UTF-8
    return "/" + regex_to_lark(_atom_regex(node), "") + "/"


def _plain(node: Node) -> str | None:
    if isinstance(node, Or):
        parts = [_plain(i) for i in node.items]
        return None if None in parts else "(" + "|".join(f"({p})" for p in parts) + ")"
    if isinstance(node, Atom):
        return _atom_regex(node)
    return None


def _regexable(node: Node) -> bool:
    if isinstance(node, (And, Or)):
        return all(_regexable(i) for i in node.items)
    if isinstance(node, Not):
        return _regexable(node.item)
    return node.kind not in ("stops_at", "stops_before") and not (node.kind == "len" and node.arg[0] == "tokens")


@dataclass
class Stop:
    phrase: str
    include: bool  # STOPS_AT keeps the phrase in the value


@dataclass
class HolePlan:
    """How to decode one hole: `terms` (all must match the whole value) for the token mask, stop
    phrases, token bounds."""

    terms: list[str] = field(default_factory=list)
    plain: list[str | None] = field(default_factory=list)  # each term as one plain regex, None if it needs & or ~
    stops: list[Stop] = field(default_factory=list)
    max_tokens: int | None = None
    min_tokens: int = 0
    min_chars: int = 0
    as_int: bool = False  # a top-level INT(V): the program sees an int, as in LMQL

    def require(self, regex: str) -> None:
        self.terms.append("/" + regex_to_lark(regex, "") + "/")
        self.plain.append(regex)

    def regex(self) -> str | None:
        """The value's constraint as one plain regex (what OpenAI-compatible servers accept), or None."""
        if not self.terms:
            return None
        if len(self.plain) != 1 or self.plain[0] is None:
            raise ConstraintError("this combination of conditions needs regex intersection or negation, "
                                  "which only kvql's local engine can enforce")
        return self.plain[0]

    def lark(self) -> str | None:
        """The Lark grammar of the value, or None if it is unconstrained."""
        return f"start: VALUE\nVALUE: {' & '.join(self.terms)}" if self.terms else None

    def stop_index(self, text: str, guard_chars: int | None) -> tuple[int, Stop] | None:
        """Where the value ends in `text`: the first stop phrase whose cut value satisfies the hole's
        length conditions. `guard_chars` is the text length at which the token-count lower bound was
        reached (None while it is not)."""
        if guard_chars is None:
            return None
        need = max(guard_chars, self.min_chars)
        best = None
        for s in self.stops:
            shift = len(s.phrase) if s.include else 0
            i = text.find(s.phrase, max(0, need - shift))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def cut(self, text: str, guard_chars: int | None) -> str:
        """The value: `text` up to the stop phrase (kept for STOPS_AT), or all of it."""
        hit = self.stop_index(text, guard_chars)
        if hit is None:
            return text
        i, stop = hit
        return text[:i] + (stop.phrase if stop.include else "")


def plan_for(constraint, name: str) -> HolePlan:
    """The decoding plan for hole `name` under a statement's `constraint` (IR, True, or None)."""
    plan = HolePlan()
    if not isinstance(constraint, Node):
        return plan
    conjuncts = constraint.items if isinstance(constraint, And) else (constraint,)
    for c in conjuncts:
        if name not in c.vars():
            continue
        if len(c.vars()) > 1:
            raise ConstraintError(f"a condition relates several variables ({', '.join(sorted(c.vars()))}); "
                                  "kvql constrains each variable on its own")
        if isinstance(c, Atom) and c.kind in ("stops_at", "stops_before"):
            plan.stops.append(Stop(c.arg, c.kind == "stops_at"))
        elif isinstance(c, Or) and all(isinstance(i, Atom) and i.kind in ("stops_at", "stops_before")
                                       for i in c.items):
            plan.stops += [Stop(i.arg, i.kind == "stops_at") for i in c.items]
        elif isinstance(c, Atom) and c.kind == "len" and c.arg[0] == "tokens":
            _, op, n = c.arg
            if op in ("<", "<=", "=="):
                cap = n - 1 if op == "<" else n
                if cap < 1:
                    raise ConstraintError(f"len(TOKENS({name})) {op} {n} leaves no room for a token")
                plan.max_tokens = cap if plan.max_tokens is None else min(plan.max_tokens, cap)
            if op in (">", ">=", "=="):
                plan.min_tokens = max(plan.min_tokens, n + 1 if op == ">" else n)
            if op == "!=":
                raise ConstraintError(f"len(TOKENS({name})) != n is not supported")
        elif _regexable(c):
            plan.as_int = plan.as_int or (isinstance(c, Atom) and c.kind == "int")
            if isinstance(c, Atom) and c.kind == "len" and c.arg[1] in (">", ">="):
                plan.min_chars = max(plan.min_chars, c.arg[2] + (c.arg[1] == ">"))
            plan.terms.append(_term(c))
            plan.plain.append(_plain(c))
        else:
            raise ConstraintError(f"cannot enforce this condition on {name}: STOPS_AT, STOPS_BEFORE and "
                                  "len(TOKENS()) combine with the rest only through a top-level 'and'")
    if plan.max_tokens is not None and plan.min_tokens > plan.max_tokens:
        raise ConstraintError(f"the token bounds on {name} contradict each other")
    return plan
