/* Small-batch linear layers on the CPU at the memory bandwidth (contract in gemv.py):
   out[m, n] = sum_k x[m, k] * w[n, k] for m < rows <= MAX_ROWS.

   bfloat16, where the CPU has AVX512_BF16: the weight in kvql's blocked layout, [n / 64][k / 2][64][2]
   (64 outputs side by side, two k at a time: what vdpbf16ps multiplies), read once, in memory order. The
   arithmetic is oneDNN's prepacked bf16 GEMM's, so each output equals oneDNN's bit for bit (measured,
   tests/test_gemv.py): one float32 chain per output over k in order, by vdpbf16ps (the odd product first,
   subnormals flushed), in blocks of 512 k each summed from zero then added to the running total, rounded
   once to bf16 by vcvtneps2bf16.

   bfloat16 without AVX512_BF16, where the CPU has AVX2 with FMA (oneDNN packs no bf16 weights there: this kernel
   computes such layers at every batch size): the same blocked layout; each weight and input widened to float32
   exactly, one fused multiply-add chain per output over k in order, from zero, rounded once to bf16 (to nearest
   even). One row at a time for 64 outputs (eight chains: a stream of the weight, what a decode step needs), or
   four rows at a time for 16 outputs (each widened weight used four times: a prompt's rows); an output's chain is
   the same either way, so a row's result never depends on the rows beside it.

   float32, where the CPU has AVX512F or AVX2 with FMA: the weight as [n / 64][k][64] (64 outputs side by side, one k at a
   time), read once, in memory order; one fused multiply-add chain per output over k in order, from zero.
   Not oneDNN's rounding (its order is its own): a float32 output agrees with oneDNN's to float32 rounding.

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
/* 8 bf16 weights widened to float32 (exact). */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void round8(__m256 a, uint16_t *o) {
    float f[8];
    _mm256_storeu_ps(f, a);
    for (int i = 0; i < 8; i++) o[i] = f32_to_bf16(f[i]);
}

/* Outputs 64 b .. 64 b + 63 for input row xm (widened to float32), from the block wb ([k][64]). */
static inline void bf16_fma_row(const float *xm, const uint16_t *wb, uint16_t *o, int64_t k) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        __m256 xj = _mm256_broadcast_ss(xm + j);
        const uint16_t *p = wb + 64 * j;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(widen8(p + 8 * i), xj, a[i]);
    }
    for (int i = 0; i < 8; i++) round8(a[i], o + 8 * i);
}

/* The same outputs for the four rows x, x + k, .. (widened; out rows ldo apart), 16 outputs at a time. */
static inline void bf16_fma_rows4(const float *x, const uint16_t *wb, uint16_t *o, int64_t ldo, int64_t k) {
    for (int s = 0; s < 64; s += 16) {
        __m256 a[4][2];
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            const uint16_t *p = wb + 64 * j + s;
            __m256 w0 = widen8(p), w1 = widen8(p + 8);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                __m256 xj = _mm256_broadcast_ss(x + r * k + j);
                a[r][0] = _mm256_fmadd_ps(w0, xj, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w1, xj, a[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) round8(a[r][0], o + r * ldo + s), round8(a[r][1], o + r * ldo + s + 8);
    }
}
#endif

#ifdef __AVX512F__
/* Outputs 64 b .. 64 b + 63 for input row xm, from the block wb ([k][64]). */
static inline void f32_block(const float *xm, const float *wb, float *o, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < k; j++) {
        __m512 xj = _mm512_set1_ps(xm[j]);
        const float *p = wb + 64 * j;
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(p), xj, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 16), xj, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 32), xj, a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(p + 48), xj, a3);
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
        const float *p = wb + 64 * j;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8 * i), xj, a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
}
#endif

/* w blocked (bf16: [n / 64][k / 2][64][2], float32: [n / 64][k][64]); x rows ldx apart, out rows ldo apart.
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
            for (; m + 4 <= rows; m += 4) bf16_fma_rows4(xf + m * k, wb, ob + m * ldo + 64 * b, ldo, k);
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
        for (int64_t b = 0; b < n / 64; b++)
            for (int64_t m = 0; m < rows; m++)
                f32_block((const float *)x + m * ldx, (const float *)w + 64 * b * k, (float *)out + m * ldo + 64 * b, k);
        return 0;
#endif
    }
    (void)x, (void)ldx, (void)w, (void)out, (void)ldo, (void)threads;
    return 1;
}
