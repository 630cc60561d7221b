/* qgemm.c's AVX2 + FMA + F16C kernel (included there once, after the plain chain it equals bit for bit): the
   tiles `tile(w, b, m0, ...)` of NB blocks by R rows and, from WIDE_ROWS rows, `widen` and `tile_of` over the
   widened weights, that chunk_tiles runs. */

#ifdef QGEMM_AVX2
#define QGEMM_VECTOR 1
/* 16 registers: one row two blocks at a time; 4- and 5-bit from WIDE_ROWS rows: a chunk's weights widened to int16
   once (`widen`), read by tiles of one block by four rows (wider ones spill); else several rows 4-bit two blocks by
   two, 8- and 5-bit one by four (8-bit's widening costs less than a second read of its weights) */
#define ONE_ROW_BLOCKS 2
#define TILE_BLOCKS 2
#define TILE_ROWS 2
#define WIDENS 1
#define WIDE_ROWS 16

static inline __m256 scales8(const void *p, int64_t at, int is_f32) {
    return is_f32 ? _mm256_loadu_ps((const float *)p + at)
                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
}

/* FIFTHS[b]: the 8 bits of byte b as 8 int16 lanes of 16 or 0 (lane l: bit l), filled once at load */
static int16_t FIFTHS[256][8] __attribute__((aligned(16)));

__attribute__((constructor)) static void fill_fifths(void) {
    for (int b = 0; b < 256; b++)
        for (int l = 0; l < 8; l++) FIFTHS[b][l] = (int16_t)(((b >> l) & 1) << 4);
}

/* 16 fifth bits (bit l: int16 lane l) as 16 or 0 per lane: two table rows */
static inline __m256i fifths(uint32_t bits) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_load_si128((const __m128i *)FIFTHS[bits & 255])),
                                   _mm_load_si128((const __m128i *)FIFTHS[(bits >> 8) & 255]), 1);
}

/* Half h (outputs 8 h .. 8 h + 7) of quad j of block b widened to int16 lanes 2 o + i, as quad16 on AVX-512. */
static inline __attribute__((always_inline)) void quad8(const qweight *w, int64_t b, int64_t j, int h, __m256i *lo,
                                                        __m256i *hi) {
    const uint8_t *quad = (const uint8_t *)w->q + (b * (w->k / 4) + j) * quad_bytes(w->bits);
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(quad + 16 * h)));
    *lo = _mm256_and_si256(v, _mm256_set1_epi16(15)), *hi = _mm256_srli_epi16(v, 4);
    if (w->bits == 5) {
        uint32_t m0, m1;
        memcpy(&m0, quad + 32, 4), memcpy(&m1, quad + 36, 4);
        *lo = _mm256_add_epi16(*lo, fifths(m0 >> (16 * h)));
        *hi = _mm256_add_epi16(*hi, fifths(m1 >> (16 * h)));
    }
}

/* Blocks b .. b + nb - 1 as int16 in the 8-bit layout ([k / 2][16][2] a block, 16 k values apart): each weight
   widened once for all of a call's rows instead of once per tile. */
static void widen(const qweight *w, int64_t b, int64_t nb, int16_t *wide) {
    const int64_t k = w->k;
    for (int64_t i = 0; i < nb; i++, wide += 16 * k)
        for (int64_t j = 0; j < k / 4; j++)
            for (int h = 0; h < 2; h++) {
                __m256i lo, hi;
                if (w->bits == 8) {
                    const int8_t *q = (const int8_t *)w->q + ((b + i) * (k / 2) + 2 * j) * 32 + 16 * h;
                    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
                    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32)));
                } else
                    quad8(w, b + i, j, h, &lo, &hi);
                _mm256_storeu_si256((__m256i *)(wide + 2 * j * 32 + 16 * h), lo);
                _mm256_storeu_si256((__m256i *)(wide + (2 * j + 1) * 32 + 16 * h), hi);
            }
}

/* tile_acc of the AVX-512 kernel on 8-lane halves: acc[(r * NB + i) * 2 + h]: row r, block b + i, outputs 8 h on;
   vpmaddwd + vpaddd sum the same integers vpdpwssd does (exactly: no sum leaves int32). WIDE: the weights read
   from `wide` (`widen`), else from w. */
static inline __attribute__((always_inline)) void tile_acc(const qweight *w, int64_t b, const int16_t *wide,
                                                          const int16_t *xq, const float *sx, const float *xs,
                                                          __m256 *acc, const int NB, const int R, const int WIDE) {
    const int64_t k = w->k, G = w->group, groups = k / G;
    #pragma GCC unroll 8
    for (int i = 0; i < NB * R * 2; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i is[8];
        #pragma GCC unroll 8
        for (int i = 0; i < NB * R * 2; i++) is[i] = _mm256_setzero_si256();
        if (WIDE || w->bits == 8) {
            for (int64_t j = g * G / 2; j < (g + 1) * G / 2; j++) {
                #pragma GCC unroll 8
                for (int i = 0; i < NB; i++)
                    #pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        __m256i wv = WIDE ? _mm256_loadu_si256((const __m256i *)(wide + (i * (k / 2) + j) * 32 + 16 * h))
                                          : _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(
                                                (const int8_t *)w->q + ((b + i) * (k / 2) + j) * 32 + 16 * h)));
                        #pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            int32_t xp;
                            memcpy(&xp, xq + r * k + 2 * j, 4);
                            int n = (r * NB + i) * 2 + h;
                            is[n] = _mm256_add_epi32(is[n], _mm256_madd_epi16(wv, _mm256_set1_epi32(xp)));
                        }
                    }
            }
        } else {
            for (int64_t j = g * G / 4; j < (g + 1) * G / 4; j++) {
                #pragma GCC unroll 8
                for (int i = 0; i < NB; i++)
                    #pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        __m256i lo, hi;
                        quad8(w, b + i, j, h, &lo, &hi);
                        #pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            int32_t x0, x1;
                            memcpy(&x0, xq + r * k + 4 * j, 4), memcpy(&x1, xq + r * k + 4 * j + 2, 4);
                            int n = (r * NB + i) * 2 + h;
                            is[n] = _mm256_add_epi32(is[n], _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi32(x0)),
                                                                             _mm256_madd_epi16(hi, _mm256_set1_epi32(x1))));
                        }
                    }
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < NB; i++)
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                int64_t at = ((b + i) * groups + g) * 16 + 8 * h;
                __m256 s = scales8(w->scale, at, w->scale_f32);
                __m256 m = w->min ? scales8(w->min, at, w->scale_f32) : s;
                #pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int n = (r * NB + i) * 2 + h;
                    acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[n]),
                                             _mm256_mul_ps(s, _mm256_set1_ps(sx[r * (k / 32) + g * G / 32])), acc[n]);
                    if (w->min) acc[n] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * groups + g]), acc[n]);
                }
            }
    }
}

static inline void store8(void *out, int64_t at, __m256 v, int is_bf16) {
    if (is_bf16) {
        float f[8];
        _mm256_storeu_ps(f, v);
        for (int o = 0; o < 8; o++) ((uint16_t *)out)[at + o] = f32_to_bf16(f[o]);
    } else
        _mm256_storeu_ps((float *)out + at, v);
}

static inline __attribute__((always_inline)) void tile_of(const qweight *w, int64_t b, const int16_t *wide,
                                                          int64_t m0, const int16_t *xq, const float *sx,
                                                          const float *xs, void *out, int64_t ldo, int is_bf16,
                                                          const int NB, const int R, const int WIDE) {
    __m256 acc[8];
    const int64_t groups = w->k / w->group;
    tile_acc(w, b, wide, xq + m0 * w->k, sx + m0 * (w->k / 32), xs + m0 * groups, acc, NB, R, WIDE);
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int i = 0; i < NB; i++)
            #pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                store8(out, (m0 + r) * ldo + (b + i) * 16 + 8 * h, acc[(r * NB + i) * 2 + h], is_bf16);
}

#define tile(w, b, m0, xq, sx, xs, out, ldo, is_bf16, NB, R) tile_of(w, b, NULL, m0, xq, sx, xs, out, ldo, is_bf16, NB, R, 0)
#endif
