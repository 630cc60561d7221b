/* qgemm.c's AVX512-VNNI kernel (included there once, after the plain chain it equals bit for bit): the tiles
   `tile(w, b, m0, ...)` of NB blocks by R rows that chunk_tiles runs. */

#ifdef QGEMM_AVX512
#define QGEMM_VECTOR 1
/* One row: blocks at a time; several rows: blocks by rows (AVX-512 has 32 registers) */
#define ONE_ROW_BLOCKS 4
#define TILE_BLOCKS 2
#define TILE_ROWS 4

static inline __m512 scales16(const void *p, int64_t at, int is_f32) {
    return is_f32 ? _mm512_loadu_ps((const float *)p + at)
                  : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at)));
}

/* Quad j of block b widened to int16 lanes 2 o + i: lo = inputs 4 j + i, hi = 4 j + 2 + i (fifth bits added). */
static inline __attribute__((always_inline)) void quad16(const qweight *w, int64_t b, int64_t j, __m512i *lo,
                                                         __m512i *hi) {
    const uint8_t *quad = (const uint8_t *)w->q + (b * (w->k / 4) + j) * quad_bytes(w->bits);
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)quad));
    *lo = _mm512_and_si512(v, _mm512_set1_epi16(15)), *hi = _mm512_srli_epi16(v, 4);
    if (w->bits == 5) {
        uint32_t m0, m1;
        memcpy(&m0, quad + 32, 4), memcpy(&m1, quad + 36, 4);
        *lo = _mm512_mask_add_epi16(*lo, m0, *lo, _mm512_set1_epi16(16));
        *hi = _mm512_mask_add_epi16(*hi, m1, *hi, _mm512_set1_epi16(16));
    }
}

/* Blocks b .. b + NB - 1 (16 outputs each) for R quantized rows (xq rows k apart, sx rows k / 32 apart, xs rows
   k / G apart): the same chain as block_ref, NB R integer sums in flight. acc[r * NB + i]: row r, block b + i. */
static inline __attribute__((always_inline)) void tile_acc(const qweight *w, int64_t b, const int16_t *xq,
                                                          const float *sx, const float *xs, __m512 *acc,
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
                for (int i = 0; i < NB; i++) quad16(w, b + i, j, &lo[i], &hi[i]);
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
            __m512 m = w->min ? scales16(w->min, at, w->scale_f32) : s;
            #pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                int n = r * NB + i;
                acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[n]),
                                         _mm512_mul_ps(s, _mm512_set1_ps(sx[r * (k / 32) + g * G / 32])), acc[n]);
                if (w->min) acc[n] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), acc[n]);
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
                                                       const float *sx, const float *xs, void *out, int64_t ldo,
                                                       int is_bf16, const int NB, const int R) {
    __m512 acc[8];
    const int64_t groups = w->k / w->group;
    tile_acc(w, b, xq + m0 * w->k, sx + m0 * (w->k / 32), xs + m0 * groups, acc, NB, R);
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int i = 0; i < NB; i++) store16(out, (m0 + r) * ldo + (b + i) * 16, acc[r * NB + i], is_bf16);
}
#endif
