"""vLLM's `min_tokens` built from the engine's options (the engine has no such option).

vLLM's meaning (0.32: `v1/sample/logits_processor/builtin.py`, `v1/engine/detokenizer.py`):
- below `min_tokens` generated tokens, the stop tokens (EOS) are masked out. With a structured-output
  constraint the grammar's mask is intersected with that; where the intersection is empty (the grammar
  allows only EOS: its value is complete) vLLM restores the stop tokens, so the grammar wins;
- stop strings are not checked until more than `min_tokens` tokens exist, and then only a stop string
  that *ends* in text of the tokens after the first `min_tokens` counts (one that ended earlier is
  never matched, one straddling the boundary is).

Here: the EOS ban is a `mask` (wrapping the compiled constraint's mask), and the stop strings are a
`stop_fn` instead of the engine's own `stop` (which would match from the first token), so the server
cuts the text at the stop string itself (`DeferredStops.finish`) and holds back the last
`hold` characters of a stream, as the engine does for its own stop strings.
"""

from __future__ import annotations

import dataclasses

import torch

from ..completion import Completion
from ..engine.grammar import Grammar

_COMPILERS = {"regex": Grammar.regex, "choices": Grammar.choices, "json_schema": Grammar.json_schema,
              "grammar": Grammar.lark}


def with_min_tokens(model, opts: dict, min_tokens: int) -> tuple[dict, DeferredStops | None]:
    """`opts` (`Model.generate` options) with `min_tokens` applied, and the stop-string matcher the
    caller must finish each completion with (None when the request has no stop strings). Compiles the
    request's constraint: call it off the event loop when there is one."""
    if min_tokens <= 0:
        return opts, None
    opts = dict(opts)
    base = opts.pop("mask", None)  # e.g. logit_bias's, which already holds the constraint
    for kind, compile_ in _COMPILERS.items():
        value = opts.pop(kind, None)
        if value is not None:
            base = compile_(model.tokenizer, value).mask_fn()
    opts["mask"] = NoEosBelow(min_tokens, base, model.engine.eos_ids, model.vocab_size)
    stop = opts.pop("stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if not stops:
        return opts, None
    deferred = DeferredStops(stops, min_tokens)
    opts["stop_fn"] = deferred
    return opts, deferred


class NoEosBelow:
    """A `MaskFn`: while fewer than `min_tokens` ids were generated, `base`'s allowed tokens (all, when
    None) minus the EOS ids, unless that leaves none; from then on `base` alone."""

    def __init__(self, min_tokens: int, base, eos_ids, vocab_size: int):
        self.min_tokens, self.base = min_tokens, base
        self.jump_forward = getattr(base, "jump_forward", base is None)  # a function of the ids alone
        self.no_eos = torch.ones(vocab_size, dtype=torch.bool)
        self.no_eos[[t for t in eos_ids if 0 <= t < vocab_size]] = False

    def __call__(self, ids: list[int]) -> torch.Tensor | None:
        allowed = self.base(ids) if self.base is not None else None
        if len(ids) >= self.min_tokens:
            return allowed
        if allowed is None:
            return self.no_eos
        allowed = allowed.to(torch.bool).flatten()
        n = min(allowed.numel(), self.no_eos.numel())
        banned = allowed.clone()
        banned[:n] &= self.no_eos[:n]
        return banned if bool(banned.any()) else allowed  # the grammar allows only EOS: it wins, as in vLLM


class DeferredStops:
    """Stop strings that count only where they end after the text of the first `min_tokens` tokens.

    An engine `StopFn` (ids, text -> stop?). Samples of one prompt share it: the text length at
    `min_tokens` tokens is kept per distinct first `min_tokens` ids (the engine calls it after every
    generated token, so it sees that length before any later call)."""

    def __init__(self, stops: list[str], min_tokens: int):
        self.stops, self.min_tokens = stops, min_tokens
        self.hold = max(len(s) for s in stops) - 1  # characters of a stream that may still become a stop string
        self._offsets: dict[tuple[int, ...], int] = {}

    def __call__(self, ids: list[int], text: str) -> bool:
        if len(ids) == self.min_tokens:
            self._offsets[tuple(ids)] = len(text)
        return self.match(ids, text) is not None

    def match(self, ids: list[int], text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string ending first after the first `min_tokens` tokens'
        text (ties: the earlier in the list, as vLLM), or None."""
        if len(ids) <= self.min_tokens:
            return None
        offset = self._offsets.get(tuple(ids[:self.min_tokens]), 0)
        best = None
        for s in self.stops:
            i = text.find(s, max(0, offset - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                best = (i, s)
        return best

    def finish(self, c: Completion) -> Completion:
        """`c` cut before the stop string that ended it, with its `stop_reason`."""
        hit = self.match(c.token_ids, c.text)
        if hit is None:
            return c
        return dataclasses.replace(c, text=c.text[:hit[0]], stop_reason=hit[1], finish_reason="stop")
