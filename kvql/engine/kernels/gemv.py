"""Small-batch bfloat16 linear layers at the memory bandwidth (gemv.c): `x @ w.T` for a few rows of x, as a
decode step of one stream runs them, bit for bit oneDNN's result.

Why: a decode step of one request multiplies one row by every weight of the model; its time is the time
to read the weights. oneDNN's prepacked GEMM (kvql.engine.cpu_linear) reads them well below the bandwidth
a plain sum reaches and pays a fixed cost per call that small layers feel. Measured over SmolLM2-135M's
bf16 linear weight set (random, 269 MB, one row, one thread, one run): oneDNN 23.6 GB/s, this kernel 34.0
GB/s, a torch sum over as many bytes 36.6 GB/s.

Contract (CPU, bfloat16, 1 <= rows <= max_rows(); `supports(w)` says whether a weight qualifies):
- `pack(w [n, k])`: the blocked copy the kernel reads (`[n / 64, k / 2, 64, 2]`, contiguous). Memory: a
  third copy of the weight beside the layer's own and oneDNN's packed one.
- `gemv(x [rows, k], packed) -> [rows, n]`: each output bit for bit oneDNN's prepacked bf16 GEMM's for that
  row (same instruction, same order over k: gemv.c), whatever the rows beside it, so a layer may switch
  between the two by batch size without changing any result (tests/test_gemv.py checks it over the models'
  layer shapes; kvql.engine.cpu_linear checks it again on each layer's weight before using it).
Float32 is not offered: a row-major fp32 kernel without a copy measured slower than oneDNN's here (4 read
streams per thread needed for speed, then a chain per output's lanes: 26 vs 32 GB/s on one core).

Availability: built once per machine (kvql.engine.kernels.build). `available()` is False when there is no
compiler, the build fails, the CPU has no AVX512_BF16 (without it oneDNN does not round as this does), or
`KVQL_GEMV=0`. The layers then run oneDNN's kernel at every batch size.
"""

from __future__ import annotations

import torch

from . import build

SIGNATURES = {"kvql_gemv": (build.I32, [build.PTR, build.I64, build.PTR, build.PTR, build.I64, build.I64,
                                        build.I64, build.I64, build.I32])}
LIBRARY = build.Library("gemv", "KVQL_GEMV", "running oneDNN's GEMM at every batch size", SIGNATURES,
                        limits=("kvql_gemv_bf16", "kvql_gemv_max_rows"))


def available() -> bool:
    """Whether the kernel can run here (module doc; built on first call, a failure warned about once)."""
    return LIBRARY.available() and bool(LIBRARY.limits["kvql_gemv_bf16"])


def max_rows() -> int:
    """The most rows of x one call takes (0 when unavailable)."""
    return LIBRARY.limits["kvql_gemv_max_rows"] if available() else 0


def supports(w: torch.Tensor) -> bool:
    """Whether the kernel takes weight `w`: a 2-D bfloat16 CPU tensor, n % 64 == 0, k even, and available()."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % 64 == 0
            and w.shape[1] % 2 == 0 and available())


def pack(w: torch.Tensor) -> torch.Tensor:
    """The blocked copy of `w` that `gemv` reads (module doc)."""
    n, k = w.shape
    return w.detach().reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x [rows, k] @ w.T` as a new `[rows, n]` tensor, from `packed = pack(w)` (module doc)."""
    rows, k = x.shape
    n = packed.shape[0] * 64
    assert x.dtype == packed.dtype == torch.bfloat16 and x.stride(-1) == 1 and packed.shape[1] * 2 == k, (
        x.shape, packed.shape)
    out = torch.empty(rows, n, dtype=x.dtype)
    if LIBRARY.get().kvql_gemv(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n, rows, n, k,
                               torch.get_num_threads()):
        raise RuntimeError(f"gemv: shape out of range (x {tuple(x.shape)}, packed {tuple(packed.shape)})")
    return out
