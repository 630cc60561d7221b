"""Per-hole decoding plans: `plan_for(constraint, name)` splits the conditions on one hole into what the
engine enforces: one Lark grammar for the whole value (choices, `==`, `INT`, `REGEX`, `startswith`,
`"s" in V`, `len(V)`, and their `and`/`or`/`not` combinations as terminal intersection / union /
complement), stop phrases (each firing only once the other length conditions hold), token-count bounds
and a type. An `or` may join stop phrases and token bounds (`_plan_or`); any other condition kvql cannot
enforce raises ConstraintError naming it, it is never dropped. `HolePlan.check` says whether a value meets
the grammar, `HolePlan.satisfiable` whether any value can."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llguidance import regex_to_lark

from ..backends.options import JSON_SPACING
from .constraints import ANY, INT_REGEX, And, Atom, Node, Not, Or, describe, finite_values, first_invalid
from .errors import ConstraintError, InvalidCondition, QueryError
from .json_types import type_schema
from .value_check import matcher

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


def regex_problem(pattern: str) -> str | None:
    """Why llguidance cannot compile `pattern` as a `REGEX` condition's regex (its parser's reason, one line),
    or None where it can: checked when a query is defined, before any model is loaded."""
    try:
        matcher(f"start: VALUE\nVALUE: {_slashed(pattern)}")
    except ConstraintError as e:
        lines = str(e).split("\n")
        return next((x.removeprefix("error: ") for x in lines if x.startswith("error: ")), lines[0])
    return None


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
                matcher(f"start: VALUE\nVALUE: {term}")
            except ConstraintError as e:
                raise ConstraintError(f"{condition}: {e}") from None
        lark = self.lark()
        return lark is None or matcher(lark).satisfiable

    def check(self, text: str) -> str:
        """"complete" if `text` (see `constrained`) meets every term, "prefix" if only a longer text
        could, else "no"."""
        lark = self.lark()
        if lark is None:
            return "complete"
        m = matcher(lark).initial.deep_copy()
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
            schema = {**type_schema(self.value_type), "x-guidance": JSON_SPACING}
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


def hole_plan(constraint, name: str) -> HolePlan:
    """`plan_for`, as a hole of a query asks for it: a constraint that cannot be planned (a bad regex, a condition
    over several variables) is a QueryError naming the hole; an `InvalidCondition` (a condition LMQL itself
    rejects, with its own message) passes as it is."""
    try:
        return plan_for(constraint, name)
    except InvalidCondition:
        raise
    except ValueError as e:
        raise QueryError(f"constraint on {name}: {e}") from None


def plan_for(constraint, name: str) -> HolePlan:
    """The decoding plan for hole `name` under a statement's `constraint` (IR, True, or None)."""
    plan = HolePlan()
    if not isinstance(constraint, Node):
        return plan
    conjuncts = constraint.items if isinstance(constraint, And) else (constraint,)
    for c in conjuncts:
        if name not in c.vars():
            continue
        bad = first_invalid(c)
        if bad is not None:
            raise InvalidCondition(bad.arg)
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
            finite = finite_values(c)
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
