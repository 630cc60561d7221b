"""The load check's plan and its verdict (admission.py's module doc, "verify"): how many tokens the numerical check
runs, in what parts, and whether the engine's logits equal the model's own forward's to rounding (the tolerance
per dtype: float32's 1e-3 of the largest logit; reduced precisions' 6e-2, their rounding of a long reduction)."""

from __future__ import annotations

import torch

from .admission import Geometry, UnsupportedModel

VERIFY_TOKENS = (7, 5)  # at least: computed first, then a chunk over the first part read back from the pool
VERIFY_DECODES = 3  # then this many one-token steps, each over everything before it read back from the pool
VERIFY_PAST = 8  # the check runs this many tokens past the longest window or chunk the model declares
VERIFY_ROWS = 16  # the chunk's last rows whose logits are compared (with the one-token steps'): past every span
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # max |engine - plain| / max |plain|; others below
REDUCED_TOLERANCE = 6e-2


def verify_plan(config, geometry: Geometry, room: int) -> tuple[int, int]:
    """(tokens computed first, tokens then computed as one chunk over them) of the numerical check (module doc),
    `VERIFY_DECODES` one-token steps following: together `VERIFY_PAST` tokens past the longest window or chunk
    that the layers (`geometry`) or the config declare (any positive integer field named `*window*` or
    `*chunk*`, so that a kind of attention kvql does not know of is run past its span too; spans no request
    can reach, at least the model's context or `room` tokens, are left out), at most `room` tokens (the pool's
    free slots). The first part reaches past half of the longest span, so the chunk's keys reach back across
    it too. The logits compared are those of the chunk's last `VERIFY_ROWS` tokens and of the one-token steps:
    every position past the spans, without a vocabulary-wide projection of every token (Gemma's 262,144)."""
    text = config.get_text_config()
    context = getattr(text, "max_position_embeddings", None) or room
    spans = [x for layer in geometry.layers for x in (layer.window, layer.chunk) if x]
    spans += [v for k, v in vars(text).items() if ("window" in k or "chunk" in k) and type(v) is int and v > 0]
    spans = [x for x in spans if x < min(context, room)]
    first, rest = VERIFY_TOKENS
    n = min(room, max([first + rest + VERIFY_DECODES] + [x + VERIFY_PAST for x in spans]))
    first = max(first, n // 2)
    return first, n - first - VERIFY_DECODES


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, REDUCED_TOLERANCE)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, offset: int = 0) -> float:
    """The largest difference of the engine's logits `got` (rows of token positions from `offset`) from the plain
    forward's `want`, relative to the largest of `want`; UnsupportedModel where it exceeds rounding (the message
    names the first position where they differ)."""
    scale = float(want.abs().max()) or 1.0
    rows = (got - want).abs().amax(dim=-1) / scale
    bad = ~(rows <= tolerance(dtype))  # NaN is bad too
    if bool(bad.any()):
        first = offset + int(bad.nonzero()[0])
        err = float(torch.nan_to_num(rows, nan=float("inf")).max())
        raise UnsupportedModel(
            f"{name!r}: logits computed over cached KV differ from the model's own forward of the same tokens "
            f"from token {first} of {offset + len(rows)} on (max relative difference {err:.2g}, tolerance "
            f"{tolerance(dtype):g} in {str(dtype).replace('torch.', '')}): the model keeps state outside "
            f"cache.update or its attention computes something the engine's does not")
    return float(rows.max()) if rows.numel() else 0.0
