"""Linear layers on quantized weights (qgemm.c): `x @ w.T` where w is 8-bit or 4-bit integers with a scale (4-bit:
and a minimum) per group of inputs, as GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K blocks and kvql's own int8 /
int4 quantization hold them.

Why: a decode step's time is the time to read the weights; 4-bit weights are a quarter of bf16's bytes, 8-bit half.
The arithmetic is llama.cpp's with a finer grid for x: each row quantized to int16 per 32 inputs (llama.cpp: int8),
integer dot products per group, one float step per group. The finer grid keeps an output as close to a continuous
function of its row as float rounding: the model computes its dequantized weights' products to about 1e-5, and
kvql's exactness (cached == uncached, against the model's own forward) holds as for a float model (qgemm.c says
why int8 did not).

Contract (CPU; x float32 or bfloat16, `[rows, k]`, last dimension contiguous, any rows):
- `QWeight.pack(q [n, k] ints, scale [n, k / group], min [n, k / group] or None)`: w = scale * q (+ min); 8-bit q in
  [-128, 127] (group 16 or 32), 4-bit q in [0, 15] with a min (group 32); n % 16 == 0, k % 32 == 0 (`fits`). Scales
  are kept as float16 where every one is exactly a float16, else float32: packing never rounds a weight.
- `qgemm(x, w)` -> `[rows, n]` in x's dtype: per row and output one float32 chain over the groups in order
  (qgemm.c), so each output depends on its own row only: batch-invariant whatever the rows beside it, the threads,
  or the kernel (the AVX512-VNNI one equals the plain C one, `qgemm(..., reference=True)`, bit for bit; tested).
- `w.dequantized()`: the float32 weight it stands for (scale * q + min, exactly).

Availability: built once per machine (`build`); `available()` is False without a compiler or with `KVQL_QGEMM=0`
(`kvql.model(weights=...)` then says why it cannot). `fast()`: whether the vector kernel runs here (AVX512-VNNI);
without it the plain C chain computes the same results, several times slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import build

_ARGS = [build.PTR, build.I64, build.PTR, build.PTR, build.PTR, build.PTR, build.I64, build.I64, build.I64, build.I64,
         build.I32, build.I32, build.I32, build.I32, build.I32]
SIGNATURES = {"kvql_qgemm": (build.I32, _ARGS), "kvql_qgemm_ref": (build.I32, _ARGS)}
LIBRARY = build.Library("qgemm", "KVQL_QGEMM", "quantized weights are dequantized", SIGNATURES,
                        flags=["-ffp-contract=off"], limits=("kvql_qgemm_fast",))


def available() -> bool:
    return LIBRARY.available()


def fast() -> bool:
    """Whether the AVX512-VNNI kernel runs here (else the plain C chain: same results, several times slower)."""
    return available() and bool(LIBRARY.limits["kvql_qgemm_fast"])


def fits(n: int, k: int) -> bool:
    """Whether a weight of `n` outputs and `k` inputs can be packed (module doc)."""
    return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0


@dataclass(frozen=True)
class QWeight:
    """A packed quantized weight (qgemm.c's layout): `q` int8 `[n / 16, k / 2, 16, 2]` or uint8 `[n / 16, k / 4, 16,
    2]` (two 4-bit values a byte), `scale` (and `min`, 4-bit) float16 or float32 `[n / 16, k / group, 16]`."""
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    n: int
    k: int
    bits: int
    group: int

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None = None) -> QWeight:
        n, k = q.shape
        group = k // max(scale.shape[1], 1)
        bits = 8 if min is None else 4
        if not fits(n, k) or scale.shape != (n, k // group) or (bits == 4 and group != 32) or group not in (16, 32):
            raise ValueError(f"qgemm: cannot pack a {bits}-bit weight {tuple(q.shape)} in groups of {group}")
        lo, hi = (-128, 127) if bits == 8 else (0, 15)
        if q.min() < lo or q.max() > hi:
            raise ValueError(f"qgemm: {bits}-bit values outside [{lo}, {hi}]")
        if bits == 8:
            packed = q.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).to(torch.int8).contiguous()
        else:  # quad j of an output: bytes (4 j, 4 j + 2) and (4 j + 1, 4 j + 3), the first input low
            quads = q.reshape(n // 16, 16, k // 4, 2, 2)
            packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).transpose(1, 2).to(torch.uint8).contiguous()

        def per_block(t: torch.Tensor) -> torch.Tensor:
            t = t.float().reshape(n // 16, 16, k // group).transpose(1, 2).contiguous()
            return t.half() if torch.equal(t.half().float(), t) else t

        scale_, min_ = per_block(scale), None if min is None else per_block(min)
        if min_ is not None and min_.dtype != scale_.dtype:
            scale_, min_ = scale_.float(), min_.float()
        return cls(packed, scale_, min_, n, k, bits, group)

    def _rows(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Outputs `rows` (all: None) of a per-block tensor `[n / 16, X, 16, ...]` as `[len(rows), X, ...]`."""
        rows = torch.arange(self.n) if rows is None else rows
        return t[rows // 16, :, rows % 16]

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integers q of outputs `rows` (all: None), unpacked: `[len(rows), k]` int32."""
        b = self._rows(self.q, rows).to(torch.int32)  # [T, k / 2 or k / 4, 2]
        if self.bits == 4:
            b = torch.stack([b & 15, b >> 4], 2)  # [T, k / 4, 2 (low, high), 2]
        return b.reshape(b.shape[0], self.k)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight of outputs `rows` (all: None), `[len(rows), k]`: scale * q (+ min), each product and sum
        rounded once (exact for GGUF's formats: a float16 scale times a small integer fits float32's mantissa)."""
        def per_input(t):
            return self._rows(t, rows).float().repeat_interleave(self.group, 1)

        w = per_input(self.scale) * self.values(rows).float()
        return w if self.min is None else w + per_input(self.min)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    @classmethod
    def cat(cls, parts: list[QWeight]) -> QWeight:
        """Weights of the same k, bits and group stacked along the outputs (one GEMM for q/k/v or gate/up)."""
        first = parts[0]
        if any((p.k, p.bits, p.group) != (first.k, first.bits, first.group) for p in parts):
            raise ValueError("qgemm: stacked weights differ in inputs, bits or group")
        dtype = torch.float32 if any(p.scale.dtype == torch.float32 for p in parts) else torch.float16

        def cat(ts):
            return None if ts[0] is None else torch.cat(ts)

        return cls(cat([p.q for p in parts]), cat([p.scale.to(dtype) for p in parts]),
                   cat([None if p.min is None else p.min.to(dtype) for p in parts]), sum(p.n for p in parts),
                   first.k, first.bits, first.group)


def call_args(w: QWeight) -> tuple:
    """The weight's part of `kvql_qgemm`'s arguments after `out, ldo, rows`: (n, k, bits, group, scale_f32)."""
    return w.n, w.k, w.bits, w.group, int(w.scale.dtype == torch.float32)


def pointers(w: QWeight) -> tuple:
    """The weight's pointers in `kvql_qgemm`'s arguments after `x, ldx`: (q, scale, min)."""
    return w.q.data_ptr(), w.scale.data_ptr(), 0 if w.min is None else w.min.data_ptr()


def qgemm(x: torch.Tensor, w: QWeight, reference: bool = False) -> torch.Tensor:
    """`x [rows, k] @ w.T` as a new `[rows, n]` tensor in x's dtype (module doc)."""
    rows, k = x.shape
    assert k == w.k and x.dtype in build.DTYPES and x.stride(-1) == 1, (x.shape, x.dtype, w.k)
    out = torch.empty(rows, w.n, dtype=x.dtype)
    if rows == 0:
        return out
    lib = LIBRARY.get()
    fn = lib.kvql_qgemm_ref if reference else lib.kvql_qgemm
    if fn(x.data_ptr(), x.stride(0), *pointers(w), out.data_ptr(), w.n, rows, *call_args(w),
          build.DTYPES[x.dtype], torch.get_num_threads()):
        raise RuntimeError(f"qgemm: shape out of range (x {tuple(x.shape)}, weight {w.n}x{w.k})")
    return out
