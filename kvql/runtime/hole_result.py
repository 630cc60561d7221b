"""`HoleResult`: what generating one hole gave back, returned by `Holes._sample` and `Holes._beam` and read
by the hole's trace row, its checks and the adding of its value to the prompt (`kvql.runtime.holes`).

One object per hole, handed back rather than left on the context: a hole's data is followed from the
request that made it to the prompt it ends in without reading the state of another object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..completion import Completion
from .hole_plan import HolePlan
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
