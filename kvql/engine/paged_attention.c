/* Paged attention on the CPU: the new tokens of each request attend causally over that request's K/V
   slots, read in place from the pool (no gather). Built and loaded by paged_attention.py; contract there.

   Batch invariance by construction: a (query row, key) score is the same sequence of float32 operations
   wherever the row and the key sit (which request, block, tile or lane): 16 lane partial sums over the
   head dimension (one multiply-add chain each, in order), then one fixed tree over the 16 lanes
   (`lane_sums`). A row's softmax and its weighted sum of values run over its own keys in slot-list order
   (two interleaved chains, even and odd key index, added at the end). Nothing depends on the batch, the
   chunking of a prompt, or the thread: a token's output depends only on its own query and keys.

   float32 arithmetic for float32 and bfloat16 storage; bf16 results rounded to nearest even. No
   fast-math. Built with -O2 (at -O3 gcc 12 re-associated some of these sums by position: the tests in
   tests/test_paged_attention.py catch that). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define LANES 16
#define QUERY_BLOCK 16

typedef float v16 __attribute__((vector_size(4 * LANES), aligned(64)));
typedef int32_t i16 __attribute__((vector_size(4 * LANES)));

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

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Row `src` (d elements) widened into `dst` (dp floats, zero padded). */
static inline void widen(const void *src, float *dst, int d, int dp, int is_bf16) {
    if (is_bf16) {
        const uint16_t *x = src;
        uint32_t *u = (uint32_t *)dst; /* the bits of a bf16 are the high half of its float32 */
#pragma omp simd
        for (int c = 0; c < d; c++) u[c] = (uint32_t)x[c] << 16;
    } else
        memcpy(dst, src, sizeof(float) * d);
    for (int c = d; c < dp; c++) dst[c] = 0.0f;
}

/* r[m] = the sum of the 16 lanes of a[m], for each m by the same tree: lanes (l, l+8), then (l, l+4),
   (l, l+2), (l, l+1). */
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

/* Per-thread scratch, 64-byte aligned: widened K and V rows of one (segment, KV head), the block's
   scaled queries, and its scores. */
typedef struct {
    float *k, *v, *q, *s;
} Scratch;

static float *aligned_floats(size_t n) {
    return aligned_alloc(64, (sizeof(float) * (n ? n : 1) + 63) / 64 * 64);
}

/* Rows `rows` of a block (row r = query r / g, head r % g of KV head h) whose first query sees `n0` keys;
   keys and values already widened in `w` (kp = keys padded to 16). Writes outputs into `out`. */
static void attend_block(Scratch *w, int64_t rows, int g, int dv, int64_t n0, int64_t kp, float *out_rows) {
    int nv = dv / LANES; /* vectors per padded row */
    for (int64_t r = 0; r < rows; r++) {
        int64_t nr = n0 + r / g; /* causal: this row sees keys 0 .. nr-1 */
        const v16 *q = (const v16 *)(w->q + r * dv);
        float *s = w->s + r * kp;
        for (int64_t j0 = 0; j0 < nr; j0 += LANES) {
            v16 part[LANES];
            for (int t = 0; t < LANES; t++) {
                const v16 *k = (const v16 *)(w->k + (j0 + t) * dv);
                v16 a = q[0] * k[0];
                for (int c = 1; c < nv; c++) a += q[c] * k[c];
                part[t] = a;
            }
            *(v16 *)(s + j0) = lane_sums(part);
        }
        float m = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < nr; j++) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < nr; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        float inv = 1.0f / sum;
        v16 even[MAX_DIM / LANES], odd[MAX_DIM / LANES];
        for (int c = 0; c < nv; c++) even[c] = odd[c] = (v16){0};
        int64_t j = 0;
        for (; j + 1 < nr; j += 2) {
            const v16 *v0 = (const v16 *)(w->v + j * dv), *v1 = (const v16 *)(w->v + (j + 1) * dv);
            float p0 = s[j] * inv, p1 = s[j + 1] * inv;
            for (int c = 0; c < nv; c++) {
                even[c] += p0 * v0[c];
                odd[c] += p1 * v1[c];
            }
        }
        if (j < nr) {
            const v16 *v0 = (const v16 *)(w->v + j * dv);
            float p0 = s[j] * inv;
            for (int c = 0; c < nv; c++) even[c] += p0 * v0[c];
        }
        v16 *o = (v16 *)(out_rows + r * dv);
        for (int c = 0; c < nv; c++) o[c] = even[c] + odd[c];
    }
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
    int dv = (d + LANES - 1) / LANES * LANES;
    int64_t kp_max = (max_keys + LANES - 1) / LANES * LANES;
    int64_t tasks = n_seg * kv_heads;
    int elem = is_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t width = (int64_t)QUERY_BLOCK * g;
        Scratch w = {aligned_floats((size_t)(kp_max * dv)), aligned_floats((size_t)(kp_max * dv)),
                     aligned_floats((size_t)(width * dv)), aligned_floats((size_t)(width * kp_max))};
        float *outs = aligned_floats((size_t)(width * dv));
        int ok = w.k && w.v && w.q && w.s && outs;
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!ok) continue;
            int64_t s = t / kv_heads, n = n_keys[s], kp = (n + LANES - 1) / LANES * LANES;
            int h = (int)(t % kv_heads);
            const char *kh = (const char *)k_pool + (int64_t)elem * h * kv_head_stride;
            const char *vh = (const char *)v_pool + (int64_t)elem * h * kv_head_stride;
            const int64_t *sl = slots + key_start[s];
            for (int64_t j = 0; j < n; j++) {
                widen(kh + elem * sl[j] * slot_stride, w.k + j * dv, d, dv, is_bf16);
                widen(vh + elem * sl[j] * slot_stride, w.v + j * dv, d, dv, is_bf16);
            }
            memset(w.k + n * dv, 0, sizeof(float) * (size_t)((kp - n) * dv)); /* tile padding: scores unused */
            for (int64_t i0 = 0; i0 < q_len[s]; i0 += QUERY_BLOCK) {
                int64_t qb = q_len[s] - i0 < QUERY_BLOCK ? q_len[s] - i0 : QUERY_BLOCK, rows = qb * g;
                for (int64_t r = 0; r < rows; r++) {
                    int64_t base = (q_start[s] + i0 + r / g) * q_tok_stride + (h * g + r % g) * q_head_stride;
                    for (int c = 0; c < dv; c++) w.q[r * dv + c] = c < d ? scale * load(q, base + c, is_bf16) : 0.0f;
                }
                attend_block(&w, rows, g, dv, n - q_len[s] + i0 + 1, kp, outs);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t o = (q_start[s] + i0 + r / g) * out_tok_stride + (h * g + r % g) * out_head_stride;
                    for (int c = 0; c < d; c++) {
                        if (is_bf16) ((uint16_t *)out)[o + c] = f32_to_bf16(outs[r * dv + c]);
                        else ((float *)out)[o + c] = outs[r * dv + c];
                    }
                }
            }
        }
        free(w.k), free(w.v), free(w.q), free(w.s), free(outs);
    }
    return failed ? -1 : 0;
}
