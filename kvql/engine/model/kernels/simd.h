/* Float32 vectors of 16 lanes (GCC vector extensions) shared by kvql's C kernels: bfloat16 conversions,
   a fixed-order lane sum, and a vectorized exp. Every function is elementwise or a fixed sequence of
   operations: a lane's result depends only on its own inputs (what makes the kernels batch-invariant). */

#ifndef KVQL_SIMD_H
#define KVQL_SIMD_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define LANES 16

typedef float v16 __attribute__((vector_size(4 * LANES), aligned(64)));
typedef int32_t i16 __attribute__((vector_size(4 * LANES)));
typedef uint32_t u16v __attribute__((vector_size(4 * LANES)));
typedef uint16_t h16 __attribute__((vector_size(2 * LANES)));
/* the same at any address: loads and stores through these are plain unaligned vector moves (a memcpy into an
   aligned v16 went through the stack on AVX2) */
typedef float v16u __attribute__((vector_size(4 * LANES), aligned(4), may_alias));
typedef uint16_t h16u __attribute__((vector_size(2 * LANES), aligned(2), may_alias));

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* r[m] = the sum of the 16 lanes of a[m], for each m by the same tree: lanes (l, l+8), then (l, l+4),
   (l, l+2), (l, l+1). */
#if defined(__AVX2__) && !defined(__AVX512F__)
/* The same tree on 8-lane halves (gcc lowers the 16-lane two-input shuffles below to scalar moves on AVX2):
   each step adds the same pairs of lanes, so each sum is bit for bit the generic version's. */
static inline __m256 sums8(const v16 *a) { /* the sums of a[0..7], in order */
    __m256 t[4], u[2];
    const float *f = (const float *)a;
    for (int i = 0; i < 4; i++) {
        const float *x0 = f + 32 * i, *y0 = x0 + 16;
        __m256 x = _mm256_add_ps(_mm256_loadu_ps(x0), _mm256_loadu_ps(x0 + 8)); /* (l, l+8) */
        __m256 y = _mm256_add_ps(_mm256_loadu_ps(y0), _mm256_loadu_ps(y0 + 8));
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)); /* (l, l+4) */
    }
    for (int i = 0; i < 2; i++) /* (l, l+2): t[2i] holds a[4i], a[4i+1]; t[2i+1] a[4i+2], a[4i+3] */
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    /* (l, l+1): lanes then hold the sums of a[0], a[2], a[4], a[6] | a[1], a[3], a[5], a[7] */
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xdd));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline v16 lane_sums(const v16 *a) {
    v16 r;
    _mm256_storeu_ps((float *)&r, sums8(a)), _mm256_storeu_ps((float *)&r + 8, sums8(a + 8));
    return r;
}

static inline float lane_sum(v16 v) {
    __m256 s = _mm256_add_ps(_mm256_loadu_ps((const float *)&v), _mm256_loadu_ps((const float *)&v + 8));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
static inline v16 lane_sums(const v16 *a) {
    const i16 l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16 l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i16 l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16 l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i16 l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l1a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], l1b);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l2a) + __builtin_shuffle(b[2 * i], b[2 * i + 1], l2b);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], l3a) + __builtin_shuffle(c[2 * i], c[2 * i + 1], l3b);
    return __builtin_shuffle(e[0], e[1], l4a) + __builtin_shuffle(e[0], e[1], l4b);
}

/* The sum of v's 16 lanes, by lane_sums' tree. */
static inline float lane_sum(v16 v) {
    v16 a[LANES] = {v}; /* the other vectors zero */
    return lane_sums(a)[0];
}
#endif

static inline v16 splat(float x) { return (v16){0} + x; }

static inline v16 pick(i16 mask, v16 a, v16 b) { /* mask lanes all-ones: a, zero: b */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

/* e^x per lane: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 1e-8
   before rounding), times 2^n. x is clamped to [-87, 88]: below, e^-87 (~1.6e-38, nothing next to a
   softmax row's maximum's 1); above, e^88 (~1.7e38, which makes 1 / (1 + e^-x) a zero as it should). */
static inline v16 exp16(v16 x) {
    x = pick(x < splat(-87.0f), splat(-87.0f), x);
    x = pick(x > splat(88.0f), splat(88.0f), x);
    v16 n = x * splat(1.44269504f) + splat(12582912.0f); /* round to nearest by the 1.5 * 2^23 trick */
    n -= splat(12582912.0f);
    v16 r = x - n * splat(0.693145752f);
    r -= n * splat(1.42860677e-6f);
    v16 p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * (v16)bits;
}

/* Half vectors: the hot loops of the kernels run on `vhalf`, the widest vector the CPU holds in a register (16
   lanes with AVX512F, else 8: gcc keeps 16-lane values in memory on AVX2 and moves them through general
   registers), NH of them to a v16, lane for lane the same operations. */
#ifdef __AVX512F__
typedef v16 vhalf;
#define NH 1
#else
typedef float vhalf __attribute__((vector_size(4 * LANES / 2)));
#define NH 2
#endif
typedef float vhalfu __attribute__((vector_size(sizeof(vhalf)), aligned(4), may_alias));
typedef uint16_t hhu __attribute__((vector_size(sizeof(vhalf) / 2), aligned(2), may_alias));
typedef uint32_t uhv __attribute__((vector_size(sizeof(vhalf))));

/* Half vector i (LANES / NH elements) of a row of float32 or bfloat16 values, as float32 (exact). */
static inline vhalf row_half(const char *row, int i, int is_bf16) {
    if (is_bf16)
        return (vhalf)(__builtin_convertvector(*(const hhu *)(row + sizeof(vhalf) / 2 * i), uhv) << 16);
    return *(const vhalfu *)(row + sizeof(vhalf) * i);
}

/* Vector c (16 elements) of a row of float32 or bfloat16 values, as float32. Exact: a bf16's
   bits are the high half of its float32. */
static inline v16 row_vec(const char *row, int c, int is_bf16) {
    if (is_bf16) {
#ifdef __AVX512F__ /* one widening load: gcc lowers the generic conversion to four instructions */
        __m256i x = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
        return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
#else
        h16 x = *(const h16u *)(row + sizeof x * c);
        return (v16)(__builtin_convertvector(x, u16v) << 16);
#endif
    }
    return *(const v16u *)(row + sizeof(v16) * c);
}

/* v rounded to bfloat16, nearest even, as torch rounds (a NaN stays a NaN, its bits may differ). */
static inline h16 to_bf16(v16 v) {
    u16v u = (u16v)v;
#ifdef __AVX512BF16__ /* one instruction, but it flushes subnormals to zero: those vectors take the long way */
    u16v mag = u & 0x7fffffffu;
    __mmask16 subnormal = _mm512_mask_cmplt_epu32_mask(_mm512_cmpneq_epi32_mask((__m512i)mag, _mm512_setzero_si512()),
                                                       (__m512i)mag, _mm512_set1_epi32(0x00800000));
    if (!subnormal) {
        __m256bh h = _mm512_cvtneps_pbh((__m512)v);
        h16 r;
        memcpy(&r, &h, sizeof r);
        return r;
    }
#endif
    u16v nan = (u16v)((u & 0x7fffffffu) > 0x7f800000u);
    u16v rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), h16);
}

/* Stores v as vector c (16 elements) of a float32 or bfloat16 row (to_bf16). */
static inline void put_vec(char *row, int c, v16 v, int is_bf16) {
    if (is_bf16) {
        *(h16u *)(row + sizeof(h16) * c) = to_bf16(v);
    } else
        *(v16u *)(row + sizeof v * c) = v;
}

/* v rounded to bfloat16 and back (is_bf16), or v: what a torch op in that dtype stores. */
static inline v16 round_to(v16 v, int is_bf16) {
    if (!is_bf16) return v;
    char row[2 * LANES];
    put_vec(row, 0, v, 1);
    return row_vec(row, 0, 1);
}

/* Subnormal floats flushed to zero (FTZ) and read as zero (DAZ) on the calling thread, until restored with the
   returned control word: a product with a subnormal (a softmax weight far below its row's largest, a recurrent
   state decayed towards zero) costs a microcode assist, tens of times an ordinary one. Results change only where a
   value below 1.2e-38 would have entered them. */
#if defined(__SSE__)
#include <xmmintrin.h>
static inline unsigned int flush_subnormals(void) {
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
}
static inline void restore_subnormals(unsigned int csr) { _mm_setcsr(csr); }
#else
static inline unsigned int flush_subnormals(void) { return 0; }
static inline void restore_subnormals(unsigned int csr) { (void)csr; }
#endif

#endif
