/* Row-wise layer operations of Llama-family models on the CPU, each one pass instead of several torch ops
   (contract in fused_ops.py). Every row is computed alone, by a fixed sequence of float32 operations:
   nothing depends on the other rows of the call (batch-invariant), nor on the thread. bfloat16 inputs
   and outputs are rounded as the torch ops they replace round them: RoPE is bit for bit transformers'
   (built with -ffp-contract=off: each product and sum rounded alone, as torch's separate ops do);
   RMSNorm and the activations agree with torch to float32 rounding (own reduction order, own exp). */

#include <stdint.h>

#include "simd.h"

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), n a multiple of 16. The mean: 16 lane sums of squares
   in order, then the fixed lane tree. bf16: the normalized row is rounded to bf16 before the weight (as
   transformers' `weight * hidden.to(input_dtype)`, Llama's). With `plus_one` (Gemma's), the factor is
   1 + w in float32 and only the product is rounded (`(x_norm * (1.0 + w.float())).type_as(x)`). */
void kvql_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t out_stride, int64_t rows,
                   int64_t n, float eps, int plus_one, int is_bf16, int threads) {
    int elem = is_bf16 ? 2 : 4, nv = (int)(n / LANES);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 1 << 14)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + elem * r * x_stride;
        char *o = (char *)out + elem * r * out_stride;
        v16 acc = (v16){0};
        for (int c = 0; c < nv; c++) {
            v16 v = row_vec(xr, c, is_bf16);
            acc += v * v;
        }
        float inv = 1.0f / sqrtf(lane_sum(acc) / (float)n + eps);
        for (int c = 0; c < nv; c++) {
            v16 y = row_vec(xr, c, is_bf16) * inv, wc = row_vec((const char *)w, c, is_bf16);
            put_vec(o, c, plus_one ? (splat(1.0f) + wc) * y : wc * round_to(y, is_bf16), is_bf16);
        }
    }
}

/* In place, the first `heads` heads (head_dim d, even) of each row: x * cos + rotate_half(x) * sin, with
   rotate_half(x) = (-x2, x1) for the halves x1, x2, and cos, sin rows of d values per row. Each product
   and the sum rounded to the dtype in turn, as transformers' apply_rotary_pos_emb in that dtype. */
void kvql_rope(void *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d, const void *cos,
               const void *sin, int64_t cs_stride, int is_bf16, int threads) {
    int elem = is_bf16 ? 2 : 4;
    int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= 1 << 14)
    for (int64_t r = 0; r < rows; r++) {
        const char *cr = (const char *)cos + elem * r * cs_stride, *sr = (const char *)sin + elem * r * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            char *xh = (char *)x + elem * (r * x_stride + h * d);
            if (half % LANES == 0) {
                for (int c = 0; c < half / LANES; c++) {
                    int c2 = c + (int)(half / LANES);
                    v16 x1 = row_vec(xh, c, is_bf16), x2 = row_vec(xh, c2, is_bf16);
                    v16 a1 = round_to(x1 * row_vec(cr, c, is_bf16), is_bf16);
                    v16 b1 = round_to(-x2 * row_vec(sr, c, is_bf16), is_bf16);
                    v16 a2 = round_to(x2 * row_vec(cr, c2, is_bf16), is_bf16);
                    v16 b2 = round_to(x1 * row_vec(sr, c2, is_bf16), is_bf16);
                    put_vec(xh, c, a1 + b1, is_bf16);
                    put_vec(xh, c2, a2 + b2, is_bf16);
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    float x1, x2, c1, c2, s1, s2;
                    if (is_bf16) {
                        const uint16_t *p = (const uint16_t *)xh, *cp = (const uint16_t *)cr, *sp = (const uint16_t *)sr;
                        x1 = bf16_to_f32(p[i]), x2 = bf16_to_f32(p[i + half]);
                        c1 = bf16_to_f32(cp[i]), c2 = bf16_to_f32(cp[i + half]);
                        s1 = bf16_to_f32(sp[i]), s2 = bf16_to_f32(sp[i + half]);
                        float a1 = bf16_to_f32(f32_to_bf16(x1 * c1)), b1 = bf16_to_f32(f32_to_bf16(-x2 * s1));
                        float a2 = bf16_to_f32(f32_to_bf16(x2 * c2)), b2 = bf16_to_f32(f32_to_bf16(x1 * s2));
                        ((uint16_t *)xh)[i] = f32_to_bf16(a1 + b1), ((uint16_t *)xh)[i + half] = f32_to_bf16(a2 + b2);
                    } else {
                        float *p = (float *)xh;
                        const float *cp = (const float *)cr, *sp = (const float *)sr;
                        x1 = p[i], x2 = p[i + half], c1 = cp[i], c2 = cp[i + half], s1 = sp[i], s2 = sp[i + half];
                        p[i] = x1 * c1 + -x2 * s1, p[i + half] = x2 * c2 + x1 * s2;
                    }
                }
            }
        }
    }
}

/* out[r, i] = act(g) * u for g = gu[r, i], u = gu[r, n + i] (the gate and up projections side by side),
   n a multiple of 16. act 0: silu(g) = g / (1 + e^-g); act 1: GELU's tanh form, 0.5 g (1 + tanh(y)) with
   y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^-2y) (the same function, without the
   cancellation of 1 + tanh(y) for negative g). exp16 on both. The activation is
   rounded to the dtype before the product (as transformers' `act_fn(gate) * up` in that dtype). */
void kvql_gated_mul(const void *gu, int64_t gu_stride, void *out, int64_t out_stride, int64_t rows, int64_t n,
                    int act_kind, int is_bf16, int threads) {
    int elem = is_bf16 ? 2 : 4, nv = (int)(n / LANES);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 1 << 14)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gu + elem * r * gu_stride, *u = g + elem * n;
        char *o = (char *)out + elem * r * out_stride;
        for (int c = 0; c < nv; c++) {
            v16 x = row_vec(g, c, is_bf16);
            v16 z = act_kind == 0 ? x : splat(1.5957691216f) * (x + splat(0.044715f) * x * x * x); /* 2y */
            v16 act = round_to(x / (splat(1.0f) + exp16(-z)), is_bf16);
            put_vec(o, c, act * row_vec(u, c, is_bf16), is_bf16);
        }
    }
}
