"""Recurrent layers over a ragged batch of requests, each segment's tokens in order from its own state, updated in
place (recurrent_step.c).

Why: transformers' torch code for a batch of requests' steps stacks every request's state into one tensor, passes
over it about nine times per token (decay, k^T S, the update, q^T S, each an op and a temporary) and splits it
again, and a prompt's chunk runs the chunked algorithm in dozens of small ops; these read each state where it lies
and keep it in cache while the segment's tokens run (the recurrent form: a token's arithmetic does not depend on
how a prompt was chunked).

Contracts (CPU; a segment is `n_tok[s]` consecutive rows from `row0[s]`; `states`: one tensor per segment,
contiguous, not shared between segments):
- `short_conv_(x [rows, channels], row0, n_tok, states [1, channels, taps] each, weight [channels, taps], bias
  [channels] or None, silu)` -> `[rows, channels]` (rows outside every segment: unset): per token the state shifted
  left one tap, the token's x its last, the output `act(sum(weight * state) + bias)`; x, states, weight, bias and
  the output in one dtype of DTYPES (float32 arithmetic; the sum rounded to the dtype before the activation, as
  torch's convolution in that dtype).
- `gated_delta_(q [rows, k_heads, dk], k [rows, k_heads, dk], v [rows, v_heads, dv], g [rows, v_heads], beta [rows,
  v_heads], row0, n_tok, states [1, v_heads, dk, dv] each)` -> `[rows, v_heads, dv]`, all float32: the gated delta
  rule per token (the C file's doc), each value head reading the key head `h // (v_heads // k_heads)`.
- `ssd_(x [rows, heads, head_dim], B [rows, groups, state], C [rows, groups, state], dt [rows, heads], A [heads], D
  [heads] or None, row0, n_tok, states [1, heads, head_dim, state] each)` -> `[rows, heads, head_dim]`, all float32:
  Mamba2's selective state space step per token (the C file's doc; `dt` after its bias and softplus).
Each segment alone, in a fixed order: batch-invariant. Equal to transformers' torch code to float32 rounding, not
bit for bit (another order of the same sums; its chunked form for prompts): the load check
(model_runner.ModelRunner.verify) compares the model so computed with its own forward and steps.

Availability: built once per machine (kvql.engine.model.kernels.build) with -ffp-contract=off; `available()` is
False without a compiler, when the build fails, or with `KVQL_RECURRENT_STEP=0` (the model's own code runs
then).
"""

from __future__ import annotations

import torch

from . import build

DTYPES = build.DTYPES
SIGNATURES = {
    "kvql_short_conv": (None, [build.I64, build.PTR, build.PTR, build.I64, build.I64, build.PTR, build.I64, build.PTR,
                               build.PTR, build.PTR, build.PTR, build.I64, build.I32, build.I32, build.I32]),
    "kvql_gated_delta": (None, [build.I64, build.PTR, build.PTR, build.I64, build.I64, build.I64, build.I64, build.PTR,
                                build.PTR, build.PTR, build.PTR, build.PTR, build.PTR, build.PTR, build.I32]),
    "kvql_ssd": (None, [build.I64, build.PTR, build.PTR, build.I64, build.I64, build.I64, build.I64, build.PTR, build.PTR,
                        build.PTR, build.PTR, build.PTR, build.PTR, build.PTR, build.PTR, build.I32]),
}
LIBRARY = build.Library("recurrent_step", "KVQL_RECURRENT_STEP", "running the model's own code instead",
                        SIGNATURES, flags=["-ffp-contract=off"])


def available() -> bool:
    return LIBRARY.available()


class Segments:
    """Where each segment's tokens are: `row0`, `n_tok` (int64, CPU), as the kernels take them."""

    def __init__(self, row0: list[int], n_tok: list[int]):
        self.row0, self.n_tok = (torch.tensor(x, dtype=torch.int64) for x in (row0, n_tok))
        self.count = len(row0)
        self.rows = max((a + n for a, n in zip(row0, n_tok)), default=0)

    @classmethod
    def single(cls, rows: int) -> Segments:
        """One token each."""
        return cls(list(range(rows)), [1] * rows)


def _pointers(states: list[torch.Tensor], dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    for s in states:
        assert s.dtype == dtype and s.is_contiguous() and s.device.type == "cpu" and tuple(s.shape) == shape, (
            s.dtype, s.shape, shape)
    return torch.tensor([s.data_ptr() for s in states], dtype=torch.int64)


def short_conv_(x: torch.Tensor, segs: Segments, states: list[torch.Tensor], weight: torch.Tensor,
                bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    rows, channels = x.shape
    taps = weight.shape[-1]
    assert x.stride(-1) == 1 and x.dtype in DTYPES and weight.dtype == x.dtype and weight.is_contiguous()
    assert weight.shape == (channels, taps) and len(states) == segs.count and segs.rows <= rows
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (channels,))
    ptrs = _pointers(states, x.dtype, (1, channels, taps))
    out = torch.empty(rows, channels, dtype=x.dtype)
    LIBRARY.get().kvql_short_conv(segs.count, segs.row0.data_ptr(), segs.n_tok.data_ptr(), channels, taps,
                                  x.data_ptr(), x.stride(0), ptrs.data_ptr(), weight.data_ptr(),
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), channels, int(silu),
                                  DTYPES[x.dtype], torch.get_num_threads())
    return out


def gated_delta_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 segs: Segments, states: list[torch.Tensor]) -> torch.Tensor:
    rows, k_heads, dk = q.shape
    v_heads, dv = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == rows and g.shape == beta.shape == (rows, v_heads)
    assert v_heads % k_heads == 0 and len(states) == segs.count and segs.rows <= rows
    for t in (q, k, v, g, beta):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    ptrs = _pointers(states, torch.float32, (1, v_heads, dk, dv))
    out = torch.empty(rows, v_heads, dv)
    LIBRARY.get().kvql_gated_delta(segs.count, segs.row0.data_ptr(), segs.n_tok.data_ptr(), v_heads, k_heads, dk,
                                   dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                   ptrs.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def ssd_(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor | None,
         segs: Segments, states: list[torch.Tensor]) -> torch.Tensor:
    rows, heads, head_dim = x.shape
    groups, state = B.shape[1:]
    assert C.shape == B.shape and B.shape[0] == rows and dt.shape == (rows, heads) and A.shape == (heads,)
    assert heads % groups == 0 and len(states) == segs.count and segs.rows <= rows
    for t in (x, B, C, dt, A) + (() if D is None else (D,)):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    ptrs = _pointers(states, torch.float32, (1, heads, head_dim, state))
    out = torch.empty(rows, heads, head_dim)
    LIBRARY.get().kvql_ssd(segs.count, segs.row0.data_ptr(), segs.n_tok.data_ptr(), heads, head_dim, groups, state,
                           x.data_ptr(), B.data_ptr(), C.data_ptr(), dt.data_ptr(), A.data_ptr(),
                           None if D is None else D.data_ptr(), ptrs.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
    return out
