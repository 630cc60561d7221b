/* Recurrent layers over a ragged batch: each segment's tokens in order, from its own state, updated in place.
   Built and loaded by recurrent_step.py; contracts there.

   Each (segment, channel) of the short convolution and each (segment, head) of the gated delta rule is computed
   alone, token after token, in a fixed order: a segment's result depends neither on the other segments of the call
   (batch-invariant) nor on how its tokens were split into calls (the recurrent form: no chunks). Its state stays
   in cache while its tokens run (the delta rule's, 64 x 64 floats a head, in L1), where torch's ops pass over a
   stacked copy of every state several times per token. No fast-math; -ffp-contract=off: each product rounded. */

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

/* Depthwise causal convolution: for segment s (its tokens rows row0[s] .. row0[s] + n_tok[s] - 1 of x and out)
   and channel c, per token the state (`states[s]`: [channels, taps], the model's dtype) shifts left by one and
   takes the token's x as its last tap, and out = sum_t w[c][t] * state[c][t] + bias[c] in float32 from the dtype's
   values, rounded to the dtype (as torch's conv1d in that dtype); then, `silu`, x / (1 + e^-x) over every output
   row (exp16, 16 channels at a time), rounded again. */
void kvql_short_conv(int64_t n_seg, const int64_t *row0, const int64_t *n_tok, int64_t channels, int64_t taps,
                     const void *x, int64_t x_stride, void *const *states, const void *w, const void *bias, void *out,
                     int64_t out_stride, int silu, int is_bf16, int threads) {
    int64_t e = is_bf16 ? 2 : 4, blocks = (channels + 63) / 64;
#pragma omp parallel num_threads(threads)
    {
        unsigned int csr = flush_subnormals(); /* (simd.h) */
#pragma omp for schedule(static) collapse(2)
        for (int64_t s = 0; s < n_seg; s++)
            for (int64_t blk = 0; blk < blocks; blk++) {
                char *st = (char *)states[s];
                int64_t c1 = (blk + 1) * 64 < channels ? (blk + 1) * 64 : channels;
                for (int64_t i = 0; i < n_tok[s]; i++) {
                    int64_t row = row0[s] + i;
                    for (int64_t c = blk * 64; c < c1; c++) {
                        int64_t at = c * taps;
                        float acc = 0.0f;
                        if (is_bf16) {
                            uint16_t *sc = (uint16_t *)st + at;
                            for (int64_t t = 0; t + 1 < taps; t++) sc[t] = sc[t + 1];
                            sc[taps - 1] = ((const uint16_t *)x)[row * x_stride + c];
                            for (int64_t t = 0; t < taps; t++)
                                acc += bf16_to_f32(((const uint16_t *)w)[at + t]) * bf16_to_f32(sc[t]);
                        } else {
                            float *sc = (float *)st + at;
                            for (int64_t t = 0; t + 1 < taps; t++) sc[t] = sc[t + 1];
                            sc[taps - 1] = ((const float *)x)[row * x_stride + c];
                            for (int64_t t = 0; t < taps; t++) acc += ((const float *)w)[at + t] * sc[t];
                        }
                        if (bias) acc += load(bias, c, is_bf16);
                        store(out, row * out_stride + c, acc, is_bf16);
                    }
                }
            }
        if (silu) {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < n_seg; s++)
                for (int64_t i = 0; i < n_tok[s]; i++) {
                    char *o = (char *)out + e * (row0[s] + i) * out_stride;
                    int64_t c = 0;
                    for (; c + LANES <= channels; c += LANES) {
                        v16 v = row_vec(o, (int)(c / LANES), is_bf16);
                        put_vec(o, (int)(c / LANES), v / (splat(1.0f) + exp16(-v)), is_bf16);
                    }
                    for (; c < channels; c++) {
                        float v = load(o, c, is_bf16);
                        store(o, c, v / (1.0f + expf(-v)), is_bf16);
                    }
                }
        }
        restore_subnormals(csr);
    }
}

/* The gated delta rule, float32: for segment s and value head h (key head h / (v_heads / k_heads)), S =
   states[s][h] ([dk, dv]), per token (rows row0[s] ...) with its q and k (already normalized and scaled), v, g and
   beta:
       S = S * exp(g);  delta = (v - k^T S) * beta;  S = S + k delta^T;  out = q^T S.
   Row sweeps over S in order of the key index, each value column its own chain. */
void kvql_gated_delta(int64_t n_seg, const int64_t *row0, const int64_t *n_tok, int64_t v_heads, int64_t k_heads,
                      int64_t dk, int64_t dv, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, float *const *states, float *out, int threads) {
    int64_t group = v_heads / k_heads;
#pragma omp parallel num_threads(threads)
    {
        unsigned int csr = flush_subnormals(); /* a state decayed towards zero (simd.h) */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t seg = 0; seg < n_seg; seg++)
            for (int64_t h = 0; h < v_heads; h++) {
                float *s = states[seg] + h * dk * dv;
                float mem[dv], delta[dv];
                for (int64_t i0 = 0; i0 < n_tok[seg]; i0++) {
                    int64_t r = row0[seg] + i0;
                    const float *qh = q + (r * k_heads + h / group) * dk, *kh = k + (r * k_heads + h / group) * dk;
                    const float *vh = v + (r * v_heads + h) * dv;
                    float *o = out + (r * v_heads + h) * dv;
                    float decay = expf(g[r * v_heads + h]), b = beta[r * v_heads + h];
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
        restore_subnormals(csr);
    }
}

/* Mamba2's selective state space step (SSD, recurrent form), float32: for segment s and head h (group h / (heads /
   groups)), S = states[s][h] ([head_dim, state]), per token (rows row0[s] ...) with its x (the head's head_dim
   values), B and C (its group's), dt (after its bias and softplus):
       S = S * exp(dt A[h]) + (dt B) x^T;  y = S C + D[h] x.
   Each (head dim, state) entry its own chain in token order; y's sum over the state in 16 lane partial sums, then
   one fixed tree for 16 rows at a time (lane_sums). */
void kvql_ssd(int64_t n_seg, const int64_t *row0, const int64_t *n_tok, int64_t heads, int64_t head_dim,
              int64_t groups, int64_t state, const float *x, const float *B, const float *C, const float *dt,
              const float *A, const float *D, float *const *states, float *out, int threads) {
    int64_t per_group = heads / groups;
#pragma omp parallel num_threads(threads)
    {
        unsigned int csr = flush_subnormals(); /* a state decayed towards zero (simd.h) */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t seg = 0; seg < n_seg; seg++)
            for (int64_t h = 0; h < heads; h++) {
                float *s = states[seg] + h * head_dim * state;
                float db[state];
                for (int64_t i0 = 0; i0 < n_tok[seg]; i0++) {
                    int64_t r = row0[seg] + i0, g = h / per_group;
                    float d = dt[r * heads + h], da = expf(d * A[h]);
                    const float *b = B + (r * groups + g) * state, *c = C + (r * groups + g) * state;
                    const float *xh = x + (r * heads + h) * head_dim;
                    float *o = out + (r * heads + h) * head_dim;
                    for (int64_t n = 0; n < state; n++) db[n] = d * b[n];
                    for (int64_t p0 = 0; p0 < head_dim; p0 += LANES) { /* 16 rows of S, their y by one tree */
                        int64_t pn = head_dim - p0 < LANES ? head_dim - p0 : LANES;
                        v16 acc[LANES];
                        for (int64_t q = 0; q < LANES; q++) acc[q] = (v16){0};
                        for (int64_t q = 0; q < pn; q++) {
                            float xp = xh[p0 + q], *sp = s + (p0 + q) * state, tail = 0.0f;
                            v16 a = (v16){0};
                            int64_t n = 0;
                            for (; n + LANES <= state; n += LANES) {
                                v16 sv = *(v16u *)(sp + n) * splat(da) + *(const v16u *)(db + n) * splat(xp);
                                *(v16u *)(sp + n) = sv;
                                a += sv * *(const v16u *)(c + n);
                            }
                            for (; n < state; n++) {
                                sp[n] = sp[n] * da + db[n] * xp;
                                tail += sp[n] * c[n];
                            }
                            a[0] += tail;
                            acc[q] = a;
                        }
                        v16 ys = lane_sums(acc);
                        for (int64_t q = 0; q < pn; q++) o[p0 + q] = D ? ys[q] + D[h] * xh[p0 + q] : ys[q];
                    }
                }
            }
        restore_subnormals(csr);
    }
}
