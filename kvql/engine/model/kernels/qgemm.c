/* Linear layers on quantized weights (contract in qgemm.py): out[m, n] = sum_k x[m, k] * w[n, k], w given as
   small integers q with a scale (and, 4-bit, a minimum) per group of G inputs: w = scale * q (+ min).

   x, per row and group g of 32 inputs, as int16: a = max |x|, sx = a / 32767, xq = round(x * (32767 / a)) (to
   nearest even), xsum = the inputs' sum in order. Why int16 and not llama.cpp's int8: a step of x's grid is 1/32767
   of the group's largest input, so two rows that differ by float rounding (two attention kernels' outputs) give
   outputs that differ by about as little (int8's steps of 1/127 made them differ by a few percent: the engine's
   check of a model against its own forward refused it); integer dot products (vpdpwssd) keep it fast.

   Weights, 16 outputs side by side (a "block"):
   - 8-bit: q int8 [n / 16][k / 2][16][2] (two inputs of an output side by side: what vpdpwssd multiplies);
     groups of G = 16 or 32.
   - 4-bit: q uint8 [n / 16][k / 4][16][2], byte i of an output's pair in quad j holding input 4 j + i in its low
     nibble and 4 j + 2 + i in its high one; groups of 32.
   scale (and min) [n / 16][k / G][16]: float16 or float32.

   Per output, one chain over the groups in order, from zero:
       acc = fma((float) isum_g, scale_g * sx_g, acc)     isum_g: the group's exact integer dot product of q and xq
       acc = fma(min_g, xsum_g, acc)                      (4-bit)
   and the output is acc (bfloat16: rounded once, to nearest even). The vector kernel (AVX512-VNNI) and the plain C
   one (`kvql_qgemm_ref`, everywhere) compute that same chain, so they agree bit for bit, and a row's result never
   depends on the rows beside it, the threads, or how many rows the call has: batch-invariant by construction. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define QGEMM_AVX512 1
const int kvql_qgemm_fast = 1;
#else
const int kvql_qgemm_fast = 0;
#endif

#define XMAX 32767.0f

static inline float h2f(uint16_t h) {
    /* float16 to float32, exact (subnormals included) */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f)
        u = sign | 0x7f800000u | (man << 13);
    else if (exp)
        u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        u = sign;
    else {
        int e = -1;
        do man <<= 1, e++; while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Row x (float32 or bfloat16, k inputs) quantized: xq[k], sx[k / 32], xsum[k / 32] (module doc). */
static void quantize_row(const void *x, int is_bf16, int64_t k, int16_t *xq, float *sx, float *xsum) {
    for (int64_t g = 0; g < k / 32; g++) {
        float v[32], a = 0.0f, s = 0.0f;
        for (int i = 0; i < 32; i++) {
            v[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[32 * g + i]) : ((const float *)x)[32 * g + i];
            a = fmaxf(a, fabsf(v[i]));
            s += v[i];
        }
        float inv = a > 0.0f ? XMAX / a : 0.0f;
        for (int i = 0; i < 32; i++) xq[32 * g + i] = (int16_t)nearbyintf(v[i] * inv);
        sx[g] = a / XMAX, xsum[g] = s;
    }
}

typedef struct {
    const void *q, *scale, *min; /* min: 4-bit only */
    int64_t n, k;
    int bits, group, scale_f32;
} qweight;

static inline float scale_at(const void *p, int64_t i, int is_f32) {
    return is_f32 ? ((const float *)p)[i] : h2f(((const uint16_t *)p)[i]);
}

static inline int32_t q_at(const qweight *w, int64_t b, int64_t j, int o) {
    if (w->bits == 8) return ((const int8_t *)w->q)[((b * (w->k / 2) + j / 2) * 16 + o) * 2 + j % 2];
    uint8_t byte = ((const uint8_t *)w->q)[((b * (w->k / 4) + j / 4) * 16 + o) * 2 + j % 2];
    return j % 4 < 2 ? byte & 15 : byte >> 4;
}

/* The chain of the module doc for the 16 outputs of block b and one quantized row: plain C. */
static void block_ref(const qweight *w, int64_t b, const int16_t *xq, const float *sx, const float *xsum, float *acc) {
    const int64_t G = w->group, groups = w->k / G;
    for (int o = 0; o < 16; o++) {
        float a = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t isum = 0;
            for (int64_t j = g * G; j < (g + 1) * G; j++) isum += q_at(w, b, j, o) * xq[j];
            int64_t at = (b * groups + g) * 16 + o;
            a = fmaf((float)isum, scale_at(w->scale, at, w->scale_f32) * sx[g * G / 32], a);
            if (w->bits == 4) a = fmaf(scale_at(w->min, at, w->scale_f32), xsum[g], a);
        }
        acc[o] = a;
    }
}

#ifdef QGEMM_AVX512
static inline __m512 scales16(const void *p, int64_t at, int is_f32) {
    return is_f32 ? _mm512_loadu_ps((const float *)p + at)
                  : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
}

/* Blocks b .. b + NB - 1 (16 outputs each) for R quantized rows (xq rows k apart, sx / xsum rows k / 32 apart):
   the same chain as block_ref, NB R integer sums in flight. acc[r * NB + i]: row r, block b + i. */
static inline __attribute__((always_inline)) void tile_acc(const qweight *w, int64_t b, const int16_t *xq,
                                                          const float *sx, const float *xsum, __m512 *acc,
                                                          const int NB, const int R) {
    const int64_t k = w->k, G = w->group, groups = k / G;
    #pragma GCC unroll 8
    for (int i = 0; i < NB * R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i is[8]; /* NB R <= 8; fixed sizes, so that the arrays live in registers once unrolled */
        #pragma GCC unroll 8
        for (int i = 0; i < NB * R; i++) is[i] = _mm512_setzero_si512();
        if (w->bits == 8) {
            for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++) { /* inputs 2 j, 2 j + 1 */
                __m512i wv[4];
                #pragma GCC unroll 8
                for (int i = 0; i < NB; i++)
                    wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                        (const __m256i *)((const int8_t *)w->q + ((b + i) * (k / 2) + j) * 32)));
                #pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t xp;
                    memcpy(&xp, xq + r * k + 2 * j, 4);
                    __m512i xv = _mm512_set1_epi32(xp);
                    #pragma GCC unroll 8
                    for (int i = 0; i < NB; i++) is[r * NB + i] = _mm512_dpwssd_epi32(is[r * NB + i], wv[i], xv);
                }
            }
        } else {
            for (int64_t j = g * G / 4; j < (g + 1) * G / 4; j++) { /* inputs 4 j .. 4 j + 3 */
                __m512i lo[4], hi[4];
                #pragma GCC unroll 8
                for (int i = 0; i < NB; i++) {
                    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        (const __m256i *)((const uint8_t *)w->q + ((b + i) * (k / 4) + j) * 32)));
                    lo[i] = _mm512_and_si512(v, _mm512_set1_epi16(15)), hi[i] = _mm512_srli_epi16(v, 4);
                }
                #pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xq + r * k + 4 * j, 4), memcpy(&x1, xq + r * k + 4 * j + 2, 4);
                    __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
                    #pragma GCC unroll 8
                    for (int i = 0; i < NB; i++) {
                        is[r * NB + i] = _mm512_dpwssd_epi32(is[r * NB + i], lo[i], v0);
                        is[r * NB + i] = _mm512_dpwssd_epi32(is[r * NB + i], hi[i], v1);
                    }
                }
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < NB; i++) {
            int64_t at = ((b + i) * groups + g) * 16;
            __m512 s = scales16(w->scale, at, w->scale_f32);
            __m512 m = w->bits == 4 ? scales16(w->min, at, w->scale_f32) : s;
            #pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                int n = r * NB + i;
                int64_t xg = r * (k / 32) + g * G / 32;
                acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[n]), _mm512_mul_ps(s, _mm512_set1_ps(sx[xg])), acc[n]);
                if (w->bits == 4) acc[n] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[xg]), acc[n]);
            }
        }
    }
}

static inline void store16(void *out, int64_t at, __m512 v, int is_bf16) {
    if (is_bf16) {
        float f[16];
        _mm512_storeu_ps(f, v);
        for (int o = 0; o < 16; o++) ((uint16_t *)out)[at + o] = f32_to_bf16(f[o]);
    } else
        _mm512_storeu_ps((float *)out + at, v);
}

/* Blocks b .. b + NB - 1 for rows m0 .. m0 + R - 1, written to out (rows ldo apart). */
static inline __attribute__((always_inline)) void tile(const qweight *w, int64_t b, int64_t m0, const int16_t *xq,
                                                       const float *sx, const float *xsum, void *out, int64_t ldo,
                                                       int is_bf16, const int NB, const int R) {
    __m512 acc[8];
    tile_acc(w, b, xq + m0 * w->k, sx + m0 * (w->k / 32), xsum + m0 * (w->k / 32), acc, NB, R);
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int i = 0; i < NB; i++) store16(out, (m0 + r) * ldo + (b + i) * 16, acc[r * NB + i], is_bf16);
}
#endif

static void store(void *out, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)out)[i] = f32_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static int valid(const qweight *w, int64_t rows) {
    return rows >= 1 && w->n % 16 == 0 && w->k % 32 == 0 && (w->bits == 8 || w->bits == 4)
           && (w->group == 32 || (w->group == 16 && w->bits == 8));
}

static int run(const void *x, int64_t ldx, const qweight *w, void *out, int64_t ldo, int64_t rows, int is_bf16,
               int threads, int ref) {
    if (!valid(w, rows)) return 1;
    const int64_t k = w->k, nb = w->n / 16;
    int16_t *xq = malloc(sizeof(int16_t) * rows * k);
    float *sx = malloc(sizeof(float) * rows * (k / 32)), *xsum = malloc(sizeof(float) * rows * (k / 32));
    if (!xq || !sx || !xsum) {
        free(xq), free(sx), free(xsum);
        return 1;
    }
    for (int64_t m = 0; m < rows; m++)
        quantize_row((const char *)x + m * ldx * (is_bf16 ? 2 : 4), is_bf16, k, xq + m * k, sx + m * (k / 32),
                     xsum + m * (k / 32));
#ifdef QGEMM_AVX512
    if (!ref) {
        /* one row: four blocks at a time (64 outputs, four weight streams); more: two blocks by four rows */
        const int64_t chunk = rows == 1 && nb >= 128 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (w->n * k * rows >= 1 << 15)
        for (int64_t c = 0; c < (nb + chunk - 1) / chunk; c++) {
            int64_t b = c * chunk;
            if (rows == 1) {
                if (chunk == 4 && b + 4 <= nb)
                    tile(w, b, 0, xq, sx, xsum, out, ldo, is_bf16, 4, 1);
                else if (b + 2 <= nb && b + 2 <= c * chunk + chunk)
                    tile(w, b, 0, xq, sx, xsum, out, ldo, is_bf16, 2, 1);
                else
                    for (; b < nb && b < c * chunk + chunk; b++) tile(w, b, 0, xq, sx, xsum, out, ldo, is_bf16, 1, 1);
                continue;
            }
            const int two = b + 2 <= nb;
            int64_t m = 0;
            for (; m + 4 <= rows; m += 4) {
                if (two)
                    tile(w, b, m, xq, sx, xsum, out, ldo, is_bf16, 2, 4);
                else
                    tile(w, b, m, xq, sx, xsum, out, ldo, is_bf16, 1, 4);
            }
            for (; m < rows; m++) {
                if (two)
                    tile(w, b, m, xq, sx, xsum, out, ldo, is_bf16, 2, 1);
                else
                    tile(w, b, m, xq, sx, xsum, out, ldo, is_bf16, 1, 1);
            }
        }
        free(xq), free(sx), free(xsum);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        float acc[16];
        for (int64_t m = 0; m < rows; m++) {
            block_ref(w, b, xq + m * k, sx + m * (k / 32), xsum + m * (k / 32), acc);
            for (int o = 0; o < 16; o++) store(out, m * ldo + b * 16 + o, acc[o], is_bf16);
        }
    }
    (void)ref;
    free(xq), free(sx), free(xsum);
    return 0;
}

/* x [rows, k] (rows ldx elements apart; float32 or bfloat16) times the quantized weight, into out [rows, n] (rows
   ldo apart, x's dtype). Returns 1 (nothing done) for a shape outside the contract or no memory. */
int kvql_qgemm(const void *x, int64_t ldx, const void *q, const void *scale, const void *min, void *out, int64_t ldo,
               int64_t rows, int64_t n, int64_t k, int bits, int group, int scale_f32, int is_bf16, int threads) {
    qweight w = {q, scale, min, n, k, bits, group, scale_f32};
    return run(x, ldx, &w, out, ldo, rows, is_bf16, threads, 0);
}

/* The same by the plain C chain (the reference the vector kernel equals bit for bit). */
int kvql_qgemm_ref(const void *x, int64_t ldx, const void *q, const void *scale, const void *min, void *out,
                   int64_t ldo, int64_t rows, int64_t n, int64_t k, int bits, int group, int scale_f32, int is_bf16,
                   int threads) {
    qweight w = {q, scale, min, n, k, bits, group, scale_f32};
    return run(x, ldx, &w, out, ldo, rows, is_bf16, threads, 1);
}
