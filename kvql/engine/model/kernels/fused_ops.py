"""Row-wise layer operations in one pass each (fused_ops.c): RMSNorm, rotary embedding in place, act(gate) * up.

Why: a decode step runs dozens of small torch ops per layer besides its GEMMs and attention (the norm
alone is 8: cast, pow, mean, add, rsqrt, mul, cast, mul); on tensors of a few thousand elements each op's
time is mostly its fixed per-call cost, not its arithmetic (measured: docs/benchmarks.md, Design
measurements). These do each group in one call (kvql.engine.model.fused_layers puts them in the model's
layers).

Contracts (CPU tensors of one dtype, float32 or bfloat16; last dimension contiguous; rows may be strided):
- `rms_norm(x [..., n], weight [n], eps)` -> new tensor: `weight * (x / sqrt(mean(x^2) + eps))`, the
  normalized row rounded to the dtype before the weight (transformers' LlamaRMSNorm). n % 16 == 0.
  `plus_one=True`: `(1 + weight) * (x / ...)` in float32, rounded once (GemmaRMSNorm).
- `rope_(x [rows, heads * d], cos [rows, d], sin [rows, d], heads, d)`: in place, the first `heads` heads
  of each row `x * cos + rotate_half(x) * sin`; bit for bit transformers' apply_rotary_pos_emb.
- `gated_mul(gu [rows, 2n], act)` -> `[rows, n]`: `act(gu[:, :n]) * gu[:, n:]`, the activation rounded to
  the dtype before the product; act one of ACTIVATIONS ("silu", "gelu_tanh": GELU's tanh approximation).
  n % 16 == 0.
Each row is computed alone in a fixed order: batch-invariant. RMSNorm and the activations equal torch's to float32
rounding, not bit for bit (own reduction order and exp); the model runs them in both the engine and any
plain forward of the same model object, so kvql's exactness (cached == uncached) is unaffected.

Availability: built once per machine (kvql.engine.model.kernels.build) with -ffp-contract=off (each product and sum
rounded alone, as torch's separate ops); `available()` is False without a compiler, when the build fails,
or with `KVQL_FUSED_OPS=0`: the layers then keep transformers' own forward.
"""

from __future__ import annotations

import torch

from . import build

DTYPES = build.DTYPES


SIGNATURES = {
    "kvql_rms_norm": (None, [build.PTR, build.I64, build.PTR, build.PTR, build.I64, build.I64, build.I64, build.F32,
                             build.I32, build.I32, build.I32]),
    "kvql_rope": (None, [build.PTR, build.I64, build.I64, build.I64, build.I64, build.PTR, build.PTR, build.I64,
                         build.I32, build.I32]),
    "kvql_gated_mul": (None, [build.PTR, build.I64, build.PTR, build.I64, build.I64, build.I64, build.I32, build.I32,
                              build.I32]),
}
LIBRARY = build.Library("fused_ops", "KVQL_FUSED_OPS", "running transformers' own layers instead", SIGNATURES,
                        flags=["-ffp-contract=off"])


def available() -> bool:
    """Whether the kernels can run here (built on first call; a failure is warned about once)."""
    return LIBRARY.available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] without a copy (last dim contiguous, the leading dims one stride apart)."""
    assert x.stride(-1) == 1 and x.dtype in DTYPES and x.device.type == "cpu", (x.dtype, x.device, x.stride())
    return x.view(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    rows = _rows(x)
    n = rows.shape[1]
    assert n % 16 == 0 and weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    LIBRARY.get().kvql_rms_norm(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), n,
                                rows.shape[0], n, eps, int(plus_one), DTYPES[x.dtype], torch.get_num_threads())
    return out.view(x.shape)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    assert x.stride(-1) == 1 and x.shape[-1] >= heads * head_dim and head_dim % 2 == 0 and x.dtype in DTYPES
    assert cos.shape == sin.shape == (x.shape[0], head_dim) and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert cos.dtype == sin.dtype == x.dtype and x.device.type == cos.device.type == sin.device.type == "cpu"
    LIBRARY.get().kvql_rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(),
                            sin.data_ptr(), cos.stride(0), DTYPES[x.dtype], torch.get_num_threads())


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_mul(gu: torch.Tensor, act: str) -> torch.Tensor:
    rows = _rows(gu)
    n = rows.shape[1] // 2
    assert n % 16 == 0 and rows.shape[1] == 2 * n
    out = torch.empty(rows.shape[0], n, dtype=gu.dtype)
    LIBRARY.get().kvql_gated_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), n, rows.shape[0], n,
                                 ACTIVATIONS[act], DTYPES[gu.dtype], torch.get_num_threads())
    return out.view(*gu.shape[:-1], n)
