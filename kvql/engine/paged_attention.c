/* Paged attention on the CPU: attention of a few new tokens per request over that request's K/V slots,
   read in place from the pool (no gather). Built and loaded by paged_attention.py; contract there.

   Each (request, KV head) is one task; its result depends only on its own queries and keys, in a fixed
   order (slot list order, then head dimension), so a request rounds alike in any batch (batch-invariant).
   Arithmetic in float32 whatever the storage type; softmax with the row maximum subtracted; bf16 results
   rounded to nearest even. No fast-math: only `omp simd` reductions reorder sums, and their order is
   fixed by the build (same machine, same vector width), not by the batch. Built with -O2: at -O3 gcc 12
   rounded a query's dot products differently by its place in a query block (tests/test_paged_attention.py
   caught it). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_GROUP 16
#define MAX_DIM 256

/* Rows are copied (and widened) into a 64-byte aligned buffer before any arithmetic: vectorized loops
   over operands of varying alignment may peel a varying number of iterations and so round differently
   from call to call. Every float operand below is 64-byte aligned. */
static inline const float *row_f32(const float *p, float *buf, int d) {
    memcpy(buf, p, sizeof(float) * d);
    return buf;
}

static inline const float *row_bf16(const uint16_t *p, float *buf, int d) {
#pragma omp simd
    for (int c = 0; c < d; c++) {
        uint32_t u = (uint32_t)p[c] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        buf[c] = f;
    }
    return buf;
}

static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b);
}

#define PREFETCH_AHEAD 4

/* A block of `qb` consecutive queries of one segment (each with its `g` heads sharing KV head `k`/`v`):
   query i sees the first `n0 + i` keys at `slots`. `qf` [qb][g][d] scaled queries, `scores` [qb][g][n],
   `acc` [qb][g][d] gets the outputs. Every (query, head) is computed by the same instructions in the same
   order whatever `qb` and `n0`: blocking changes speed, never a result. */
#define ATTEND_BLOCK(T)                                                                               \
    static void attend_block_##T(const T *k, const T *v, const int64_t *slots, int64_t n0, int qb,     \
                                 int64_t slot_stride, const float *qf, int g, int d, float *scores,    \
                                 float *acc) {                                                         \
        _Alignas(64) float buf[MAX_DIM];                                                              \
        int64_t row_bytes = (int64_t)sizeof(T) * d, n = n0 + qb - 1, rows = (int64_t)qb * g;          \
        for (int64_t j = 0; j < n; j++) {                                                             \
            if (j + PREFETCH_AHEAD < n) prefetch_row(k + slots[j + PREFETCH_AHEAD] * slot_stride, row_bytes); \
            const float *kr = row_##T(k + slots[j] * slot_stride, buf, d);                            \
            for (int64_t r = (j < n0 ? 0 : (j - n0 + 1) * g); r < rows; r++) {                        \
                const float *qa = qf + r * d;                                                         \
                float s = 0.0f;                                                                       \
                _Pragma("omp simd reduction(+ : s)")                                                  \
                for (int c = 0; c < d; c++) s += qa[c] * kr[c];                                       \
                scores[r * n + j] = s;                                                                \
            }                                                                                         \
        }                                                                                             \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            int64_t nr = n0 + r / g;                                                                  \
            float *sa = scores + r * n, m = -INFINITY, sum = 0.0f;                                    \
            for (int64_t j = 0; j < nr; j++) m = sa[j] > m ? sa[j] : m;                               \
            for (int64_t j = 0; j < nr; j++) {                                                        \
                sa[j] = expf(sa[j] - m);                                                              \
                sum += sa[j];                                                                         \
            }                                                                                         \
            float inv = 1.0f / sum;                                                                   \
            for (int64_t j = 0; j < nr; j++) sa[j] *= inv;                                            \
            memset(acc + r * d, 0, sizeof(float) * d);                                                \
        }                                                                                             \
        for (int64_t j = 0; j < n; j++) {                                                             \
            if (j + PREFETCH_AHEAD < n) prefetch_row(v + slots[j + PREFETCH_AHEAD] * slot_stride, row_bytes); \
            const float *vr = row_##T(v + slots[j] * slot_stride, buf, d);                            \
            for (int64_t r = (j < n0 ? 0 : (j - n0 + 1) * g); r < rows; r++) {                        \
                float p = scores[r * n + j], *o = acc + r * d;                                        \
                _Pragma("omp simd")                                                                   \
                for (int c = 0; c < d; c++) o[c] += p * vr[c];                                        \
            }                                                                                         \
        }                                                                                             \
    }

typedef float f32;
typedef uint16_t bf16;
ATTEND_BLOCK(f32)
ATTEND_BLOCK(bf16)

static inline float load_any(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_load((const uint16_t *)p, i) : ((const float *)p)[i];
}

#define QUERY_BLOCK 8

static float *aligned_floats(size_t n) {
    size_t bytes = (sizeof(float) * n + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

/* Returns 0, or -1 when a size is out of this kernel's range or memory ran out (the output is then
   incomplete). */
int kvql_paged_attention(const void *q, int64_t q_tok_stride, int64_t q_head_stride,
                         const void *k_pool, const void *v_pool, int64_t kv_head_stride, int64_t slot_stride,
                         void *out, int64_t out_tok_stride, int64_t out_head_stride,
                         int heads, int kv_heads, int d, int is_bf16, float scale,
                         int64_t n_seg, const int64_t *q_start, const int64_t *q_len,
                         const int64_t *key_start, const int64_t *n_keys, const int64_t *slots,
                         int64_t max_keys, int threads) {
    int g = heads / kv_heads;
    if (g < 1 || g > MAX_GROUP || d < 1 || d > MAX_DIM || heads != g * kv_heads) return -1;
    int64_t blocks = 0;
    for (int64_t s = 0; s < n_seg; s++) blocks += (q_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t *block_seg = malloc(sizeof(int64_t) * 2 * (size_t)(blocks > 0 ? blocks : 1)), b = 0;
    if (!block_seg) return -1;
    for (int64_t s = 0; s < n_seg; s++)
        for (int64_t i = 0; i < q_len[s]; i += QUERY_BLOCK) {
            block_seg[2 * b] = s;
            block_seg[2 * b + 1] = i;
            b++;
        }
    int64_t tasks = blocks * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        size_t width = (size_t)QUERY_BLOCK * g;
        float *scores = aligned_floats(width * (size_t)(max_keys > 0 ? max_keys : 1));
        float *qf = aligned_floats(width * d), *acc = aligned_floats(width * d);
        if (!scores || !qf || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!scores || !qf || !acc) continue;
            int64_t s = block_seg[2 * (t / kv_heads)], i0 = block_seg[2 * (t / kv_heads) + 1];
            int h = (int)(t % kv_heads);
            int qb = (int)(q_len[s] - i0 < QUERY_BLOCK ? q_len[s] - i0 : QUERY_BLOCK);
            for (int i = 0; i < qb; i++)
                for (int a = 0; a < g; a++)
                    for (int c = 0; c < d; c++)
                        qf[((int64_t)i * g + a) * d + c] = scale * load_any(
                            q, (q_start[s] + i0 + i) * q_tok_stride + (h * g + a) * q_head_stride + c, is_bf16);
            int64_t n0 = n_keys[s] - q_len[s] + i0 + 1; /* causal: query i0 sees its past and itself */
            const int64_t *sl = slots + key_start[s];
            if (is_bf16)
                attend_block_bf16((const uint16_t *)k_pool + h * kv_head_stride,
                                  (const uint16_t *)v_pool + h * kv_head_stride, sl, n0, qb, slot_stride, qf, g,
                                  d, scores, acc);
            else
                attend_block_f32((const float *)k_pool + h * kv_head_stride,
                                 (const float *)v_pool + h * kv_head_stride, sl, n0, qb, slot_stride, qf, g, d,
                                 scores, acc);
            for (int i = 0; i < qb; i++)
                for (int a = 0; a < g; a++) {
                    int64_t o = (q_start[s] + i0 + i) * out_tok_stride + (h * g + a) * out_head_stride;
                    const float *r = acc + ((int64_t)i * g + a) * d;
                    for (int c = 0; c < d; c++) {
                        if (is_bf16) ((uint16_t *)out)[o + c] = bf16_round(r[c]);
                        else ((float *)out)[o + c] = r[c];
                    }
                }
        }
        free(scores);
        free(qf);
        free(acc);
    }
    free(block_seg);
    return failed ? -1 : 0;
}
