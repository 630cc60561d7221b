/* Small-batch linear layers on the CPU at the memory bandwidth (contract in gemv.py):
   out[m, n] = sum_k x[m, k] * w[n, k] for m < rows <= MAX_ROWS.

   bfloat16, where the CPU has AVX512_BF16: the weight in kvql's blocked layout, [n / 64][k / 2][64][2]
   (64 outputs side by side, two k at a time: what vdpbf16ps multiplies), read once, in memory order. The
   arithmetic is oneDNN's prepacked bf16 GEMM's, so each output equals oneDNN's bit for bit (measured,
   tests/test_gemv.py): one float32 chain per output over k in order, by vdpbf16ps (the odd product first,
   subnormals flushed), in blocks of 512 k each summed from zero then added to the running total, rounded
   once to bf16 by vcvtneps2bf16.

   float32, where the CPU has AVX512F or AVX2 with FMA: the weight as [n / 64][k][64] (64 outputs side by side, one k at a
   time), read once, in memory order; one fused multiply-add chain per output over k in order, from zero.
   Not oneDNN's rounding (its order is its own): a float32 output agrees with oneDNN's to float32 rounding.

   Threads split the outputs in blocks of 64: an output never depends on the thread
   or on the other outputs or rows of the call. */

#include <stdint.h>
#include <string.h>

#include "simd.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef __AVX512BF16__
const int kvql_gemv_bf16 = 1;
#else
const int kvql_gemv_bf16 = 0;
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
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8 * i), xj, a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
}
#endif

/* w blocked (bf16: [n / 64][k / 2][64][2], float32: [n / 64][k][64]); x rows ldx apart, out rows ldo apart.
   Returns 1 (nothing done) when the shape is outside the contract or the CPU lacks the dtype's instructions. */
int kvql_gemv(const void *x, int64_t ldx, const void *w, void *out, int64_t ldo, int64_t rows, int64_t n,
              int64_t k, int is_bf16, int threads) {
    if (rows < 1 || rows > MAX_ROWS || n % 64 || (is_bf16 && k % 2)) return 1;
    if (is_bf16) {
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
