/* Linear layers on quantized weights (contract in qgemm.py): out[m, n] = sum_k x[m, k] * w[n, k], w given as
   small integers q with a scale (and, 4- and 5-bit, a minimum) per group of G inputs: w = scale * q (+ min).

   x, per row and group g of 32 inputs, as int16: a = max |x|, sx = a / 32767, xq = round(x * (32767 / a)) (to
   nearest even); xsum = the inputs' sum in order, per 32 inputs and per 16 (a group's own). Why int16 and not
   llama.cpp's int8: a step of x's grid is 1/32767 of the group's largest input, so two rows that differ by float
   rounding (two attention kernels' outputs) give outputs that differ by about as little (int8's steps of 1/127
   made them differ by a few percent: the engine's check of a model against its own forward refused it); integer
   dot products (vpdpwssd, vpmaddwd) keep it fast.

   Weights, 16 outputs side by side (a "block"):
   - 8-bit: q int8 [n / 16][k / 2][16][2] (two inputs of an output side by side: what vpdpwssd multiplies);
     groups of G = 16 or 32; no minimum.
   - 4-bit: q uint8 [n / 16][k / 4][16][2] (a "quad" j: 32 bytes), byte i of an output's pair in quad j holding
     input 4 j + i in its low nibble and 4 j + 2 + i in its high one; groups of 16 or 32, with a minimum.
   - 5-bit: the 4-bit quad's 32 bytes, then two uint32 of fifth bits (40 bytes a quad): bit 2 o + i of the first
     is output o's input 4 j + i's, of the second its input 4 j + 2 + i's (the lanes the nibbles widen to);
     groups of 32, with a minimum.
   scale (and min) [n / 16][k / G][16]: float16 or float32.

   Per output, one chain over the groups in order, from zero:
       acc = fma((float) isum_g, scale_g * sx_g, acc)     isum_g: the group's exact integer dot product of q and xq
       acc = fma(min_g, xsum_g, acc)                      (4- and 5-bit)
   and the output is acc (bfloat16: rounded once, to nearest even). The vector kernels (AVX512-VNNI; AVX2 + FMA +
   F16C) and the plain C one (`kvql_qgemm_ref`, everywhere) compute that same chain, so they agree bit for bit,
   and a row's result never depends on the rows beside it, the threads, or how many rows the call has:
   batch-invariant by construction. Which vector kernel a library has is fixed where it is built (-march=native:
   the machine it runs on); `kvql_qgemm_isa` says which. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QGEMM_AVX512 1
const int kvql_qgemm_isa = 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_AVX2 1
const int kvql_qgemm_isa = 1;
#else
const int kvql_qgemm_isa = 0;
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

/* Row x (float32 or bfloat16, k inputs) quantized: xq[k], sx[k / 32], and xs[k / G] the sums of its groups of G
   (16 or 32) inputs, each in order (module doc). */
static void quantize_row(const void *x, int is_bf16, int64_t k, int64_t G, int16_t *xq, float *sx, float *xs) {
    for (int64_t g = 0; g < k / 32; g++) {
        float v[32], a = 0.0f, h[2] = {0.0f, 0.0f};
        for (int i = 0; i < 32; i++) {
            v[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[32 * g + i]) : ((const float *)x)[32 * g + i];
            a = fmaxf(a, fabsf(v[i]));
            h[G == 16 ? i / 16 : 0] += v[i];
        }
        float inv = a > 0.0f ? XMAX / a : 0.0f;
        for (int i = 0; i < 32; i++) xq[32 * g + i] = (int16_t)nearbyintf(v[i] * inv);
        sx[g] = a / XMAX;
        if (G == 16)
            xs[2 * g] = h[0], xs[2 * g + 1] = h[1];
        else
            xs[g] = h[0];
    }
}

typedef struct {
    const void *q, *scale, *min; /* min: 4- and 5-bit */
    int64_t n, k;
    int bits, group, scale_f32;
} qweight;

/* bytes of a quad (4 inputs of 16 outputs) in the 4- and 5-bit layouts */
static inline int64_t quad_bytes(int bits) { return bits == 5 ? 40 : 32; }

static inline float scale_at(const void *p, int64_t i, int is_f32) {
    return is_f32 ? ((const float *)p)[i] : h2f(((const uint16_t *)p)[i]);
}

static inline int32_t q_at(const qweight *w, int64_t b, int64_t j, int o) {
    if (w->bits == 8) return ((const int8_t *)w->q)[((b * (w->k / 2) + j / 2) * 16 + o) * 2 + j % 2];
    const uint8_t *quad = (const uint8_t *)w->q + (b * (w->k / 4) + j / 4) * quad_bytes(w->bits);
    const int low = j % 4 < 2;
    int32_t v = low ? quad[o * 2 + j % 2] & 15 : quad[o * 2 + j % 2] >> 4;
    if (w->bits == 5) {
        uint32_t fifth;
        memcpy(&fifth, quad + 32 + (low ? 0 : 4), 4);
        v |= (int32_t)((fifth >> (2 * o + j % 2)) & 1) << 4;
    }
    return v;
}

/* The chain of the module doc for the 16 outputs of block b and one quantized row: plain C. */
static void block_ref(const qweight *w, int64_t b, const int16_t *xq, const float *sx, const float *xs, float *acc) {
    const int64_t G = w->group, groups = w->k / G;
    for (int o = 0; o < 16; o++) {
        float a = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            int32_t isum = 0;
            for (int64_t j = g * G; j < (g + 1) * G; j++) isum += q_at(w, b, j, o) * xq[j];
            int64_t at = (b * groups + g) * 16 + o;
            a = fmaf((float)isum, scale_at(w->scale, at, w->scale_f32) * sx[g * G / 32], a);
            if (w->min) a = fmaf(scale_at(w->min, at, w->scale_f32), xs[g], a);
        }
        acc[o] = a;
    }
}

#include "qgemm_avx512.h"
#include "qgemm_avx2.h"

static void store(void *out, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)out)[i] = f32_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

static int valid(const qweight *w, int64_t rows) {
    if (rows < 1 || w->n % 16 || w->k % 32) return 0;
    if (w->bits == 8) return w->group == 16 || w->group == 32;
    if (!w->min) return 0;
    return (w->bits == 4 && (w->group == 16 || w->group == 32)) || (w->bits == 5 && w->group == 32);
}

#ifndef WIDENS
#define WIDENS 0
#define WIDE_ROWS 0
#endif

#ifdef QGEMM_VECTOR
/* Blocks of chunk c (of `chunk` blocks) for every row, in the widest tiles that fit. */
static inline void chunk_tiles(const qweight *w, int64_t c, int64_t chunk, int64_t nb, int64_t rows,
                               const int16_t *xq, const float *sx, const float *xs, void *out, int64_t ldo,
                               int is_bf16, int16_t *wide) {
    int64_t b = c * chunk, end = b + chunk < nb ? b + chunk : nb;
    if (rows == 1) {
#if ONE_ROW_BLOCKS == 4
        if (end - b == 4) {
            tile(w, b, 0, xq, sx, xs, out, ldo, is_bf16, 4, 1);
            return;
        }
#endif
        for (; b + 2 <= end; b += 2) tile(w, b, 0, xq, sx, xs, out, ldo, is_bf16, 2, 1);
        for (; b < end; b++) tile(w, b, 0, xq, sx, xs, out, ldo, is_bf16, 1, 1);
        return;
    }
    int64_t m = 0;
#ifdef QGEMM_AVX2
    if (wide) {
        widen(w, b, end - b, wide);
        for (; b < end; b++, wide += 16 * w->k) {
            for (m = 0; m + 4 <= rows; m += 4) tile_of(w, b, wide, m, xq, sx, xs, out, ldo, is_bf16, 1, 4, 1);
            for (; m < rows; m++) tile_of(w, b, wide, m, xq, sx, xs, out, ldo, is_bf16, 1, 1, 1);
        }
        return;
    }
    if (w->bits != 4) { /* 8- and 5-bit: one block by four rows (their widening weighs more than 4-bit's) */
        for (; b < end; b++) {
            for (m = 0; m + 4 <= rows; m += 4) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, 1, 4);
            for (; m < rows; m++) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, 1, 1);
        }
        return;
    }
#endif
    if (end - b == TILE_BLOCKS) {
        for (; m + TILE_ROWS <= rows; m += TILE_ROWS) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, TILE_BLOCKS, TILE_ROWS);
        for (; m < rows; m++) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, TILE_BLOCKS, 1);
        return;
    }
    for (; m + TILE_ROWS <= rows; m += TILE_ROWS) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, 1, TILE_ROWS);
    for (; m < rows; m++) tile(w, b, m, xq, sx, xs, out, ldo, is_bf16, 1, 1);
}
#endif

static int run(const void *x, int64_t ldx, const qweight *w, void *out, int64_t ldo, int64_t rows, int is_bf16,
               int threads, int ref) {
    if (!valid(w, rows)) return 1;
    const int64_t k = w->k, nb = w->n / 16;
    const int64_t groups = k / w->group;
    int16_t *xq = malloc(sizeof(int16_t) * rows * k);
    float *sx = malloc(sizeof(float) * rows * (k / 32)), *xs = malloc(sizeof(float) * rows * groups);
    if (!xq || !sx || !xs) {
        free(xq), free(sx), free(xs);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * k >= 1 << 14)
    for (int64_t m = 0; m < rows; m++) /* each row on its own: the same whoever quantizes it */
        quantize_row((const char *)x + m * ldx * (is_bf16 ? 2 : 4), is_bf16, k, w->group, xq + m * k,
                     sx + m * (k / 32), xs + m * groups);
#ifdef QGEMM_VECTOR
    if (!ref) {
        /* one row: ONE_ROW_BLOCKS blocks a chunk where there are enough for every thread, else two */
        const int64_t chunk = rows > 1 ? TILE_BLOCKS : nb >= 128 ? ONE_ROW_BLOCKS : 2;
#pragma omp parallel num_threads(threads) if (w->n * k * rows >= 1 << 15)
        {
            /* a chunk's weights widened for its rows (AVX2; without the memory, tiles widen as they go) */
            int16_t *wide = WIDENS && w->bits != 8 && rows >= WIDE_ROWS ? malloc(sizeof(int16_t) * chunk * 16 * k) : NULL;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < (nb + chunk - 1) / chunk; c++)
                chunk_tiles(w, c, chunk, nb, rows, xq, sx, xs, out, ldo, is_bf16, wide);
            free(wide);
        }
        free(xq), free(sx), free(xs);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        float acc[16];
        for (int64_t m = 0; m < rows; m++) {
            block_ref(w, b, xq + m * k, sx + m * (k / 32), xs + m * groups, acc);
            for (int o = 0; o < 16; o++) store(out, m * ldo + b * 16 + o, acc[o], is_bf16);
        }
    }
    (void)ref;
    free(xq), free(sx), free(xs);
    return 0;
}

/* x [rows, k] (rows ldx elements apart; float32 or bfloat16) times the quantized weight, into out [rows, n] (rows
   ldo apart, x's dtype). Returns 1 (nothing done) for a shape outside the contract or no memory. */
int kvql_qgemm(const void *x, int64_t ldx, const void *q, const void *scale, const void *min, void *out, int64_t ldo,
               int64_t rows, int64_t n, int64_t k, int bits, int group, int scale_f32, int is_bf16, int threads) {
    qweight w = {q, scale, min, n, k, bits, group, scale_f32};
    return run(x, ldx, &w, out, ldo, rows, is_bf16, threads, 0);
}

/* The same by the plain C chain (the reference the vector kernels equal bit for bit). */
int kvql_qgemm_ref(const void *x, int64_t ldx, const void *q, const void *scale, const void *min, void *out,
                   int64_t ldo, int64_t rows, int64_t n, int64_t k, int bits, int group, int scale_f32, int is_bf16,
                   int threads) {
    qweight w = {q, scale, min, n, k, bits, group, scale_f32};
    return run(x, ldx, &w, out, ldo, rows, is_bf16, threads, 1);
}
