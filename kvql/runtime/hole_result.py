"""`HoleResult`: what generating one hole gave back, returned by `Holes._sample` and `Holes._beam` and read
by the hole's trace row, its checks (`check`: the value against every condition of its where clause) and the
adding of its value to the prompt (`kvql.runtime.holes`).

One object per hole, handed back rather than left on the context: a hole's data is followed from the
request that made it to the prompt it ends in without reading the state of another object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..completion import Completion
from .errors import UnmetConstraint
from .hole_plan import HolePlan, Stop
from .trace import TraceHole


@dataclass
class HoleResult:
    """A hole's generated value and what the backend told of it (see `kvql.completion.Completion`)."""

    value: str            # the generated text cut where the value ends (a stop phrase: `HolePlan.cut`)
    tokens: list[int]     # the value's token ids (healed: without those wholly inside the backed-up text)
    full: str             # the generated text up to where generation ended, a stop phrase included
    guard: int | None     # characters of its first min_tokens tokens: stop phrases count after them (None: fewer)
    added: list[int]      # the token ids the value enters the prompt with (healed: every generated one)
    healed: int = 0       # token healing: the prompt tokens backed up (0: none), which `added` replaces,
    healed_text: str = ""  # and their text
    forced: list[int] = field(default_factory=list)  # indices in `added` of the tokens a constraint forced
    forced_own: int = 0   # how many of those are the value's own (healed: not re-spelling backed-up text)
    prepared: float = 0.0  # the backend's time before the request was queued (Completion.prepare_seconds)
    drafted: int = 0      # speculative decoding: tokens drafted and verified for it,
    accepted: int = 0     # and how many of them it accepted,
    drafted_at: list[int] = field(default_factory=list)  # at these indices in `added`

    @classmethod
    def sampled(cls, c: Completion, plan: HolePlan, guard: int | None) -> "HoleResult":
        """From the one completion of a hole's request under `plan`. Healed, the tokens wholly inside the
        backed-up text re-spell the prompt: the value is added with all of them in place of the backed-up
        ones, but its own tokens (those the hole's bounds count, forced or not) are the others."""
        full = c.text + c.stop_reason if isinstance(c.stop_reason, str) else c.text
        skip, healed = c.healed_output_tokens, c.healed_prompt_tokens
        tokens = c.token_ids[skip:]
        own = [i - skip for i in c.forced if i >= skip]  # indices into `tokens`
        drafted = list(c.accepted) if healed else [i - skip for i in c.accepted if i >= skip]
        return cls(plan.cut(full, guard), tokens, full, guard, added=list(c.token_ids) if healed else tokens,
                   healed=healed, healed_text=c.healed, forced=list(c.forced) if healed else own,
                   forced_own=len(own), prepared=c.prepare_seconds, drafted=c.drafted_tokens,
                   accepted=len(c.accepted), drafted_at=drafted)

    @property
    def healed_prefix(self) -> tuple[int, str] | None:
        """(prompt tokens backed up, their text) when healed, for `Prompt.add_value`."""
        return (self.healed, self.healed_text) if self.healed else None

    def trace_row(self, name: str, where: str, seconds: float, setup: float, unbounded: bool = False) -> TraceHole:
        """The hole's row in the trace: healed, its tokens include those re-generating the backed-up text
        (the trace marks them the hole's); `setup`: the runtime's time before the request, to which the
        backend's is added; `unbounded`: it had no token bound of its own."""
        return TraceHole(name, self.value, where, len(self.added), seconds, self.forced_own, self.healed,
                         setup + self.prepared, self.drafted, self.accepted, unbounded)


def tokens_text(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def stop_name(name: str, stop: Stop) -> str:
    return f"{'STOPS_AT' if stop.include else 'STOPS_BEFORE'}({name}, {stop.phrase!r})"


def check(name: str, plan: HolePlan, out: HoleResult, max_tokens: int, bound: str) -> None:
    """Raise UnmetConstraint unless the generated text behind `out.value` (see `HolePlan.constrained`)
    meets every condition of the hole's grammar, or is a prefix of a value that does and a stop phrase
    ended it: a stop phrase ends the value wherever it appears, also inside a value its grammar would
    have continued (LMQL's rule: `STOPS_BEFORE(X, "b") and X == "abc"` gives "a"). Then its token lower
    bound (`_check_min_tokens`). `max_tokens` and `bound` (see `kvql.runtime.holes.Holes._budget`) say what cut a value short."""
    state = plan.check(plan.constrained(out.full, out.guard))
    if state == "no":  # the local mask only allows prefixes: a server that ignored the regex sent this
        raise UnmetConstraint(name, f"the value {out.value!r} does not satisfy its constraint ({plan.describe()})",
                              out.value)
    if state != "complete" and plan.stop_index(out.full, out.guard) is None:
        raise UnmetConstraint(name, f"the value {out.value!r} is incomplete: its constraint ({plan.describe()}) "
                                    f"{_why_cut(out.tokens, max_tokens, bound)}", out.value)
    _check_min_tokens(name, plan, out)
    _check_stops(name, plan, out)


def _check_stops(name: str, plan: HolePlan, out: HoleResult) -> None:
    """A stop phrase ends the value where it first appears past the part a length lower bound requires
    (`len(TOKENS(X)) > 3`, `len(X) > 9`): inside that part it does not (LMQL's guarded stop; the value then
    holds it). A value that holds its stop phrase (STOPS_AT: before its end) and was not ended by one, because
    its length ended it first (`len(TOKENS(X)) == 4`), meets its length but not its stop condition: the two
    cannot both hold for it, an UnmetConstraint naming both."""
    if plan.stop_index(out.full, out.guard) is not None:
        return
    for stop in plan.stops:
        i = out.value.find(stop.phrase)
        if i >= 0 and (not stop.include or i + len(stop.phrase) < len(out.value)):
            floors = [c for c in (plan.floor, *(c for c in plan.conditions if c.startswith(f"len({name})")))
                      if c]
            raise UnmetConstraint(name, f"the value {out.value!r} holds its stop phrase {stop.phrase!r} inside the "
                                        f"part {' and '.join(floors) or 'its length'} requires: "
                                        f"{stop_name(name, stop)} and {' and '.join(floors) or 'its length'} "
                                        f"cannot both hold for it", out.value)


def _why_cut(tokens, max_tokens, bound) -> str:
    if len(tokens) >= max_tokens:
        return f"needs more than the {tokens_text(max_tokens)} that {bound}"
    return "was ended by the model"


def _check_min_tokens(name: str, plan: HolePlan, out: HoleResult) -> None:
    """A server lets a complete grammar end the value before min_tokens (vLLM's rule); kvql's engine
    would have found no token to continue with: the value is refused here."""
    n = len(out.tokens)
    if plan.min_tokens and (out.tokens or not out.full) and n < plan.min_tokens:
        raise UnmetConstraint(name, f"the value {out.value!r} has {tokens_text(n)}; {plan.floor} needs "
                                    f"{plan.min_tokens}, and its constraint ({plan.describe()}) allowed no more",
                              out.value)
