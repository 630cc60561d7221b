/* One-token steps of recurrent layers for a batch of requests, each on its own state, updated in place.
   Built and loaded by recurrent_step.py; contracts there.

   Each (row, channel) of the short convolution and each (row, head) of the gated delta rule is computed alone, in a
   fixed order: a row's result does not depend on the other rows of the call (batch-invariant), and its state is
   read and written once per step where torch's ops pass over it several times (the delta rule's state, 64 x 64
   floats a head, stays in L1 between its two sweeps). No fast-math; -ffp-contract=off: each product rounded. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* Depthwise causal convolution, one new token per row: row r's state (`states[r]`: [channels, taps], the model's
   dtype) shifts left by one and takes x[r] as its last tap; out[r][c] = act(sum_t w[c][t] * state[c][t] + bias[c])
   in float32 from the dtype's values, rounded to the dtype before the activation (as torch's conv1d in that dtype,
   then SiLU: x / (1 + e^-x), e^ by exp16 16 channels at a time); `silu` 0: no activation. */
void kvql_short_conv_step(int64_t rows, int64_t channels, int64_t taps, const void *x, int64_t x_stride,
                          void *const *states, const void *w, const void *bias, void *out, int64_t out_stride,
                          int silu, int is_bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        char *st = (char *)states[r];
        float sums[channels];
        for (int64_t c = 0; c < channels; c++) {
            int64_t at = c * taps;
            float acc = 0.0f;
            if (is_bf16) {
                uint16_t *sc = (uint16_t *)st + at;
                for (int64_t t = 0; t + 1 < taps; t++) sc[t] = sc[t + 1];
                sc[taps - 1] = ((const uint16_t *)x)[r * x_stride + c];
                for (int64_t t = 0; t < taps; t++) acc += bf16_to_f32(((const uint16_t *)w)[at + t]) * bf16_to_f32(sc[t]);
            } else {
                float *sc = (float *)st + at;
                for (int64_t t = 0; t + 1 < taps; t++) sc[t] = sc[t + 1];
                sc[taps - 1] = ((const float *)x)[r * x_stride + c];
                for (int64_t t = 0; t < taps; t++) acc += ((const float *)w)[at + t] * sc[t];
            }
            if (bias) acc += load(bias, c, is_bf16);
            sums[c] = is_bf16 ? bf16_to_f32(f32_to_bf16(acc)) : acc;
        }
        char *o = (char *)out + (is_bf16 ? 2 : 4) * r * out_stride;
        int64_t c = 0;
        for (; c + LANES <= channels; c += LANES) { /* the activation 16 channels at a time (exp16) */
            v16 v = *(v16u *)(sums + c);
            if (silu) v = v / (splat(1.0f) + exp16(-v));
            put_vec(o + (is_bf16 ? 2 : 4) * c, 0, v, is_bf16);
        }
        for (; c < channels; c++) {
            float v = sums[c];
            store(o, c, silu ? v / (1.0f + expf(-v)) : v, is_bf16);
        }
    }
}

/* The gated delta rule, one token per row, float32: for row r and value head h (key head h / (v_heads / k_heads)),
   with S = states[r][h] ([dk, dv]), q and k that head's (already normalized and scaled), v, g and beta its:
       S = S * exp(g);  delta = (v - k^T S) * beta;  S = S + k delta^T;  out = q^T S.
   Row sweeps over S in order of the key index, each value column its own chain. */
void kvql_gated_delta_step(int64_t rows, int64_t v_heads, int64_t k_heads, int64_t dk, int64_t dv, const float *q,
                           const float *k, const float *v, const float *g, const float *beta, float *const *states,
                           float *out, int threads) {
    int64_t group = v_heads / k_heads;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < v_heads; h++) {
            float *s = states[r] + h * dk * dv;
            const float *qh = q + (r * k_heads + h / group) * dk, *kh = k + (r * k_heads + h / group) * dk;
            const float *vh = v + (r * v_heads + h) * dv;
            float *o = out + (r * v_heads + h) * dv;
            float decay = expf(g[r * v_heads + h]), b = beta[r * v_heads + h];
            float mem[dv], delta[dv];
            for (int64_t j = 0; j < dv; j++) mem[j] = 0.0f, o[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float ki = kh[i], *si = s + i * dv;
#pragma omp simd
                for (int64_t j = 0; j < dv; j++) {
                    si[j] = si[j] * decay;
                    mem[j] += si[j] * ki;
                }
            }
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) delta[j] = (vh[j] - mem[j]) * b;
            for (int64_t i = 0; i < dk; i++) {
                float ki = kh[i], qi = qh[i], *si = s + i * dv;
#pragma omp simd
                for (int64_t j = 0; j < dv; j++) {
                    si[j] = si[j] + ki * delta[j];
                    o[j] += si[j] * qi;
                }
            }
        }
}
