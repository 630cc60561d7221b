/* A decode step's kernel calls run from one list (contract in step_program.py): kvql's lean forward binds
   every call's arguments once (pointers into its preallocated rows, the packed weights, the pool); a step then
   makes one call here instead of ~15 Python calls per layer (~2.5 us each through ctypes). The kernels are
   the other libraries' functions, called through their addresses with their own signatures; the two small
   operations the step needs besides (a residual or bias add, the new K/V rows written to their pool slots)
   are here, with torch's arithmetic: a float32 add, rounded once to bf16 (nearest even) in bf16. */

#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { GEMV, RMS_NORM, ROPE, GATED_MUL, ATTENTION, ADD, WRITE_KV, QGEMM };
#define ARGS 26
#define TAIL 8 /* the attention's per-step arguments: segments, their arrays, the longest, threads */

typedef struct {
    int64_t kind, fn, a[ARGS];
} Op;
const int kvql_step_op_words = 2 + ARGS;

typedef int (*gemv_fn)(const void *, int64_t, const void *, void *, int64_t, int64_t, int64_t, int64_t, int, int);
typedef int (*qgemm_fn)(const void *, int64_t, const void *, const void *, const void *, void *, int64_t, int64_t,
                        int64_t, int64_t, int, int, int, int, int);
typedef void (*norm_fn)(const void *, int64_t, const void *, void *, int64_t, int64_t, int64_t, float, int, int, int);
typedef void (*rope_fn)(void *, int64_t, int64_t, int64_t, int64_t, const void *, const void *, int64_t, int, int);
typedef void (*gated_fn)(const void *, int64_t, void *, int64_t, int64_t, int64_t, int, int, int);
typedef int (*attention_fn)(const void *, int64_t, int64_t, const void *, const void *, int64_t, int64_t, void *,
                            int64_t, int64_t, int, int, int, int, float, int64_t, float, const float *,
                            const float *, int64_t,
                            const int64_t *, const int64_t *, const int64_t *, const int64_t *, const int64_t *,
                            int64_t, int);

static inline float as_float(int64_t bits) { /* a float argument: the float32's bits in the low half */
    uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define P(i) ((void *)(intptr_t)o->a[i])

/* dst[r][c] += src[r * src_stride + c] (src_stride 0: a bias over every row). */
static void add_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride, int64_t rows, int64_t n,
                     int is_bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            if (is_bf16) {
                uint16_t *d = (uint16_t *)dst + r * dst_stride + c;
                *d = f32_to_bf16(bf16_to_f32(*d) + bf16_to_f32(((const uint16_t *)src)[r * src_stride + c]));
            } else
                ((float *)dst)[r * dst_stride + c] += ((const float *)src)[r * src_stride + c];
        }
}

/* Row r's heads (d values each, head h at src + (r * row_stride + h * d) elements) to slot slots[r] of each head
   of the pool (element (h, s, :) at pool + h * head_stride + s * slot_stride): torch's index_copy_ on dim 1. */
static void write_kv(char *pool, int64_t head_stride, int64_t slot_stride, const char *src, int64_t row_stride,
                     const int64_t *slots, int64_t rows, int64_t heads, int64_t d, int64_t elem) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < rows; r++)
            memcpy(pool + elem * (h * head_stride + slots[r] * slot_stride), src + elem * (r * row_stride + h * d),
                   (size_t)(elem * d));
}

/* Runs ops[0 .. n - 1] in order; returns 0, or 1 + the index of the op that failed (a kernel's error). */
int64_t kvql_step_run(const Op *ops, int64_t n, const int64_t *tail) {
    for (int64_t i = 0; i < n; i++) {
        const Op *o = ops + i;
        int rc = 0;
        switch (o->kind) {
        case GEMV:
            rc = ((gemv_fn)(intptr_t)o->fn)(P(0), o->a[1], P(2), P(3), o->a[4], o->a[5], o->a[6], o->a[7],
                                            (int)o->a[8], (int)o->a[9]);
            break;
        case QGEMM:
            rc = ((qgemm_fn)(intptr_t)o->fn)(P(0), o->a[1], P(2), P(3), P(4), P(5), o->a[6], o->a[7], o->a[8],
                                             o->a[9], (int)o->a[10], (int)o->a[11], (int)o->a[12], (int)o->a[13],
                                             (int)o->a[14]);
            break;
        case RMS_NORM:
            ((norm_fn)(intptr_t)o->fn)(P(0), o->a[1], P(2), P(3), o->a[4], o->a[5], o->a[6], as_float(o->a[7]),
                                       (int)o->a[8], (int)o->a[9], (int)o->a[10]);
            break;
        case ROPE:
            ((rope_fn)(intptr_t)o->fn)(P(0), o->a[1], o->a[2], o->a[3], o->a[4], P(5), P(6), o->a[7], (int)o->a[8],
                                       (int)o->a[9]);
            break;
        case GATED_MUL:
            ((gated_fn)(intptr_t)o->fn)(P(0), o->a[1], P(2), o->a[3], o->a[4], o->a[5], (int)o->a[6], (int)o->a[7],
                                        (int)o->a[8]);
            break;
        case ATTENTION:
            rc = ((attention_fn)(intptr_t)o->fn)(
                P(0), o->a[1], o->a[2], P(3), P(4), o->a[5], o->a[6], P(7), o->a[8], o->a[9], (int)o->a[10],
                (int)o->a[11], (int)o->a[12], (int)o->a[13], as_float(o->a[14]), o->a[15], as_float(o->a[16]),
                (const float *)P(17), (const float *)P(18), tail[0], (const int64_t *)(intptr_t)tail[1], (const int64_t *)(intptr_t)tail[2],
                (const int64_t *)(intptr_t)tail[3], (const int64_t *)(intptr_t)tail[4],
                (const int64_t *)(intptr_t)tail[5], tail[6], (int)tail[7]);
            break;
        case ADD:
            add_rows(P(0), o->a[1], P(2), o->a[3], o->a[4], o->a[5], (int)o->a[6]);
            break;
        case WRITE_KV:
            write_kv(P(0), o->a[1], o->a[2], P(3), o->a[4], (const int64_t *)P(5), o->a[6], o->a[7], o->a[8], o->a[9]);
            break;
        default:
            rc = 1;
        }
        if (rc) return i + 1;
    }
    return 0;
}
