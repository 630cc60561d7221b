/* Small-batch linear layers on the CPU at the memory bandwidth (contract in gemv.py):
   out[m, n] = sum_k x[m, k] * w[n, k] for m < rows <= MAX_ROWS.

   bfloat16, where the CPU has AVX512_BF16: the weight in kvql's blocked layout, [n / 64][k / 2][64][2]
   (64 outputs side by side, two k at a time: what vdpbf16ps multiplies), read once, in memory order. The
   arithmetic is oneDNN's prepacked bf16 GEMM's, so each output equals oneDNN's bit for bit (measured,
   tests/test_gemv.py): one float32 chain per output over k in order, by vdpbf16ps (the odd product first,
   subnormals flushed), in blocks of 512 k each summed from zero then added to the running total, rounded
   once to bf16 by vcvtneps2bf16.

   float32 (AVX512F, or AVX2 with FMA) and bfloat16 without AVX512_BF16 (AVX2 with FMA; oneDNN packs no bf16 weights
   there, so this kernel computes such layers at every batch size): the weight as [n / 16][k][16] (16 outputs
   side by side, one k at a time; bf16 interleaved within the 16 so that one 32-byte load widens into two
   vectors: widen16). One fused multiply-add chain per output over k in order, from zero (bf16: weights and
   inputs widened to float32 exactly, the sum rounded once to bf16, to nearest even). One row: 64 outputs at
   a time, four streams of the weight (what a decode step needs). Two to four rows: 16 outputs at a time, one
   stream, each weight loaded once for all the rows (speculative drafts, a prompt's rows). An output's chain
   is the same either way, so a row's result never depends on the rows beside it. Float32 is not oneDNN's
   rounding (its order is its own): a float32 output agrees with oneDNN's to float32 rounding.

   Threads split the outputs in blocks of 64: an output never depends on the thread
   or on the other outputs or rows of the call. */

#include <stdint.h>
#include <string.h>

#include "simd.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX512BF16__
const int kvql_gemv_bf16 = 1, kvql_gemv_bf16_onednn = 1, kvql_gemv_bf16_any_rows = 0;
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMV_BF16_FMA 1
const int kvql_gemv_bf16 = 1, kvql_gemv_bf16_onednn = 0, kvql_gemv_bf16_any_rows = 1;
#else
const int kvql_gemv_bf16 = 0, kvql_gemv_bf16_onednn = 0, kvql_gemv_bf16_any_rows = 0;
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define GEMV_F32 1
const int kvql_gemv_f32 = 1;
#else
const int kvql_gemv_f32 = 0;
#endif
#define MAX_ROWS 8
const int kvql_gemv_max_rows = MAX_ROWS;
#define KBLOCK 512 /* oneDNN's: k in blocks of 512, each summed from zero */

#ifdef __AVX512BF16__
/* Outputs 64 b .. 64 b + 63 for input row xm, from the block wb ([k / 2][64][2]). */
static inline void bf16_block(const uint16_t *xm, const uint16_t *wb, uint16_t *o, int64_t k) {
    __m512 t[4];
    for (int64_t kb = 0; kb < k; kb += KBLOCK) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t ke = kb + KBLOCK < k ? kb + KBLOCK : k;
        for (int64_t j = kb / 2; j < ke / 2; j++) {
            int32_t pair;
            memcpy(&pair, xm + 2 * j, sizeof pair);
            __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
            const uint16_t *p = wb + 128 * j;
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)p), xp);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(p + 32)), xp);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(p + 64)), xp);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(p + 96)), xp);
        }
        if (kb) {
            t[0] = _mm512_add_ps(t[0], a0), t[1] = _mm512_add_ps(t[1], a1);
            t[2] = _mm512_add_ps(t[2], a2), t[3] = _mm512_add_ps(t[3], a3);
        } else
            t[0] = a0, t[1] = a1, t[2] = a2, t[3] = a3;
    }
    for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(o + 16 * i), (__m256i)_mm512_cvtneps_pbh(t[i]));
}
#endif

#ifdef GEMV_BF16_FMA
/* 16 bf16 weights widened to float32 (exact): the layout interleaves them (kvql.engine.kernels.gemv.pack), so
   the even ones (the low half of each 32-bit pair) are outputs 0..7 and the odd ones outputs 8..15. */
static inline void widen16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void round8(__m256 a, uint16_t *o) {
    float f[8];
    _mm256_storeu_ps(f, a);
    for (int i = 0; i < 8; i++) o[i] = f32_to_bf16(f[i]);
}

/* Outputs 64 b .. 64 b + 63 for input row xm (widened to float32), from the block wb ([4][k][16]: four streams). */
static inline void bf16_fma_row(const float *xm, const uint16_t *wb, uint16_t *o, int64_t k) {
    /* named accumulators, not an array: GCC keeps an array's elements in memory across the loop */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, lo, hi;
    for (int64_t j = 0; j < k; j++) {
        __m256 xj = _mm256_broadcast_ss(xm + j);
        const uint16_t *p = wb + 16 * j;
        widen16(p, &lo, &hi), a0 = _mm256_fmadd_ps(lo, xj, a0), a1 = _mm256_fmadd_ps(hi, xj, a1);
        widen16(p + 16 * k, &lo, &hi), a2 = _mm256_fmadd_ps(lo, xj, a2), a3 = _mm256_fmadd_ps(hi, xj, a3);
        widen16(p + 32 * k, &lo, &hi), a4 = _mm256_fmadd_ps(lo, xj, a4), a5 = _mm256_fmadd_ps(hi, xj, a5);
        widen16(p + 48 * k, &lo, &hi), a6 = _mm256_fmadd_ps(lo, xj, a6), a7 = _mm256_fmadd_ps(hi, xj, a7);
    }
    round8(a0, o), round8(a1, o + 8), round8(a2, o + 16), round8(a3, o + 24);
    round8(a4, o + 32), round8(a5, o + 40), round8(a6, o + 48), round8(a7, o + 56);
}

/* The same outputs for R (2 to 4) rows x, x + k, .. (widened; out rows ldo apart), 16 outputs at a time: each
   widened weight used R times. */
static inline __attribute__((always_inline)) void bf16_fma_rows(const float *x, const uint16_t *wb, uint16_t *o,
                                                                int64_t ldo, int64_t k, const int R) {
    for (int s = 0; s < 64; s += 16) {
        /* named accumulators, not an array: GCC keeps an array's elements in memory across the loop */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
        for (int64_t j = 0; j < k; j++) {
            __m256 w0, w1, xj;
            widen16(wb + s * k + 16 * j, &w0, &w1);
            xj = _mm256_broadcast_ss(x + j), a0 = _mm256_fmadd_ps(w0, xj, a0), a1 = _mm256_fmadd_ps(w1, xj, a1);
            xj = _mm256_broadcast_ss(x + k + j), b0 = _mm256_fmadd_ps(w0, xj, b0), b1 = _mm256_fmadd_ps(w1, xj, b1);
            if (R > 2) xj = _mm256_broadcast_ss(x + 2 * k + j), c0 = _mm256_fmadd_ps(w0, xj, c0), c1 = _mm256_fmadd_ps(w1, xj, c1);
            if (R > 3) xj = _mm256_broadcast_ss(x + 3 * k + j), d0 = _mm256_fmadd_ps(w0, xj, d0), d1 = _mm256_fmadd_ps(w1, xj, d1);
        }
        uint16_t *q = o + s;
        round8(a0, q), round8(a1, q + 8), round8(b0, q + ldo), round8(b1, q + ldo + 8);
        if (R > 2) round8(c0, q + 2 * ldo), round8(c1, q + 2 * ldo + 8);
        if (R > 3) round8(d0, q + 3 * ldo), round8(d1, q + 3 * ldo + 8);
    }
}
#endif

#ifdef __AVX512F__
/* Outputs 64 b .. 64 b + 63 for input row xm, from the block wb ([4][k][16]: four streams). */
static inline void f32_block(const float *xm, const float *wb, float *o, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < k; j++) {
        __m512 xj = _mm512_set1_ps(xm[j]);
        const float *p = wb + 16 * j;
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p), xj, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 16 * k), xj, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 32 * k), xj, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 48 * k), xj, a3);
    }
    _mm512_storeu_ps(o, a0), _mm512_storeu_ps(o + 16, a1), _mm512_storeu_ps(o + 32, a2), _mm512_storeu_ps(o + 48, a3);
}
#elif defined(GEMV_F32)
/* The same with 8-wide vectors (AVX2 + FMA): eight accumulators of 8 outputs each. */
static inline void f32_block(const float *xm, const float *wb, float *o, int64_t k) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        __m256 xj = _mm256_set1_ps(xm[j]);
        const float *p = wb + 16 * j;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(p + (i / 2) * 16 * k + 8 * (i % 2)), xj, a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
}

/* The same outputs for R (2 to 4) rows of x (ldx apart; out rows ldo apart), 16 outputs at a time: each weight
   vector loaded once for the R rows. Each output's chain is f32_block's, so a row's result never depends on
   the rows beside it. */
static inline __attribute__((always_inline)) void f32_rows(const float *x, int64_t ldx, const float *wb, float *o,
                                                           int64_t ldo, int64_t k, const int R) {
    /* named accumulators, not an array: GCC keeps an array's elements in memory across the loop */
    for (int s = 0; s < 4; s++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
        const float *p = wb + 16 * s * k;
        for (int64_t j = 0; j < k; j++, p += 16) {
            __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8), xj;
            __asm__("" : "+x"(w0), "+x"(w1)); /* loaded once into registers, not folded into each row's FMA */
            xj = _mm256_broadcast_ss(x + j), a0 = _mm256_fmadd_ps(w0, xj, a0), a1 = _mm256_fmadd_ps(w1, xj, a1);
            xj = _mm256_broadcast_ss(x + ldx + j), b0 = _mm256_fmadd_ps(w0, xj, b0), b1 = _mm256_fmadd_ps(w1, xj, b1);
            if (R > 2) xj = _mm256_broadcast_ss(x + 2 * ldx + j), c0 = _mm256_fmadd_ps(w0, xj, c0), c1 = _mm256_fmadd_ps(w1, xj, c1);
            if (R > 3) xj = _mm256_broadcast_ss(x + 3 * ldx + j), d0 = _mm256_fmadd_ps(w0, xj, d0), d1 = _mm256_fmadd_ps(w1, xj, d1);
        }
        float *q = o + 16 * s;
        _mm256_storeu_ps(q, a0), _mm256_storeu_ps(q + 8, a1), _mm256_storeu_ps(q + ldo, b0), _mm256_storeu_ps(q + ldo + 8, b1);
        if (R > 2) _mm256_storeu_ps(q + 2 * ldo, c0), _mm256_storeu_ps(q + 2 * ldo + 8, c1);
        if (R > 3) _mm256_storeu_ps(q + 3 * ldo, d0), _mm256_storeu_ps(q + 3 * ldo + 8, d1);
    }
}

/* Two rows, two of the four 16-output sub-blocks at a time (two streams of the weight; measured faster than
   f32_rows' one). */
static inline void f32_rows2(const float *x, int64_t ldx, const float *wb, float *o, int64_t ldo, int64_t k) {
    for (int s = 0; s < 4; s += 2) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
        const float *p = wb + 16 * s * k, *q = p + 16 * k;
        for (int64_t j = 0; j < k; j++, p += 16, q += 16) {
            __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8), v0 = _mm256_loadu_ps(q), v1 = _mm256_loadu_ps(q + 8);
            __asm__("" : "+x"(w0), "+x"(w1), "+x"(v0), "+x"(v1));
            __m256 x0 = _mm256_broadcast_ss(x + j), x1 = _mm256_broadcast_ss(x + ldx + j);
            a0 = _mm256_fmadd_ps(w0, x0, a0), a1 = _mm256_fmadd_ps(w1, x0, a1);
            b0 = _mm256_fmadd_ps(w0, x1, b0), b1 = _mm256_fmadd_ps(w1, x1, b1);
            c0 = _mm256_fmadd_ps(v0, x0, c0), c1 = _mm256_fmadd_ps(v1, x0, c1);
            d0 = _mm256_fmadd_ps(v0, x1, d0), d1 = _mm256_fmadd_ps(v1, x1, d1);
        }
        float *r = o + 16 * s;
        _mm256_storeu_ps(r, a0), _mm256_storeu_ps(r + 8, a1), _mm256_storeu_ps(r + ldo, b0), _mm256_storeu_ps(r + ldo + 8, b1);
        _mm256_storeu_ps(r + 16, c0), _mm256_storeu_ps(r + 24, c1), _mm256_storeu_ps(r + ldo + 16, d0), _mm256_storeu_ps(r + ldo + 24, d1);
    }
}
#define F32_ROWS 1
#endif

/* The most rows a call computes faster than oneDNN's prepacked GEMM (gemv.py: fast_rows): a few rows share each
   weight load on AVX2 (measured to 8); elsewhere one row after another (measured to 4 by earlier builds). */
#if defined(F32_ROWS)
const int kvql_gemv_f32_fast_rows = MAX_ROWS;
#else
const int kvql_gemv_f32_fast_rows = 4;
#endif
#ifdef GEMV_BF16_FMA
const int kvql_gemv_bf16_fast_rows = MAX_ROWS;
#else
const int kvql_gemv_bf16_fast_rows = 4;
#endif

/* w blocked (bf16 with AVX512_BF16: [n / 64][k / 2][64][2], else [n / 16][k][16]); x rows ldx apart, out rows ldo
   apart.
   Returns 1 (nothing done) when the shape is outside the contract or the CPU lacks the dtype's instructions. */
int kvql_gemv(const void *x, int64_t ldx, const void *w, void *out, int64_t ldo, int64_t rows, int64_t n,
              int64_t k, int is_bf16, int threads) {
    if (rows < 1 || (rows > MAX_ROWS && !(is_bf16 && kvql_gemv_bf16_any_rows)) || n % 64 || (is_bf16 && k % 2))
        return 1;
    if (is_bf16) {
#ifdef GEMV_BF16_FMA
        /* the rows widened once (exact), read by every block */
        float *xf = malloc(sizeof(float) * rows * k);
        if (!xf) return 1;
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < k; j++) xf[m * k + j] = bf16_to_f32(((const uint16_t *)x)[m * ldx + j]);
        uint16_t *ob = (uint16_t *)out;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k * rows >= 1 << 15)
        for (int64_t b = 0; b < n / 64; b++) {
            const uint16_t *wb = (const uint16_t *)w + 64 * b * k;
            int64_t m = 0;
            for (; m + 4 <= rows; m += 4) bf16_fma_rows(xf + m * k, wb, ob + m * ldo + 64 * b, ldo, k, 4);
            if (rows - m == 3) bf16_fma_rows(xf + m * k, wb, ob + m * ldo + 64 * b, ldo, k, 3), m += 3;
            if (rows - m == 2) bf16_fma_rows(xf + m * k, wb, ob + m * ldo + 64 * b, ldo, k, 2), m += 2;
            for (; m < rows; m++) bf16_fma_row(xf + m * k, wb, ob + m * ldo + 64 * b, k);
        }
        free(xf);
        return 0;
#endif
#ifdef __AVX512BF16__
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 1 << 15)
        for (int64_t b = 0; b < n / 64; b++)
            for (int64_t m = 0; m < rows; m++)
                bf16_block((const uint16_t *)x + m * ldx, (const uint16_t *)w + 64 * b * k,
                           (uint16_t *)out + m * ldo + 64 * b, k);
        return 0;
#endif
    } else {
#ifdef GEMV_F32
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= 1 << 14)
        for (int64_t b = 0; b < n / 64; b++) {
            const float *xf = (const float *)x, *wb = (const float *)w + 64 * b * k;
            float *ob = (float *)out + 64 * b;
            int64_t m = 0;
#ifdef F32_ROWS
            for (; rows - m >= 4; m += 4) f32_rows(xf + m * ldx, ldx, wb, ob + m * ldo, ldo, k, 4);
            if (rows - m == 3) f32_rows(xf + m * ldx, ldx, wb, ob + m * ldo, ldo, k, 3), m += 3;
            if (rows - m == 2) f32_rows2(xf + m * ldx, ldx, wb, ob + m * ldo, ldo, k), m += 2;
#endif
            for (; m < rows; m++) f32_block(xf + m * ldx, wb, ob + m * ldo, k);
        }
        return 0;
#endif
    }
    (void)x, (void)ldx, (void)w, (void)out, (void)ldo, (void)threads;
    return 1;
}
