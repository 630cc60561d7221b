"""`Segment`: the unit of work a step hands the model runner, one per request in the batch (the scheduler
makes them, the runner computes them, the step's outputs read their logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Carry:
    """A request's recurrent state between its segments (models with recurrent layers, which the runner runs
    on their own forward): `state` after the request's first `length` tokens, None before any (the runner's
    object: it has `clone()` and `nbytes`); `tokens` (the request's tokens when its segment was formed) and
    `salt` key the snapshots taken of it (cache/state_snapshots.py) after `marks` tokens: where a request with
    the same prefix may resume (its prompt but the last token; where the tree's K/V of its prefix end beyond
    the deepest snapshot; where a request waiting for its prefix diverges from it). `drafted`: the states after
    the tokens of a drafted segment (speculative decoding), by length, kept until the draft is verified: `rewind`
    goes back to the one after the last accepted token."""

    salt: object = None
    state: object = None
    length: int = 0
    tokens: list[int] | None = None
    marks: set[int] = field(default_factory=set)
    drafted: dict[int, object] = field(default_factory=dict)

    def rewind(self, length: int) -> None:
        """The state after the request's first `length` tokens: the current one, or one kept in `drafted`."""
        if length != self.length:
            self.state, self.length = self.drafted[length], length
        self.drafted = {}


@dataclass
class Segment:
    """New tokens of one request in a batch: `token_ids` at positions `start ...`, written to `new_slots`;
    `past_slots` hold the KV of its positions `0 .. start-1`. `needs_logits`: the logits of its last
    token are wanted (to sample); `all_logits`: those of every token (prompt logprobs); `logits_from`: those
    of every position from there on (jump-forward's pending forced tokens: their logprobs). `drafted`: the last
    `drafted` tokens are a draft (speculative decoding, drafts.py), not yet the request's: the logits of the
    `drafted + 1` last positions are returned, each verifying the drafted token after it. `carry`: the
    request's recurrent state (models with recurrent layers only)."""

    token_ids: list[int]
    start: int
    past_slots: torch.Tensor
    new_slots: torch.Tensor
    needs_logits: bool
    all_logits: bool = False
    logits_from: int | None = None
    drafted: int = 0
    carry: Carry | None = None

    @property
    def logit_rows(self) -> int:
        """How many trailing tokens' logits the forward returns."""
        n = len(self.token_ids)
        if self.all_logits:
            return n
        if self.drafted:
            return self.drafted + 1
        k = 1 if self.needs_logits else 0
        if self.logits_from is not None:
            k = max(k, min(n, self.start + n - self.logits_from))
        return k
