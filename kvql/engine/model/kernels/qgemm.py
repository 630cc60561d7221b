"""Linear layers on quantized weights (qgemm.c): `x @ w.T` where w is 8-, 5- or 4-bit integers with a scale (5- and
4-bit: and a minimum) per group of inputs, as GGUF's blocks (`gguf_blocks`) and kvql's own int8 / int4 quantization
hold them.

Why: a decode step's time is the time to read the weights; 4-bit weights are a quarter of bf16's bytes, 8-bit half.
The arithmetic is llama.cpp's with a finer grid for x: each row quantized to int16 per 32 inputs (llama.cpp: int8),
integer dot products per group, one float step per group. The finer grid keeps an output as close to a continuous
function of its row as float rounding: the model computes its dequantized weights' products to about 1e-5, and
kvql's exactness (cached == uncached, against the model's own forward) holds as for a float model (qgemm.c says
why int8 did not).

Contract (CPU; x float32 or bfloat16, `[rows, k]`, last dimension contiguous, any rows):
- `QWeight.pack(q [n, k] ints, scale [n, k / group], min [n, k / group] or None)`: w = scale * q (+ min); without a
  min 8-bit q in [-128, 127] (group 16 or 32); with one, 4-bit q in [0, 15] (group 16 or 32) or 5-bit q in
  [0, 31] (group 32), the fewest bits that hold every value; n % 16 == 0, k % 32 == 0 (`fits`). Scales are kept as
  float16 where every one is exactly a float16, else float32: packing never rounds a weight.
- `qgemm(x, w)` -> `[rows, n]` in x's dtype: per row and output one float32 chain over the groups in order
  (qgemm.c), so each output depends on its own row only: batch-invariant whatever the rows beside it, the threads,
  or the kernel (every vector kernel equals the plain C one, `qgemm(..., reference=True)`, bit for bit; tested).
- `w.dequantized()`: the float32 weight it stands for (scale * q + min, exactly).

Kernels: the library is built once per machine for its own instruction set (`build`: -march=native), so the kernel
is chosen on the machine that runs it: AVX512-VNNI (vpdpwssd, 16 outputs a vector), else AVX2 + FMA + F16C
(vpmaddwd, 8 outputs a vector: AMD Zen 1-3, Intel's consumer cores), else the plain C chain (about 30x slower;
`kernel()` names it, the quantization report says so). `variants()`: every kernel this machine can run (the
native one and, on an AVX-512 machine with AVX2, the AVX2 build), for the tests that hold each to the plain chain.
`available()` is False without a compiler or with `KVQL_QGEMM=0` (`kvql.model(weights=...)` then says why it
cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import build

_ARGS = [build.PTR, build.I64, build.PTR, build.PTR, build.PTR, build.PTR, build.I64, build.I64, build.I64, build.I64,
         build.I32, build.I32, build.I32, build.I32, build.I32]
SIGNATURES = {"kvql_qgemm": (build.I32, _ARGS), "kvql_qgemm_ref": (build.I32, _ARGS)}
_FLAGS = ["-ffp-contract=off"]
LIBRARY = build.Library("qgemm", "KVQL_QGEMM", "quantized weights are dequantized", SIGNATURES, flags=_FLAGS,
                        limits=("kvql_qgemm_isa",))
KERNELS = ("plain C", "AVX2", "AVX512-VNNI")
"""`kvql_qgemm_isa`'s values: the vector kernel a build has."""
_AVX2 = build.Library("qgemm", "KVQL_QGEMM", "the AVX2 kernel is not tested", SIGNATURES,
                      flags=_FLAGS + ["-mno-avx512f"], limits=("kvql_qgemm_isa",))


def available() -> bool:
    return LIBRARY.available()


def kernel() -> str:
    """The kernel that runs here (module doc): "AVX512-VNNI", "AVX2" or "plain C"."""
    return KERNELS[LIBRARY.limits["kvql_qgemm_isa"]] if available() else "plain C"


def fast() -> bool:
    """Whether a vector kernel runs here (else the plain C chain: same results, about 30x slower)."""
    return kernel() != "plain C"


def variants() -> dict[str, build.Library]:
    """Every kernel this machine runs, by name (module doc): the native build's, and the AVX2 build's where the
    native one is AVX-512 and the CPU has AVX2 + FMA + F16C."""
    found = {kernel(): LIBRARY} if available() else {}
    flags = build.cpu_flags().split()
    if kernel() == "AVX512-VNNI" and {"avx2", "fma", "f16c"} <= set(flags) and _AVX2.available():
        found[KERNELS[_AVX2.limits["kvql_qgemm_isa"]]] = _AVX2
    return found


def fits(n: int, k: int) -> bool:
    """Whether a weight of `n` outputs and `k` inputs can be packed (module doc)."""
    return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0


@dataclass(frozen=True)
class QWeight:
    """A packed quantized weight (qgemm.c's layout): `q` int8 `[n / 16, k / 2, 16, 2]`, uint8 `[n / 16, k / 4, 16,
    2]` (4-bit: two values a byte) or uint8 `[n / 16, k / 4, 40]` (5-bit: the 4-bit quad's 32 bytes, then its fifth
    bits), `scale` (and `min`, 4- and 5-bit) float16 or float32 `[n / 16, k / group, 16]`."""
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    n: int
    k: int
    bits: int
    group: int

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None = None,
             bits: int | None = None) -> QWeight:
        """`bits` (with a min): 5 packs values that would fit 4 bits as 5 (weights stacked with 5-bit ones);
        None: the fewest bits that hold them."""
        n, k = q.shape
        group = k // max(scale.shape[1], 1)
        if bits is None or min is None:
            bits = 8 if min is None else 4 if q.numel() == 0 or q.max() <= 15 else 5
        if not fits(n, k) or scale.shape != (n, k // group) or group not in (16, 32) or (bits == 5 and group != 32):
            raise ValueError(f"qgemm: cannot pack a {bits}-bit weight {tuple(q.shape)} in groups of {group}")
        lo, hi = (-128, 127) if bits == 8 else (0, 2**bits - 1)
        if q.min() < lo or q.max() > hi:
            raise ValueError(f"qgemm: {bits}-bit values outside [{lo}, {hi}]")
        if bits == 8:
            packed = q.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).to(torch.int8).contiguous()
        else:  # quad j of an output: bytes (4 j, 4 j + 2) and (4 j + 1, 4 j + 3), the first input low
            quads = q.reshape(n // 16, 16, k // 4, 2, 2).long()
            low = quads & 15
            packed = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).transpose(1, 2).to(torch.uint8).contiguous()
            if bits == 5:  # fifth bits: word h of quad j, bit 2 o + i: output o's input 4 j + 2 h + i
                shifts = (2 * torch.arange(16).view(1, 16, 1, 1, 1) + torch.arange(2).view(1, 1, 1, 1, 2))
                words = ((quads >> 4) << shifts).sum((1, 4))  # [n / 16, k / 4, 2], below 2**32
                words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
                packed = torch.cat([packed.reshape(n // 16, k // 4, 32),
                                    words.contiguous().view(torch.uint8).reshape(n // 16, k // 4, 8)], -1)

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
        rows = torch.arange(self.n) if rows is None else rows
        if self.bits == 8:
            return self._rows(self.q, rows).to(torch.int32).reshape(len(rows), self.k)
        nibbles = self._rows(self.q[..., :32].reshape(self.n // 16, self.k // 4, 16, 2), rows).to(torch.int32)
        v = torch.stack([nibbles & 15, nibbles >> 4], 2)  # [T, k / 4, 2 (low, high), 2]
        if self.bits == 5:
            words = self.q[..., 32:].contiguous().view(torch.int32)[rows // 16].long()  # [T, k / 4, 2]
            shifts = (2 * (rows % 16)).view(-1, 1, 1, 1) + torch.arange(2).view(1, 1, 1, 2)
            v = v | (((words[..., None] >> shifts) & 1) << 4).to(torch.int32)
        return v.reshape(len(rows), self.k)

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


def qgemm(x: torch.Tensor, w: QWeight, reference: bool = False, library: build.Library | None = None) -> torch.Tensor:
    """`x [rows, k] @ w.T` as a new `[rows, n]` tensor in x's dtype (module doc); `library`: one of `variants()`
    (default: the native build)."""
    rows, k = x.shape
    assert k == w.k and x.dtype in build.DTYPES and x.stride(-1) == 1, (x.shape, x.dtype, w.k)
    out = torch.empty(rows, w.n, dtype=x.dtype)
    if rows == 0:
        return out
    lib = (library or LIBRARY).get()
    fn = lib.kvql_qgemm_ref if reference else lib.kvql_qgemm
    if fn(x.data_ptr(), x.stride(0), *pointers(w), out.data_ptr(), w.n, rows, *call_args(w),
          build.DTYPES[x.dtype], torch.get_num_threads()):
        raise RuntimeError(f"qgemm: shape out of range (x {tuple(x.shape)}, weight {w.n}x{w.k})")
    return out
