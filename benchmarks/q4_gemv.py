"""A probe for issue 44 (quantized weights): how fast a plain C GEMV over GGUF Q4_1 blocks (the embedded SmolLM2's
format: 32 weights per block, an fp16 scale d and minimum m, 4-bit q; w = d * q + m) decodes one token at
SmolLM2-135M's shapes, two ways: float32 activations (each nibble widened to float, d * dot(x, q) + m * sum(x) per
block, as an exact reference would compute it) and int8 activations (x quantized to int8 per 32, nibbles times
int8 by AVX512-VNNI's vpdpbusd, as llama.cpp computes it). Not kvql's engine: a measurement of what such kernels
reach here, one output per loop iteration, threads over outputs, before any blocking or tuning; compare with
`./dev bench single_stream` (kvql bf16, llama.cpp on the Q4_1 file). Needs a C compiler and an AVX-512 VNNI CPU.
Usage: .venv/bin/python benchmarks/q4_gemv.py
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

SOURCE = r"""
// out[n] = sum_k x[k] * w[n,k], w in GGUF Q4_1 blocks (32 weights: fp16 d, fp16 m, 16 bytes nibbles),
// rows of n blocks contiguous. Two variants: fp32 (dequant nibble -> float, FMA), and int8 activations (x quantized
// per 32 to int8 with a float scale, nibbles x int8 via vpdpbusd), as llama.cpp does.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// fp32: per output, per block: d * dot(x_b, q) + m * sum(x_b)
void q4_gemv_f32(const float *x, const block_q4_1 *w, float *out, int64_t n, int64_t k) {
    int64_t nb = k / 32;
    float sx[nb];
    for (int64_t b = 0; b < nb; b++) { float s = 0; for (int j = 0; j < 32; j++) s += x[32 * b + j]; sx[b] = s; }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const block_q4_1 *row = w + i * nb;
        __m512 acc = _mm512_setzero_ps();
        float extra = 0;
        for (int64_t b = 0; b < nb; b++) {
            __m128i q = _mm_loadu_si128((const __m128i *)row[b].qs);
            __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
            __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
            __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
            __m512 dot = _mm512_mul_ps(flo, _mm512_loadu_ps(x + 32 * b));
            dot = _mm512_fmadd_ps(fhi, _mm512_loadu_ps(x + 32 * b + 16), dot);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(h2f(row[b].d)), dot, acc);
            extra += h2f(row[b].m) * sx[b];
        }
        out[i] = _mm512_reduce_add_ps(acc) + extra;
    }
}

// int8 activations: xq[k] int8, xs[b] scale per 32; per block: d * xs * sum(q * xq) + m * sx
void q4_gemv_i8(const int8_t *xq, const float *xs, const float *sx, const block_q4_1 *w, float *out, int64_t n,
                int64_t k) {
    int64_t nb = k / 32;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const block_q4_1 *row = w + i * nb;
        __m512 acc = _mm512_setzero_ps();
        float extra = 0;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {  // two blocks: 64 weights, one vpdpbusd
            __m128i q0 = _mm_loadu_si128((const __m128i *)row[b].qs);
            __m128i q1 = _mm_loadu_si128((const __m128i *)row[b + 1].qs);
            __m128i m4 = _mm_set1_epi8(15);
            __m256i u0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q0, 4), m4), _mm_and_si128(q0, m4));
            __m256i u1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q1, 4), m4), _mm_and_si128(q1, m4));
            __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
            __m512i xv = _mm512_loadu_si512(xq + 32 * b);
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv);  // 16 int32: 8 per block
            __m512 fs = _mm512_cvtepi32_ps(s);
            float s0 = h2f(row[b].d) * xs[b], s1 = h2f(row[b + 1].d) * xs[b + 1];  /* lanes 0-7: block b */
            __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
            acc = _mm512_fmadd_ps(fs, sc, acc);
            extra += h2f(row[b].m) * sx[b] + h2f(row[b + 1].m) * sx[b + 1];
        }
        out[i] = _mm512_reduce_add_ps(acc) + extra;
    }
}
"""

SHAPES = [(576, 960, 30), (576, 3072, 30), (1536, 576, 30), (576, 576, 30), (576, 49152, 1)]  # (k, n, per token)


def build(directory: Path) -> ctypes.CDLL:
    (directory / "q4.c").write_text(SOURCE)
    subprocess.run(["cc", "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(directory / "q4.so"),
                    str(directory / "q4.c")], check=True)
    lib = ctypes.CDLL(str(directory / "q4.so"))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q4_gemv_f32.argtypes = [ptr, ptr, ptr, i64, i64]
    lib.q4_gemv_i8.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64]
    return lib


def timed(fn, n: int = 300) -> float:
    """Microseconds per call, after a warm-up."""
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        lib = build(Path(d))
        per_token = {"f32": 0.0, "i8": 0.0}
        total = 0.0
        for k, n, count in SHAPES:
            blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
            blocks[..., 4:] = rng.integers(0, 256, (n, k // 32, 16))
            blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            blocks[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
            x = rng.standard_normal(k).astype(np.float32)
            out = np.zeros(n, np.float32)
            scale = (np.abs(x).reshape(-1, 32).max(1) / 127).astype(np.float32)
            xq = np.clip(np.round(x / scale.repeat(32)), -127, 127).astype(np.int8)
            sx = x.reshape(-1, 32).sum(1).astype(np.float32)
            f32 = timed(lambda: lib.q4_gemv_f32(x.ctypes.data, blocks.ctypes.data, out.ctypes.data, n, k))
            i8 = timed(lambda: lib.q4_gemv_i8(xq.ctypes.data, scale.ctypes.data, sx.ctypes.data, blocks.ctypes.data,
                                              out.ctypes.data, n, k))
            mb = blocks.nbytes / 1e6
            print(f"{k:>5} x {n:<6} {mb:5.1f} MB   f32 {f32:7.1f} us ({mb / f32 * 1e3:4.1f} GB/s)   "
                  f"int8 {i8:7.1f} us ({mb / i8 * 1e3:4.1f} GB/s)")
            per_token["f32"] += f32 * count
            per_token["i8"] += i8 * count
            total += mb * count
        print(f"one token's linear layers at SmolLM2-135M's shapes ({total:.0f} MB of Q4_1 blocks): "
              f"f32 {per_token['f32'] / 1e3:.2f} ms, int8 {per_token['i8'] / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
