/* Paged attention on the CPU: the new tokens of each request attend causally over that request's K/V
   slots, read in place from the pool (no gather). Built and loaded by paged_attention.py; contract there.

   Batch invariance by construction: a (query row, key) score is the same sequence of float32 operations
   wherever the row and the key sit (which request, block, tile or lane): 16 lane partial sums over the
   head dimension (one multiply-add chain each, in order), then one fixed tree over the 16 lanes
   (`lane_sums`). A row's softmax (vectorized, masked past its last key) and its weighted sum of values
   run over its own keys in slot-list order (two interleaved chains, even and odd key index, added at the
   end), in key tiles of fixed bounds. A single new token (a decode step) reads its keys and values
   straight from the pool (`attend_one`) with that same arithmetic. Nothing depends on the batch, the
   chunking of a prompt, or the thread: a token's output depends only on its own query and keys.

   float32 arithmetic for float32 and bfloat16 storage; bf16 results rounded to nearest even. No
   fast-math. Built with -O2: a first version of this kernel (compiler-vectorized reductions) rounded a
   query differently by its place in a block at -O3 (gcc 12); tests/test_paged_attention.py catches such a
   build. And with -ffp-contract=off (each product rounded, then added): gcc 12 fused some multiply-adds
   into FMAs and not others, so on an AVX2 CPU a decode step's output differed from a prompt's at head
   dims 128 and 256 in the last bit (measured; the same test caught it). The hot loops run on half vectors
   where a 16-lane vector does not fit a register (simd.h: vhalf), lane for lane the same operations. */

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_GROUP 16
#define MAX_DIM 576 /* DeepSeek's MLA in its absorbed form: a latent of 512 and a rotary part of 64 */
const int kvql_max_group = MAX_GROUP, kvql_max_dim = MAX_DIM; /* the limits, for the Python side to read */
#define QUERY_BLOCK 16
#define KEY_TILE 64 /* a multiple of 2 * LANES */
#define PART 4 /* half vectors per pass of a weighted sum of values (attend_block) */

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

/* Softmax over a row's scores `lo .. nr - 1` in place, unnormalized (e^(s - max)), the scores before `lo`
   (outside a sliding window) set to 0; returns 1 / their sum. `sink` (-INFINITY: none) is one more logit in
   the maximum and the sum, whose weight goes to no value (an attention sink, gpt-oss's); added after the lanes'
   sum, and with none the result is the same as without the argument. 16 at a time from key 0, vectors masked
   outside the live keys: the maximum, then the exponentials and one vector of lane sums reduced by the
   fixed tree. Masked lanes add exact zeros, so where the row starts (any multiple of 16 at or below `lo`)
   changes no result. */
static inline float softmax(float *row, int64_t lo, int64_t nr, float sink) {
    v16 *sv = (v16 *)row, mv = splat(-INFINITY), sumv = (v16){0};
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t nvec = (nr + LANES - 1) / LANES;
    for (int64_t i = 0; i < nvec; i++) {
        i16 live = (lane < (i16){0} + (int)(nr - i * LANES)) & (lane >= (i16){0} + (int)(lo - i * LANES));
        mv = pick(live & (sv[i] > mv), sv[i], mv);
    }
    float m = mv[0];
    for (int l = 1; l < LANES; l++) m = mv[l] > m ? mv[l] : m;
    if (sink > m) m = sink;
    for (int64_t i = 0; i < nvec; i++) {
        i16 live = (lane < (i16){0} + (int)(nr - i * LANES)) & (lane >= (i16){0} + (int)(lo - i * LANES));
        sv[i] = pick(live, exp16(sv[i] - m), (v16){0});
        sumv += sv[i];
    }
    float sum = lane_sum(sumv);
    if (sink > -INFINITY) sum += expf(sink - m);
    return 1.0f / sum;
}

/* ALiBi (Bloom, MPT): each score of key j (its position `base + j` in the sequence) gains `slope * position`;
   softmax is the same for any shift of a row, so this is the bias `slope * (key - query)` too. */
static inline void add_alibi(float *row, int64_t lo, int64_t nr, int64_t base, float slope) {
    for (int64_t j = lo; j < nr; j++) row[j] += slope * (float)(base + j);
}

/* Attention logit soft-capping (Gemma 2): each score s becomes cap * tanh(s / cap). */
static inline void soft_cap(float *row, int64_t lo, int64_t nr, float cap) {
    for (int64_t j = lo; j < nr; j++) row[j] = cap * tanhf(row[j] / cap);
}

/* The first key a row with `nr` keys (counted from key `base`) sees under a sliding window of `win` keys
   (0: none), counted from `base` too; a negative `win` is chunked attention, chunks of -win keys (Llama 4's:
   a row sees the keys from the start of its own chunk). Either start never decreases from row to row, so a
   block's first row's start bounds every row's. */
static inline int64_t window_start(int64_t nr, int64_t base, int64_t win) {
    if (win < 0) return (nr + base - 1) / -win * -win - base;
    return win && nr + base > win ? nr - win : 0;
}

/* Per-thread scratch, 64-byte aligned: the widened K and V rows one task (segment, query block, KV head)
   sees, the block's scaled queries, its scores, and its odd-key value sums. */
typedef struct {
    float *k, *v, *q, *s, *odd;
} Scratch;

/* This thread's scratch of at least n floats, kept between calls (libgomp's threads persist while their
   pool lives), so that a layer's call does not allocate and fault in fresh pages; NULL when memory ran out.
   It grows to the largest call's need (a few MB per thread for 8K-token contexts) and is freed when the
   thread ends (a pthread key's destructor: the engine releases its idle OpenMP pool, whose workers end). */
static __thread float *scratch_mem;
static __thread size_t scratch_cap;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_key_init(void) { pthread_key_create(&scratch_key, free); }

static float *scratch(size_t n) {
    if (n > scratch_cap) {
        free(scratch_mem);
        scratch_mem = aligned_alloc(64, sizeof(float) * n);
        scratch_cap = scratch_mem ? n : 0;
        pthread_once(&scratch_once, scratch_key_init);
        pthread_setspecific(scratch_key, scratch_mem);
    }
    return scratch_mem;
}

/* Rows `rows` of a block (row r = query r / g, head r % g of KV head h) whose first query sees `n0` keys;
   keys and values already widened in `w` (kp = keys padded to 16), from key `base` (a multiple of 16) of
   the segment on; `win`: the layer's sliding window (0: none; negative: chunks, window_start), `cap` its
   soft-cap (0: none), `sinks` the g heads' attention sinks (NULL: none), `alibi` their ALiBi slopes (NULL: none:
   each score gains slope * the key's position, `base + j`, before the soft-cap). Writes outputs into `out` (also the even-key accumulator; `w->odd` the odd-key one). Keys are visited in tiles of
   KEY_TILE for all rows, so that a tile stays in cache while every row uses it; tiles start at fixed key
   indices and each row's sums still run over its keys in order, so the tiling changes no result; keys
   outside a row's window take part with weight exactly 0. */
static inline __attribute__((always_inline)) void attend_block(Scratch *w, int64_t rows, int g, int nv,
                                                              int64_t n0, int64_t kp, int64_t base,
                                                              int64_t win, float cap, const float *sinks,
                                                              const float *alibi, float *out) {
    int dv = nv * LANES; /* nv: vectors per padded row, a constant where the caller specializes it */
    int64_t n = n0 + (rows - 1) / g; /* keys of the last row */
    for (int64_t t0 = 0; t0 < n; t0 += KEY_TILE)
        for (int64_t r = (t0 < n0 ? 0 : (t0 - n0 + 1) * g); r < rows; r++) {
            int64_t nr = n0 + r / g, end = t0 + KEY_TILE < nr ? t0 + KEY_TILE : nr;
            const vhalf *q = (const vhalf *)(w->q + r * dv);
            for (int64_t j0 = t0; j0 < end; j0 += LANES) {
                v16 part[LANES];
                for (int t = 0; t < LANES; t++) {
                    const vhalf *k = (const vhalf *)(w->k + (j0 + t) * dv);
                    for (int h = 0; h < NH; h++) {
                        vhalf a = q[h] * k[h];
                        _Pragma("GCC unroll 16")
                        for (int c = 1; c < nv; c++) a += q[c * NH + h] * k[c * NH + h];
                        ((vhalf *)&part[t])[h] = a;
                    }
                }
                *(v16 *)(w->s + r * kp + j0) = lane_sums(part);
            }
        }
    float inv[QUERY_BLOCK * MAX_GROUP];
    for (int64_t r = 0; r < rows; r++) {
        int64_t nr = n0 + r / g, lo = window_start(nr, base, win);
        if (alibi) add_alibi(w->s + r * kp, lo, nr, base, alibi[r % g]);
        if (cap > 0) soft_cap(w->s + r * kp, lo, nr, cap);
        inv[r] = softmax(w->s + r * kp, lo, nr, sinks ? sinks[r % g] : -INFINITY);
        memset(out + r * dv, 0, sizeof(float) * dv);
        memset(w->odd + r * dv, 0, sizeof(float) * dv);
    }
    for (int64_t t0 = 0; t0 < n; t0 += KEY_TILE)
        for (int64_t r = (t0 < n0 ? 0 : (t0 - n0 + 1) * g); r < rows; r++) {
            int64_t nr = n0 + r / g, end = t0 + KEY_TILE < nr ? t0 + KEY_TILE : nr, j = t0;
            const float *s = w->s + r * kp;
            vhalf *eo = (vhalf *)(out + r * dv), *oo = (vhalf *)(w->odd + r * dv);
            /* in parts of PART half vectors, each a pass over the tile's keys: a part's accumulators stay in
               registers; each is its own chain whatever the parts */
            for (int i0 = 0; i0 < nv * NH; i0 += PART) {
                int np = i0 + PART <= nv * NH ? PART : nv * NH - i0;
                vhalf even[PART], odd[PART];
                for (int i = 0; i < PART; i++)
                    if (i < np) even[i] = eo[i0 + i], odd[i] = oo[i0 + i];
                for (j = t0; j + 1 < end; j += 2) { /* t0 is even: j is an even key index here */
                    const vhalf *v0 = (const vhalf *)(w->v + j * dv) + i0, *v1 = (const vhalf *)(w->v + (j + 1) * dv) + i0;
                    float p0 = s[j] * inv[r], p1 = s[j + 1] * inv[r];
                    for (int i = 0; i < PART; i++)
                        if (i < np) even[i] += p0 * v0[i], odd[i] += p1 * v1[i];
                }
                if (j < end) { /* the row's last key, even */
                    const vhalf *v0 = (const vhalf *)(w->v + j * dv) + i0;
                    float p0 = s[j] * inv[r];
                    for (int i = 0; i < PART; i++)
                        if (i < np) even[i] += p0 * v0[i];
                }
                for (int i = 0; i < PART; i++)
                    if (i < np) eo[i0 + i] = even[i], oo[i0 + i] = odd[i];
            }
        }
    for (int64_t r = 0; r < rows; r++) {
        v16 *eo = (v16 *)(out + r * dv), *oo = (v16 *)(w->odd + r * dv);
        _Pragma("GCC unroll 16")
        for (int c = 0; c < nv; c++) eo[c] = eo[c] + oo[c];
    }
}

/* attend_one's weighted sums of values for rows r0 .. r0 + R - 1 (R: 1, 2 or 4, a constant): each value row
   is loaded once for the R rows; per row the same two chains (even and odd key index) as attend_block's.
   Over the head dimension in parts of P = VALUE_TILE / R half vectors, each a pass over the keys: a part's
   2 R P accumulators stay in registers (16 of AVX-512's 32; 8 of AVX2's 16), and each is its own chain whatever
   the parts. Many query heads per KV head (MLA's absorbed form: 12-128 over one latent of 288-576) take 4 rows a
   pass: half the passes over the value rows of 2. */
#define VALUE_TILE (NH == 1 ? 8 : 4)
static inline __attribute__((always_inline)) void values_one(Scratch *w, const char *vh, const int64_t *sl,
                                                            int64_t row_bytes, int nv, int64_t n, int64_t kp,
                                                            int R, int r0, const float *inv, int is_bf16,
                                                            float *out) {
    int dv = nv * LANES;
    const int P = VALUE_TILE / R;
    for (int i0 = 0; i0 < nv * NH; i0 += P) {
        int np = i0 + P <= nv * NH ? P : nv * NH - i0;
        vhalf even[4][8], odd[4][8];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < P; i++) even[r][i] = odd[r][i] = (vhalf){0};
        int64_t j = 0;
        for (; j + 1 < n; j += 2) {
            const char *v0 = vh + row_bytes * sl[j], *v1 = vh + row_bytes * sl[j + 1];
            float p0[4], p1[4];
            for (int r = 0; r < R; r++) {
                const float *s = w->s + (r0 + r) * kp;
                p0[r] = s[j] * inv[r0 + r], p1[r] = s[j + 1] * inv[r0 + r];
            }
            for (int i = 0; i < P; i++) {
                if (i >= np) break;
                vhalf x0 = row_half(v0, i0 + i, is_bf16), x1 = row_half(v1, i0 + i, is_bf16);
                for (int r = 0; r < R; r++) {
                    even[r][i] += p0[r] * x0;
                    odd[r][i] += p1[r] * x1;
                }
            }
        }
        if (j < n) { /* the last key, even */
            const char *v0 = vh + row_bytes * sl[j];
            for (int i = 0; i < np; i++) {
                vhalf x0 = row_half(v0, i0 + i, is_bf16);
                for (int r = 0; r < R; r++) even[r][i] += (w->s[(r0 + r) * kp + j] * inv[r0 + r]) * x0;
            }
        }
        for (int r = 0; r < R; r++) {
            vhalf *o = (vhalf *)(out + (r0 + r) * dv);
            for (int i = 0; i < np; i++) o[i0 + i] = even[r][i] + odd[r][i];
        }
    }
}

/* One new token: its g rows (heads of one KV head) over the same n keys, read straight from the pool
   (`kh`/`vh`: the KV head's rows, `row_bytes` apart, slot list `sl`) rather than widened into scratch
   first: here each key serves g rows only, and the copy cost more than the arithmetic. Keys before `lo`
   are outside its sliding window (weight 0); `cap`: the soft-cap (0: none); `sinks` and `alibi` (keys counted
   from `base`) as attend_block's. The
   arithmetic and its order
   are attend_block's, so a token's output is bit for bit the same on either path (the tests split prompts
   so that both run). */
static inline __attribute__((always_inline)) void attend_one(Scratch *w, const char *kh, const char *vh,
                                                            const int64_t *sl, int64_t row_bytes, int g,
                                                            int nv, int64_t n, int64_t lo, float cap,
                                                            const float *sinks, const float *alibi, int64_t base,
                                                            int is_bf16, float *out) {
    int dv = nv * LANES;
    int64_t kp = (n + LANES - 1) / LANES * LANES;
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        v16 part[MAX_GROUP][LANES];
        for (int t = 0; t < LANES; t++) {
            vhalf k[MAX_DIM / LANES * NH];
            const char *kr = kh + row_bytes * sl[j0 + t < n ? j0 + t : n - 1]; /* past n: scores unused */
            if (j0 + t + 64 < n) { /* keys 64 ahead (slots may be scattered), and this key's value row */
                const char *next = kh + row_bytes * sl[j0 + t + 64];
                for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
            }
            if (j0 + t < n)
                for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(vh + row_bytes * sl[j0 + t] + b);
            _Pragma("GCC unroll 32")
            for (int i = 0; i < nv * NH; i++) k[i] = row_half(kr, i, is_bf16);
            for (int r = 0; r < g; r++) {
                const vhalf *q = (const vhalf *)(w->q + r * dv);
                for (int h = 0; h < NH; h++) {
                    vhalf a = q[h] * k[h];
                    _Pragma("GCC unroll 16")
                    for (int c = 1; c < nv; c++) a += q[c * NH + h] * k[c * NH + h];
                    ((vhalf *)&part[r][t])[h] = a;
                }
            }
        }
        for (int r = 0; r < g; r++) *(v16 *)(w->s + r * kp + j0) = lane_sums(part[r]);
    }
    float inv[MAX_GROUP];
    for (int r = 0; r < g; r++) {
        if (alibi) add_alibi(w->s + r * kp, lo, n, base, alibi[r]);
        if (cap > 0) soft_cap(w->s + r * kp, lo, n, cap);
        inv[r] = softmax(w->s + r * kp, lo, n, sinks ? sinks[r] : -INFINITY);
    }
    int r = 0;
    if (NH == 1)
        for (; r + 3 < g; r += 4) values_one(w, vh, sl, row_bytes, nv, n, kp, 4, r, inv, is_bf16, out);
    for (; r + 1 < g; r += 2) values_one(w, vh, sl, row_bytes, nv, n, kp, 2, r, inv, is_bf16, out);
    if (r < g) values_one(w, vh, sl, row_bytes, nv, n, kp, 1, r, inv, is_bf16, out);
}

/* Returns 0, or -1 when a size is out of this kernel's range or memory ran out (the output is then
   incomplete). */
int kvql_paged_attention(const void *q, int64_t q_tok_stride, int64_t q_head_stride,
                         const void *k_pool, const void *v_pool, int64_t kv_head_stride, int64_t slot_stride,
                         void *out, int64_t out_tok_stride, int64_t out_head_stride,
                         int heads, int kv_heads, int d, int is_bf16, float scale, int64_t window, float softcap,
                         const float *sinks, const float *alibi, int64_t n_seg, const int64_t *q_start,
                         const int64_t *q_len,
                         const int64_t *key_start, const int64_t *n_keys, const int64_t *slots,
                         int64_t max_keys, int threads) {
    int g = heads / kv_heads;
    if (g < 1 || g > MAX_GROUP || d < 1 || d > MAX_DIM || heads != g * kv_heads) return -1;
    int dv = (d + LANES - 1) / LANES * LANES, nv = dv / LANES;
    int64_t kp_max = (max_keys + LANES - 1) / LANES * LANES;
    int elem = is_bf16 ? 2 : 4;
    /* tasks: (segment, query block, KV head); a segment's later blocks (more keys) first */
    int64_t blocks = 0, b = 0;
    for (int64_t s = 0; s < n_seg; s++) blocks += (q_len[s] + QUERY_BLOCK - 1) / QUERY_BLOCK;
    int64_t *block = malloc(sizeof(int64_t) * 2 * (size_t)(blocks ? blocks : 1));
    if (!block) return -1;
    for (int64_t s = 0; s < n_seg; s++)
        for (int64_t i0 = (q_len[s] - 1) / QUERY_BLOCK * QUERY_BLOCK; q_len[s] > 0 && i0 >= 0; i0 -= QUERY_BLOCK, b++)
            block[2 * b] = s, block[2 * b + 1] = i0;
    int64_t tasks = blocks * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* subnormals flushed (simd.h): a row's softmax weights far below its largest (ALiBi's distant keys, e^-80
           and less) made each product with them a microcode assist (a Bloom prefill over 1,758 keys ran 3.3x
           slower with its slopes than without); restored for the thread's other work */
        unsigned int csr = flush_subnormals();
        /* parts of multiples of 16 floats: each 64-byte aligned */
        size_t width = (size_t)QUERY_BLOCK * g, kv = (size_t)(kp_max * dv), rowsz = width * dv;
        float *mem = scratch(2 * kv + 3 * rowsz + width * (size_t)kp_max);
        Scratch w = {mem, mem + kv, mem + 2 * kv, mem + 2 * kv + rowsz, mem + 2 * kv + rowsz + width * kp_max};
        float *outs = w.odd + rowsz;
        int ok = mem != NULL;
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!ok) continue;
            int64_t s = block[2 * (t / kv_heads)], i0 = block[2 * (t / kv_heads) + 1];
            int h = (int)(t % kv_heads);
            const float *sk = sinks ? sinks + (int64_t)h * g : NULL; /* this KV head's query heads' sinks */
            const float *ak = alibi ? alibi + (int64_t)h * g : NULL; /* and ALiBi slopes */
            int64_t qb = q_len[s] - i0 < QUERY_BLOCK ? q_len[s] - i0 : QUERY_BLOCK, rows = qb * g;
            int64_t n0 = n_keys[s] - q_len[s] + i0 + 1, n = n0 + qb - 1;
            /* a sliding window or chunk: the block's keys from its first row's start, down to a multiple of
               16 (lanes and even/odd chains keep their place), counted from there on */
            int64_t base = window_start(n0, 0, window) / LANES * LANES;
            n0 -= base, n -= base;
            int64_t kp = (n + LANES - 1) / LANES * LANES;
            const char *kh = (const char *)k_pool + (int64_t)elem * h * kv_head_stride;
            const char *vh = (const char *)v_pool + (int64_t)elem * h * kv_head_stride;
            const int64_t *sl = slots + key_start[s] + base;
            for (int64_t r = 0; r < rows; r++) {
                int64_t base = (q_start[s] + i0 + r / g) * q_tok_stride + (h * g + r % g) * q_head_stride;
                for (int c = 0; c < dv; c++) w.q[r * dv + c] = c < d ? scale * load(q, base + c, is_bf16) : 0.0f;
            }
            if (qb == 1 && dv == d) { /* a decode step: keys read in place */
                int64_t rb = elem * slot_stride, lo = window_start(n, base, window);
                if (nv == 4 && is_bf16) attend_one(&w, kh, vh, sl, rb, g, 4, n, lo, softcap, sk, ak, base, 1, outs);
                else if (nv == 4) attend_one(&w, kh, vh, sl, rb, g, 4, n, lo, softcap, sk, ak, base, 0, outs);
                else if (is_bf16) attend_one(&w, kh, vh, sl, rb, g, nv, n, lo, softcap, sk, ak, base, 1, outs);
                else attend_one(&w, kh, vh, sl, rb, g, nv, n, lo, softcap, sk, ak, base, 0, outs);
            } else {
                for (int64_t j = 0; j < n; j++) { /* the keys this block sees, widened */
                    widen(kh + elem * sl[j] * slot_stride, w.k + j * dv, d, dv, is_bf16);
                    widen(vh + elem * sl[j] * slot_stride, w.v + j * dv, d, dv, is_bf16);
                }
                memset(w.k + n * dv, 0, sizeof(float) * (size_t)((kp - n) * dv)); /* tile padding: scores unused */
                if (nv == 4) attend_block(&w, rows, g, 4, n0, kp, base, window, softcap, sk, ak, outs); /* head_dim 64 */
                else if (nv == 8) attend_block(&w, rows, g, 8, n0, kp, base, window, softcap, sk, ak, outs); /* 128 */
                else attend_block(&w, rows, g, nv, n0, kp, base, window, softcap, sk, ak, outs);
            }
            for (int64_t r = 0; r < rows; r++) {
                int64_t o = (q_start[s] + i0 + r / g) * out_tok_stride + (h * g + r % g) * out_head_stride;
                for (int c = 0; c < d; c++) {
                    if (is_bf16) ((uint16_t *)out)[o + c] = f32_to_bf16(outs[r * dv + c]);
                    else ((float *)out)[o + c] = outs[r * dv + c];
                }
            }
        }
        restore_subnormals(csr);
    }
    free(block);
    return failed ? -1 : 0;
}
