"""Small-batch linear layers at the memory bandwidth (gemv.c): `x @ w.T` for a few rows of x, as a decode
step of one stream runs them; in bfloat16 bit for bit oneDNN's result.

Why: a decode step of one request multiplies one row by every weight of the model; its time is the time
to read the weights. oneDNN's prepacked GEMM (kvql.engine.model.cpu_linear) reads them well below the bandwidth
a plain sum reaches and pays a fixed cost per call that small layers feel; this kernel reads them close to
that sum's rate (measured: docs/benchmarks.md, Design measurements).

Contract (CPU, bfloat16 or float32, 1 <= rows <= max_rows(), or any rows where `any_rows(dtype)`; `supports(w)`
says whether a weight qualifies):
- `pack(w [n, k])`: the blocked copy the kernel reads (bf16 with AVX512_BF16 `[n / 64, k / 2, 64, 2]`, else
  `[n / 16, k, 16]`, bf16 interleaved within each 16: gemv.c; contiguous). Memory: a third copy of the weight beside the layer's own and oneDNN's packed
  one (where oneDNN packs it).
- `gemv(x [rows, k], packed) -> [rows, n]`: each output computed alone (whatever the rows beside it, the
  threads). bfloat16: bit for bit oneDNN's prepacked bf16 GEMM's for that row (same instruction, same order
  over k: gemv.c), so a layer may switch between the two by batch size without changing any result
  (tests/test_gemv.py checks it over the models' layer shapes; kvql.engine.model.cpu_linear checks it again on
  each layer's weight before using it). bfloat16 without AVX512_BF16 (`rounds_as_onednn()` False; AVX2 with
  FMA, where oneDNN packs no bf16 weight): weights and inputs widened to float32, one fused multiply-add chain
  per output over k in order, rounded once; it takes any number of rows (`any_rows`), so cpu_linear computes
  such a layer with it at every batch size: the same chain per output whatever the batch (batch-invariant by
  construction). Why: torch's plain bf16 kernel is the alternative there, and this one runs several times
  faster at every batch size, near oneDNN's float32 GEMM at large ones (measured: docs/benchmarks.md, Design
  measurements). float32: one fused multiply-add chain per output over k in order,
  equal to oneDNN's to float32 rounding, not bit for bit (float32 promises no batch invariance: the
  engine's float32 contract, cached == uncached greedy output, is tested through the model).
Float32 needs the blocked copy: a row-major fp32 kernel without one was slower than oneDNN's (it needs 4
read streams per thread for speed, then a chain per output's lanes; measured: docs/benchmarks.md, Design
measurements).

Availability: built once per machine (kvql.engine.model.kernels.build). `available(dtype)` is False when there is
no compiler, the build fails, the CPU lacks the dtype's instructions (AVX512F or AVX2 with FMA; bf16: AVX512_BF16
or AVX2 with FMA), or `KVQL_GEMV=0`. The layers then run oneDNN's kernel (or, bf16 without oneDNN's, the plain
one) at every batch size.
"""

from __future__ import annotations

import torch

from . import build

SIGNATURES = {"kvql_gemv": (build.I32, [build.PTR, build.I64, build.PTR, build.PTR, build.I64, build.I64,
                                        build.I64, build.I64, build.I32, build.I32])}
LIBRARY = build.Library("gemv", "KVQL_GEMV", "running oneDNN's GEMM at every batch size", SIGNATURES,
                        limits=("kvql_gemv_bf16", "kvql_gemv_f32", "kvql_gemv_max_rows", "kvql_gemv_bf16_onednn",
                                "kvql_gemv_bf16_any_rows", "kvql_gemv_f32_fast_rows", "kvql_gemv_bf16_fast_rows"))
_FLAGS = {torch.bfloat16: "kvql_gemv_bf16", torch.float32: "kvql_gemv_f32"}


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel can run here for `dtype` (module doc; built on first call, a failure warned about once)."""
    return dtype in _FLAGS and LIBRARY.available() and bool(LIBRARY.limits[_FLAGS[dtype]])


def rounds_as_onednn() -> bool:
    """Whether the bf16 kernel rounds as oneDNN's prepacked bf16 GEMM (AVX512_BF16), else it is the widening one."""
    return available(torch.bfloat16) and bool(LIBRARY.limits["kvql_gemv_bf16_onednn"])


def any_rows(dtype: torch.dtype) -> bool:
    """Whether `gemv` takes any number of rows in `dtype` (the widening bf16 kernel: module doc), not only
    `max_rows()`."""
    return dtype == torch.bfloat16 and available(dtype) and bool(LIBRARY.limits["kvql_gemv_bf16_any_rows"])


def max_rows() -> int:
    """The most rows of x one call takes (0 when unavailable)."""
    return LIBRARY.limits["kvql_gemv_max_rows"] if LIBRARY.available() else 0


def fast_rows(dtype: torch.dtype) -> int:
    """The most rows one call computes faster than oneDNN's prepacked GEMM in `dtype` (0 when unavailable).
    Fixed per build (gemv.c), from measurement: `max_rows()` where a few rows share each weight load (AVX2
    builds), 4 where rows run one after another (AVX512 builds); docs/benchmarks.md, Design measurements."""
    if not available(dtype):
        return 0
    return LIBRARY.limits["kvql_gemv_f32_fast_rows" if dtype == torch.float32 else "kvql_gemv_bf16_fast_rows"]


def supports(w: torch.Tensor) -> bool:
    """Whether the kernel takes weight `w`: a 2-D bfloat16 or float32 CPU tensor, n % 64 == 0 (bf16: k even),
    and available() for its dtype."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.shape[0] % 64 == 0
            and (w.dtype == torch.float32 or w.shape[1] % 2 == 0) and available(w.dtype))


def pack(w: torch.Tensor) -> torch.Tensor:
    """The blocked copy of `w` that `gemv` reads (module doc)."""
    n, k = w.shape
    if w.dtype == torch.float32:
        return w.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()
    if not rounds_as_onednn():
        # output 16 g + 8 h + i at [g, j, 2 i + h]: gemv.c's widen16 takes 16 at once
        return w.detach().reshape(n // 16, 2, 8, k).permute(0, 3, 2, 1).reshape(n // 16, k, 16).contiguous()
    return w.detach().reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def shape(packed: torch.Tensor) -> tuple[int, int]:
    """`(n, k)`, the shape of the weight `packed` was made from (`pack`)."""
    return packed.shape[0] * packed.shape[2], packed.shape[1] * (2 if packed.dim() == 4 else 1)


def gemv(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x [rows, k] @ w.T` as a new `[rows, n]` tensor, from `packed = pack(w)` (module doc)."""
    rows, k = x.shape
    n, k_packed = shape(packed)
    assert x.dtype == packed.dtype and x.dtype in _FLAGS and x.stride(-1) == 1 and k_packed == k, (
        x.shape, packed.shape)
    out = torch.empty(rows, n, dtype=x.dtype)
    if LIBRARY.get().kvql_gemv(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n, rows, n, k,
                               int(x.dtype == torch.bfloat16), torch.get_num_threads()):
        raise RuntimeError(f"gemv: shape out of range (x {tuple(x.shape)}, packed {tuple(packed.shape)})")
    return out
