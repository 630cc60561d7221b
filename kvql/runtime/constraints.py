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

import dataclasses
import functools
import json
import math
import operator
import typing
from dataclasses import dataclass, field

import llguidance
from llguidance import regex_to_lark

INT_REGEX = r" ?-?[0-9]+"
ANY = r"[\s\S]"
"""Any character, newlines included, written without inline flags: vLLM's default structured-output
backend (xgrammar) rejects `(?s)` with a 500."""

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


def _phrase(fn: str, var: str, phrase) -> str:
    if not str(phrase):  # it would match before the first token: the value would always be empty
        raise ConstraintError(f'{fn}({var}, ""): the stop phrase is empty')
    return str(phrase)


def STOPS_AT(var, phrase: str) -> Atom:
    name = _var(var, "STOPS_AT")
    return Atom("stops_at", name, _phrase("STOPS_AT", name, phrase))


def STOPS_BEFORE(var, phrase: str) -> Atom:
    name = _var(var, "STOPS_BEFORE")
    return Atom("stops_before", name, _phrase("STOPS_BEFORE", name, phrase))


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


BUILDERS = {"STOPS_AT": STOPS_AT, "STOPS_BEFORE": STOPS_BEFORE, "INT": INT, "REGEX": REGEX, "TOKENS": TOKENS,
            "HEAL": HEAL}


# -- types: dataclasses as JSON ------------------------------------------------------------------
_SCALARS = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"}}


def _name(t) -> str:
    return getattr(t, "__name__", None) or repr(t)


def type_schema(t) -> dict:
    """The JSON schema of `t`: str, int, float, bool, list[...] of these, or a dataclass of them
    (every field required, in declaration order, no other keys); ConstraintError otherwise."""
    if t in _SCALARS:
        return dict(_SCALARS[t])
    if typing.get_origin(t) is list and len(typing.get_args(t)) == 1:
        return {"type": "array", "items": type_schema(typing.get_args(t)[0])}
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        try:
            hints = typing.get_type_hints(t)  # resolves string annotations (from __future__ import annotations)
        except Exception as e:
            raise ConstraintError(f"cannot read the field types of {_name(t)}: {e}") from None
        fields = [f.name for f in dataclasses.fields(t)]
        props = {}
        for f in fields:
            try:
                props[f] = type_schema(hints[f])
            except ConstraintError as e:
                raise ConstraintError(f"{_name(t)}.{f}: {e}") from None
        return {"type": "object", "properties": props, "required": fields, "additionalProperties": False}
    raise ConstraintError(f"type {_name(t)} is not supported: a type constraint takes str, int, float, bool, "
                          "list[...] or a dataclass of these")


def from_json(t, data):
    """`data` (parsed JSON valid under `type_schema(t)`) as a `t`: dataclasses built field by field."""
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        hints = typing.get_type_hints(t)
        return t(**{f.name: from_json(hints[f.name], data[f.name]) for f in dataclasses.fields(t)})
    if typing.get_origin(t) is list:
        (item,) = typing.get_args(t)
        return [from_json(item, d) for d in data]
    return float(data) if t is float else data


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
        "type": lambda: f"type({v}) is {_name(arg)}",
        "heal": lambda: f"HEAL({v})",
    }[node.kind]()


def _finite(node) -> frozenset[str] | None:
    """A finite set holding every value `node` admits (its `in` / `==` choices), or None."""
    if isinstance(node, Atom) and node.kind in ("in", "eq"):
        return frozenset(node.arg) if node.kind == "in" else frozenset([node.arg])
    if isinstance(node, Or):
        parts = [_finite(i) for i in node.items]
        return None if None in parts else frozenset().union(*parts)
    if isinstance(node, And):
        parts = [p for p in map(_finite, node.items) if p is not None]
        return frozenset.intersection(*parts) if parts else None
    return None


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
        return escape(arg) + ANY + "*"
    if kind == "contains":
        return ANY + "*" + escape(arg) + ANY + "*"
    if kind == "int":
        return INT_REGEX
    if kind == "regex":
        return arg
    if kind == "len" and arg[0] == "chars":
        _, op, n = arg
        lo, hi = {"<": (0, n - 1), "<=": (0, n), "==": (n, n), ">": (n + 1, None), ">=": (n, None)}.get(op, (None, None))
        if lo is None or (hi is not None and hi < 0):
            raise ConstraintError(f"unsupported length condition len({node.var}) {op} {n}")
        return f"{ANY}{{{lo},{'' if hi is None else hi}}}"
    raise ConstraintError(f"{kind} constraint on {node.var} cannot be combined with or/not")


def _term(node: Node) -> str:
    """A Lark terminal expression (llguidance dialect: `&` intersection, `~` complement) for `node`."""
    if isinstance(node, And):
        return "(" + " & ".join(_term(i) for i in node.items) + ")"
    if isinstance(node, Or):
        return "(" + " | ".join(_term(i) for i in node.items) + ")"
    if isinstance(node, Not):
        return f"(/{ANY}*/ & ~{_term(node.item)})"  # ~ alone would also admit invalid UTF-8
    return _slashed(_atom_regex(node))


def _slashed(regex: str) -> str:
    """A regex as a Lark terminal; `(?:)` for the empty one (`//` is not Lark), as in `X == ""`."""
    return "/" + (regex_to_lark(regex, "") or "(?:)") + "/"


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
    return node.kind not in ("stops_at", "stops_before", "type", "heal") and not (node.kind == "len" and node.arg[0] == "tokens")


def _ending(node) -> bool:
    """A stop phrase or a token bound: the alternatives of an `or` that ends a value."""
    return isinstance(node, Atom) and (node.kind in ("stops_at", "stops_before") or
                                       (node.kind == "len" and node.arg[0] == "tokens"))


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
    conditions: list[str] = field(default_factory=list)    # each term as the where clause wrote it
    stops: list[Stop] = field(default_factory=list)
    max_tokens: int | None = None
    cap: str | None = None       # the condition that set max_tokens, e.g. "len(TOKENS(X)) < 3"
    min_tokens: int = 0
    floor: str | None = None     # the condition that set min_tokens
    min_chars: int = 0
    choices: frozenset[str] | None = None  # every value the terms admit is one of these (None: not finite)
    as_int: bool = False  # a top-level INT(V): the program sees an int, as in LMQL
    as_float: bool = False  # [V: float]: the program sees a float
    value_type: object = None  # `type(V) is T`: JSON under type_schema(T), the program sees a T
    heal: bool = False  # HEAL(V): token healing (the prompt's last tokens are generated again)

    def require(self, regex: str, condition: str) -> None:
        self.terms.append(_slashed(regex))
        self.plain.append(regex)
        self.conditions.append(condition)

    def cap_tokens(self, cap: int, condition: str) -> None:
        """At most `cap` tokens (the tightest of all caps wins)."""
        if cap < 1:
            raise ConstraintError(f"{condition} leaves no room for a token")
        if self.max_tokens is None or cap < self.max_tokens:
            self.max_tokens, self.cap = cap, condition

    def describe(self) -> str:
        """The value's conditions, as written in the where clause."""
        return " and ".join(self.conditions)

    def satisfiable(self) -> bool:
        """False when no text meets every term (their intersection is empty), as far as llguidance
        can tell from the grammar's initial state; True when unconstrained."""
        if self.choices is not None and not self.choices:
            return False
        for term, condition in zip(self.terms, self.conditions):  # an invalid regex, named by its condition
            try:
                _matcher(f"start: VALUE\nVALUE: {term}")
            except ConstraintError as e:
                raise ConstraintError(f"{condition}: {e}") from None
        lark = self.lark()
        return lark is None or _matcher(lark).satisfiable

    def check(self, text: str) -> str:
        """"complete" if `text` (see `constrained`) meets every term, "prefix" if only a longer text
        could, else "no"."""
        lark = self.lark()
        if lark is None:
            return "complete"
        m = _matcher(lark).initial.deep_copy()
        if not m.consume_tokens(list(text.encode())) or m.is_error():
            return "no"
        return "complete" if m.is_accepting() else "prefix"

    def single_regex(self) -> str | None:
        """The value's grammar as one plain regex (what every structured-output server accepts), or None
        when there is none or it needs intersection, complement or a JSON schema (see `lark`)."""
        if self.value_type is not None or len(self.plain) != 1:
            return None
        return self.plain[0]

    def admitted(self) -> list[str] | None:
        """Every value the grammar admits, sorted, when they are finitely many (`in` / `==`); else None."""
        if self.choices is None or self.value_type is not None:
            return None
        return sorted(c for c in self.choices if self.check(c) == "complete")

    def token_lark(self, tokenizer) -> str | None:
        """For a value among finitely many choices: a Lark grammar over token ids that admits each choice
        in its canonical tokenization only (the ids the tokenizer gives it), so that `X in [" yes", " no"]`
        comes out as the model's own `" yes"` token rather than `" "` + `"yes"`. None otherwise."""
        choices = self.admitted()
        if not choices:
            return None
        alternatives = [" ".join(f"<[{t}]>" for t in tokenizer.encode(c, add_special_tokens=False)) or '""'
                        for c in choices]
        return "start: " + " | ".join(alternatives)

    def lark(self) -> str | None:
        """The Lark grammar of the value, or None if it is unconstrained."""
        if self.value_type is not None:  # plan_for allows no other term next to it
            schema = {**type_schema(self.value_type),
                      "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
            return f"start: %json {json.dumps(schema)}"
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

    def constrained(self, text: str, guard_chars: int | None) -> str:
        """What the grammar constrains in generated `text`: up to and including the stop phrase that
        ends the value. STOPS_BEFORE drops the phrase from the value only afterwards (as in LMQL), so
        `REGEX(X, "[a-z]+[.]") and STOPS_BEFORE(X, ".")` gives a value without the dot."""
        hit = self.stop_index(text, guard_chars)
        return text if hit is None else text[:hit[0]] + hit[1].phrase


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
        elif isinstance(c, Or) and all(_ending(i) for i in _alternatives(c)):
            _plan_or(plan, c, name)
        elif isinstance(c, Atom) and c.kind == "len" and c.arg[0] == "tokens":
            _, op, n = c.arg
            if op in ("<", "<=", "=="):
                plan.cap_tokens(n - 1 if op == "<" else n, describe(c))
            if op in (">", ">=", "==") and (n + 1 if op == ">" else n) > plan.min_tokens:
                plan.min_tokens, plan.floor = n + 1 if op == ">" else n, describe(c)
            if op == "!=":
                raise ConstraintError(f"cannot enforce {describe(c)}: len(TOKENS({name})) != n is not supported")
        elif isinstance(c, Atom) and c.kind == "heal":
            plan.heal = True
        elif isinstance(c, Atom) and c.kind == "type":
            plan.value_type = c.arg
            plan.conditions.append(describe(c))
        elif _regexable(c):
            plan.as_int = plan.as_int or (isinstance(c, Atom) and c.kind == "int")
            if isinstance(c, Atom) and c.kind == "len" and c.arg[1] in (">", ">="):
                plan.min_chars = max(plan.min_chars, c.arg[2] + (c.arg[1] == ">"))
            plan.terms.append(_term(c))
            plan.plain.append(_plain(c))
            plan.conditions.append(describe(c))
            finite = _finite(c)
            if finite is not None:
                plan.choices = finite if plan.choices is None else plan.choices & finite
        else:
            raise ConstraintError(f"cannot enforce {describe(c)}: STOPS_AT, STOPS_BEFORE, len(TOKENS()), HEAL() "
                                  "and type() combine with other conditions only through a top-level 'and' (an 'or' "
                                  "may join stop phrases and token bounds)")
    if plan.value_type is not None and plan.terms:
        raise ConstraintError(f"cannot enforce {plan.describe()} together: a type constraint combines only "
                              "with token bounds and stop phrases")
    if plan.max_tokens is not None and plan.min_tokens > plan.max_tokens:
        raise ConstraintError(f"the token bounds on {name} contradict each other: {plan.floor} and {plan.cap}")
    return plan


def _alternatives(node: Or) -> list:
    """The alternatives of an `or`, nested ones flattened."""
    return [a for i in node.items for a in (_alternatives(i) if isinstance(i, Or) else [i])]


def _plan_or(plan: HolePlan, node: Or, name: str) -> None:
    """An `or` of stop phrases and token bounds, with LMQL's semantics (lmql/ops/ops.py, v0.7.3):

    - each stop phrase ends the value wherever it appears, whatever the other alternatives say
      (`len(TOKENS(V)) > 20 or STOPS_AT(V, "The")` ends at the first "The"); only conditions
      `and`-ed with the `or` hold it back;
    - as a condition, STOPS_AT is always true, so an `or` with a stop phrase admits every value: its
      token bounds neither cap the value nor hold back the end of sequence;
    - only token bounds: a length condition (`len(TOKENS(V)) < 20 or len(TOKENS(V)) < 30` allows
      29 tokens)."""
    items, text = _alternatives(node), describe(node)
    bounds = [i.arg[1:] for i in items if i.kind == "len"]
    stops = [Stop(i.arg, i.kind == "stops_at") for i in items if i.kind != "len"]
    if any(op == "!=" for op, _ in bounds):
        raise ConstraintError(f"cannot enforce {text}: len(TOKENS({name})) != n is not supported")
    if stops:
        plan.stops += stops
    elif all(op in ("<", "<=") for op, _ in bounds):
        plan.cap_tokens(max(n - 1 if op == "<" else n for op, n in bounds), text)
    elif all(op in (">", ">=") for op, _ in bounds):
        floor = min(n + 1 if op == ">" else n for op, n in bounds)
        if floor > plan.min_tokens:
            plan.min_tokens, plan.floor = floor, text
    else:
        raise ConstraintError(f"cannot enforce {text}: an 'or' of token bounds must bound the length from one "
                              "side (all < / <=, or all > / >=)")


# -- checking values against a plan's grammar ----------------------------------------------------
class _ByteVocab:
    """A vocabulary of the 256 bytes (and an end token): a matcher over it reads any text exactly,
    independent of how a model would tokenize it."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


@dataclass
class _Matcher:
    initial: llguidance.LLMatcher
    satisfiable: bool


@functools.lru_cache(maxsize=1)
def _bytes_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))


@functools.lru_cache(maxsize=256)
def _matcher(lark: str) -> _Matcher:
    # Compiled here, on the caller's thread: a plan's grammar is one terminal, nested only as deep as
    # its where expression, and llguidance refuses deep nesting itself ("too deeply nested", regex
    # nest limit); the chained rules that need engine.grammar's big-stack compile cannot occur.
    limits = llguidance.LLParserLimits(verbose_errors=False)
    m = llguidance.LLMatcher(_bytes_tokenizer(), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0,
                             limits=limits)
    if m.is_error():
        raise ConstraintError(f"invalid constraint: {m.get_error().rstrip()}")
    probe = m.deep_copy()
    probe.compute_bitmask()  # an empty intersection has no first byte: llguidance reports an error here
    return _Matcher(m, not probe.is_error())


@functools.lru_cache(maxsize=8)
def _pieces(tokenizer) -> tuple[frozenset[bytes], int]:
    """The byte strings of a Hugging Face tokenizer's ordinary tokens, and the longest one's length."""
    import llguidance.hf  # imports transformers: only once a tokenizer is at hand

    ll = llguidance.hf.from_tokenizer(tokenizer)
    pieces = frozenset(ll.decode_bytes([i]) for i in range(ll.vocab_size) if not ll.is_special_token(i)) - {b""}
    return pieces, max(map(len, pieces), default=1)


def fewest_tokens(tokenizer, text: str) -> float:
    """The fewest tokens of `tokenizer` that spell `text` in any tokenization (math.inf if none do):
    a lower bound on what generating `text` takes, whatever the model or the mask prefers."""
    pieces, longest = _pieces(tokenizer)
    b = text.encode()
    best = [0] + [math.inf] * len(b)
    for i in range(len(b)):
        if best[i] != math.inf:
            for k in range(1, min(longest, len(b) - i) + 1):
                if b[i:i + k] in pieces and best[i] + 1 < best[i + k]:
                    best[i + k] = best[i] + 1
    return best[-1]


def longest_token(tokenizer) -> int:
    """Bytes in the longest token: `n` tokens spell at most `n * longest_token` characters."""
    return _pieces(tokenizer)[1]
