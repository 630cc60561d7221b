"""OpenAI's `logit_bias` built from the engine's options (the engine has no additive bias).

OpenAI's meaning: a map token id -> bias in [-100, 100] added to the logits before sampling; "values
like -100 or 100 should result in a ban or exclusive selection of the relevant token". Those two are
what kvql takes, as a `mask` (a `MaskFn`) intersected with the request's constraint:
- -100: the token is never picked (adding -100 makes its probability e^-100 of what it was: nil);
- 100: only the tokens given 100 may be picked, among them by their own relative probabilities (adding
  the same 100 to each keeps their ratios and makes every other token's probability nil).
Other values would need the bias added to the logits, which a mask cannot do: they are a 400 naming
the field, as is a key that is not a token id of this model. `{}` (LangChain's default) is no bias.
"""

from __future__ import annotations

import torch

from .protocol import RequestError

BAN, ONLY = -100.0, 100.0


def bias_mask(logit_bias: dict[str, float] | None, vocab_size: int, base=None):
    """The `MaskFn` for `logit_bias` over `base` (the constraint's mask, or None), or `base` itself when
    the bias is empty."""
    if not logit_bias:
        return base
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    only = []
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: key {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                               "logit_bias")
        if value == BAN:
            allowed[token] = False
        elif value == ONLY:
            only.append(token)
        else:
            raise RequestError(f"logit_bias: {value} for token {token} is not supported; kvql serve takes -100 "
                               "(never pick the token) and 100 (pick only among the tokens given 100)",
                               "logit_bias")
    if only:
        restricted = torch.zeros(vocab_size, dtype=torch.bool)
        restricted[only] = True
        allowed &= restricted
    if not bool(allowed.any()):
        raise RequestError("logit_bias bans every token it allows", "logit_bias")
    return BiasMask(allowed, base)


class BiasMask:
    """A `MaskFn`: `base`'s allowed tokens (all, when None) that the bias allows."""

    def __init__(self, allowed: torch.Tensor, base):
        self.allowed, self.base = allowed, base
        self.jump_forward = getattr(base, "jump_forward", base is None)  # a function of the ids alone

    def __call__(self, ids: list[int]) -> torch.Tensor:
        if self.base is None:
            return self.allowed
        got = self.base(ids)
        if got is None:
            return self.allowed
        got = got.to(torch.bool).flatten().clone()
        n = min(got.numel(), self.allowed.numel())
        got[:n] &= self.allowed[:n]
        return got
