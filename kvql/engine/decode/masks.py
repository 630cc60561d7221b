"""The masks a request's options become: each a `MaskFn` (generated ids -> allowed tokens as a bool
tensor over the vocabulary, or None for all), composed over the request's constraint (a compiled
`kvql.engine.decode.grammar.Grammar`'s `mask_fn()`, or the user's own `mask`).

- `no_end_before(mask, min_tokens, eos_ids, vocab)`: `min_tokens` with vLLM's meaning: while fewer than
  `min_tokens` tokens are generated, the end-of-sequence ids are taken out of what `mask` allows, unless
  that leaves nothing (the constraint allows only the end: its value is complete), where the constraint
  wins. (Stop strings under `min_tokens`: `kvql.engine.detokenizer`.)
- `logit_bias(bias, vocab, mask)`: OpenAI's `logit_bias`, its two absolute values exactly, as a mask: -100
  bans a token, 100 restricts the choice to the tokens given 100; it returns the other values, which the
  sampler adds to their logits (`SamplingParams.logit_bias`).
- `continued(mask, prefix)`: a constraint whose value began `prefix` tokens before the generated ones.
- `forcing(token_ids, vocab)`: exactly these tokens, one per step (scoring a continuation).

Each keeps `jump_forward` (whether the engine may ask the mask ahead: a function of the ids alone) from
the mask it wraps. Every mask runs inside the engine's per-request error boundary: its exception fails
its own request only.
"""

from __future__ import annotations

import torch

from ..request import MaskFn

BAN, ONLY = -100.0, 100.0


def _allowed(mask: MaskFn | None, ids: list[int]) -> torch.Tensor | None:
    got = mask(ids) if mask is not None else None
    return None if got is None else got.to(torch.bool).flatten()


def _both(allowed: torch.Tensor, also: torch.Tensor) -> torch.Tensor:
    """A copy of `allowed` with only the tokens `also` allows too (over the length both cover)."""
    both = allowed.clone()
    n = min(both.numel(), also.numel())
    both[:n] &= also[:n]
    return both


class _Wrapped:
    def __init__(self, mask: MaskFn | None):
        self.mask = mask
        self.jump_forward = getattr(mask, "jump_forward", mask is None)


class NoEndBefore(_Wrapped):
    """`no_end_before` (module doc). `counted(ids)`: how many of the generated ids count toward
    `min_tokens` (token healing leaves out those that re-spell the backed-up prompt)."""

    def __init__(self, mask: MaskFn | None, min_tokens: int, eos_ids, vocab: int, counted=len):
        super().__init__(mask)
        self.min_tokens, self.counted = min_tokens, counted
        self.no_end = torch.ones(vocab, dtype=torch.bool)
        self.no_end[[t for t in eos_ids if 0 <= t < vocab]] = False

    def __call__(self, ids: list[int]) -> torch.Tensor | None:
        allowed = _allowed(self.mask, ids)
        if self.counted(ids) >= self.min_tokens:
            return allowed
        if allowed is None:
            return self.no_end
        kept = _both(allowed, self.no_end)
        return kept if bool(kept.any()) else allowed  # only the end is allowed: the constraint wins


def no_end_before(mask: MaskFn | None, min_tokens: int, eos_ids, vocab: int, counted=len) -> MaskFn | None:
    return mask if min_tokens <= 0 else NoEndBefore(mask, min_tokens, eos_ids, vocab, counted)


class _Bias(_Wrapped):
    def __init__(self, allowed: torch.Tensor, mask: MaskFn | None):
        super().__init__(mask)
        self.allowed = allowed

    def __call__(self, ids: list[int]) -> torch.Tensor:
        got = _allowed(self.mask, ids)
        return self.allowed if got is None else _both(got, self.allowed)


def logit_bias(bias: dict | None, vocab: int, mask: MaskFn | None = None) -> tuple[MaskFn | None, tuple]:
    """(`mask` with OpenAI's `logit_bias` -100 and 100 applied exactly, the other (token, value) pairs for the
    sampler to add), for `bias` {token id, as an int or its string: value in [-100, 100]} (checked by the
    options). ValueError for a key that is no token id of this model, or a bias that bans every token it
    allows."""
    if not bias:
        return mask, ()
    allowed = torch.ones(vocab, dtype=torch.bool)
    only, added = [], []
    for key, value in bias.items():
        token = int(key)
        if not 0 <= token < vocab:
            raise ValueError(f"logit_bias: key {key!r} is not a token id of this model (0 to {vocab - 1})")
        if value == BAN:
            allowed[token] = False
        elif value == ONLY:
            only.append(token)
        elif value:
            added.append((token, float(value)))
    if only:
        restricted = torch.zeros(vocab, dtype=torch.bool)
        restricted[only] = True
        allowed &= restricted
    if not bool(allowed.any()):
        raise ValueError("logit_bias bans every token it allows")
    return (mask if bool(allowed.all()) else _Bias(allowed, mask)), tuple(added)


def continued(mask: MaskFn, prefix: list[int]) -> MaskFn:
    def mask_after(generated: list[int]):
        return mask(prefix + generated)

    mask_after.jump_forward = getattr(mask, "jump_forward", False)
    return mask_after


def forcing(token_ids: list[int], vocab: int) -> MaskFn:
    def mask(generated: list[int]) -> torch.Tensor:
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[token_ids[len(generated)]] = True
        return allowed

    mask.jump_forward = True  # every token is forced: the continuation is computed in one forward
    return mask
