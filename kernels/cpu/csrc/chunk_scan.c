/* The recurrent layers' prefill scans on the CPU (float32): Mamba2's chunked state space
 * dual form and gated DeltaNet's chunked delta rule, over rows already laid out in chunks
 * of Q tokens ([R, K, Q, ...], padding with dt = 0 / g = beta = 0).
 *
 * The torch forms (`ssd_scan.ssd_scan`, `delta_scan.delta_scan`) materialise every chunk's
 * [Q, Q] decay-weighted products for every head at once, then pass the states from chunk
 * to chunk in a Python loop of small batched products: most of their time goes to memory
 * traffic over those temporaries and to per-call overhead. Here one (row, head) pair walks
 * its chunks in order with its state in a local buffer (a few tens of KiB: the core's
 * cache), so every product is a small dense one over data already close, and the pairs
 * are spread over the OpenMP threads. The [Q, Q] products that do not depend on the head
 * (C.B per group, k.k and q.k per key head) come in precomputed (one batched matmul each
 * in torch), as do the running sums of the log decays, so both forms round those alike.
 *
 * Every product goes through `gemm_acc`: C[M, N] += A[M, K] B[K, N] with N contiguous,
 * four rows of C at a time in 16-wide vectors (GCC vector extensions: AVX-512 where the
 * build has it, two AVX2 halves otherwise), a scalar tail for N not a multiple of 16.
 *
 *   ssd_chunk_scan_f32    y, h_in (optional), h_end of `ssd_scan`
 *   delta_chunk_scan_f32  o, u, h_in (optional), h_end of `delta_scan`
 *   causal_conv_silu_f32  the short causal convolution over token-major rows, reading the
 *                         rows' K - 1 earlier inputs from their conv states, then SiLU
 *
 * Both scans return 0, or -1 where a scratch buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "flush_denormals.h"

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) {
    v16 v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
    return v;
}

/* C[M, N] (row stride ldc) += A[M, K] (row stride lda) B[K, N] (row stride ldb). With
 * `lower`, A is lower triangular (A[m][k] = 0 for k > m): row m reads k <= m only. */
static void gemm_acc(int64_t m_rows, int64_t n, int64_t k_len, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float *c, int64_t ldc, int lower) {
    for (int64_t m = 0; m < m_rows; m += 4) {
        const int64_t rows = m_rows - m < 4 ? m_rows - m : 4;
        const int64_t kend = lower ? (m + rows < k_len ? m + rows : k_len) : k_len;
        const float *a0 = a + m * lda;
        const float *a1 = rows > 1 ? a0 + lda : a0;
        const float *a2 = rows > 2 ? a0 + 2 * lda : a0;
        const float *a3 = rows > 3 ? a0 + 3 * lda : a0;
        float *c0 = c + m * ldc;
        int64_t j = 0;
        for (; j + 32 <= n; j += 32) {
            v16 s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0};
            v16 s20 = {0}, s21 = {0}, s30 = {0}, s31 = {0};
            for (int64_t k = 0; k < kend; k++) {
                const v16 b0 = load16(b + k * ldb + j), b1 = load16(b + k * ldb + j + 16);
                const v16 x0 = splat16(a0[k]), x1 = splat16(a1[k]);
                const v16 x2 = splat16(a2[k]), x3 = splat16(a3[k]);
                s00 += x0 * b0, s01 += x0 * b1, s10 += x1 * b0, s11 += x1 * b1;
                s20 += x2 * b0, s21 += x2 * b1, s30 += x3 * b0, s31 += x3 * b1;
            }
            const v16 sums[4][2] = {{s00, s01}, {s10, s11}, {s20, s21}, {s30, s31}};
            for (int64_t i = 0; i < rows; i++) {
                float *ci = c0 + i * ldc + j;
                store16(ci, load16(ci) + sums[i][0]);
                store16(ci + 16, load16(ci + 16) + sums[i][1]);
            }
        }
        for (; j + 16 <= n; j += 16) {
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int64_t k = 0; k < kend; k++) {
                const v16 b0 = load16(b + k * ldb + j);
                s0 += splat16(a0[k]) * b0, s1 += splat16(a1[k]) * b0;
                s2 += splat16(a2[k]) * b0, s3 += splat16(a3[k]) * b0;
            }
            const v16 sums[4] = {s0, s1, s2, s3};
            for (int64_t i = 0; i < rows; i++) {
                float *ci = c0 + i * ldc + j;
                store16(ci, load16(ci) + sums[i]);
            }
        }
        if (j < n) {
            for (int64_t i = 0; i < rows; i++) {
                const float *ai = a0 + i * lda;
                float *ci = c0 + i * ldc;
                for (int64_t k = 0; k < kend; k++) {
                    const float x = ai[k];
                    const float *bk = b + k * ldb;
                    for (int64_t jj = j; jj < n; jj++) ci[jj] += x * bk[jj];
                }
            }
        }
    }
}

/* dst[j][i] = src[i][j] for an [rows, cols] matrix (strides given). */
static void transpose(const float *src, int64_t lds, int64_t rows, int64_t cols, float *dst,
                      int64_t ldd) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

/* Mamba2. x [R, K, Q, H, P]; dt, cum [R, K, Q, H] (cum: the running sum of dt A within
 * each chunk); cb [R, K, G, Q, Q] (C_t . B_s); b, c [R, K, Q, G, N]; d [H];
 * h0 [R, H, P, N]. Out: y [R, K, Q, H, P]; h_in [R, K, H, P, N] (NULL: not kept);
 * h_end [R, H, P, N]. All contiguous. */
int ssd_chunk_scan_f32(const float *x, const float *dt, const float *cum, const float *cb,
                       const float *b, const float *c, const float *d, const float *h0,
                       float *y, float *h_in, float *h_end, int64_t rows, int64_t chunks,
                       int64_t q, int64_t heads, int64_t p, int64_t groups, int64_t n) {
    const int64_t per = heads / groups;
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: see flush_denormals.h */
        const fp_mode mode = flush_denormals();
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < heads; h++) {
                const int64_t g = h / per;
                /* st [N, P]: the state transposed, so every product runs along P */
                float *st = malloc(sizeof(float) * (n * p + q * q + q * n + n * q + q * p + q));
                if (!st) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                float *w = st + n * p;       /* [Q, Q] decay-weighted C.B dt */
                float *ce = w + q * q;       /* [Q, N] e^{cum_t} C_t */
                float *bt = ce + q * n;      /* [N, Q] B_s e^{cum_end - cum_s} dt_s */
                float *acc = bt + n * q;     /* [Q, P] the chunk's outputs */
                float *cm = acc + q * p;     /* [Q] cum of this head */
                transpose(h0 + (r * heads + h) * p * n, n, p, n, st, p);
                for (int64_t k = 0; k < chunks; k++) {
                    const int64_t tok0 = (r * chunks + k) * q; /* the chunk's first token */
                    for (int64_t t = 0; t < q; t++) cm[t] = cum[(tok0 + t) * heads + h];
                    if (h_in) {
                        float *dst = h_in + ((r * chunks + k) * heads + h) * p * n;
                        transpose(st, p, n, p, dst, n);
                    }
                    const float *cbk = cb + ((r * chunks + k) * groups + g) * q * q;
                    for (int64_t t = 0; t < q; t++) {
                        for (int64_t s = 0; s <= t; s++)
                            w[t * q + s] = exp_nonpositive(cm[t] - cm[s]) * cbk[t * q + s] *
                                           dt[(tok0 + s) * heads + h];
                        for (int64_t s = t + 1; s < q; s++) w[t * q + s] = 0.0f;
                        const float e = exp_nonpositive(cm[t]);
                        const float *ct = c + ((tok0 + t) * groups + g) * n;
                        for (int64_t i = 0; i < n; i++) ce[t * n + i] = e * ct[i];
                    }
                    const float *xk = x + (tok0 * heads + h) * p;
                    const int64_t ldx = heads * p;
                    memset(acc, 0, sizeof(float) * q * p);
                    gemm_acc(q, p, q, w, q, xk, ldx, acc, p, 1);  /* within the chunk */
                    gemm_acc(q, p, n, ce, n, st, p, acc, p, 0);   /* from the entering state */
                    const float dh = d[h];
                    for (int64_t t = 0; t < q; t++) {
                        float *yt = y + ((tok0 + t) * heads + h) * p;
                        const float *xt = xk + t * ldx;
                        for (int64_t i = 0; i < p; i++) yt[i] = acc[t * p + i] + dh * xt[i];
                    }
                    /* the state at the chunk's end: decayed, plus what each token adds */
                    const float last = cm[q - 1];
                    for (int64_t s = 0; s < q; s++) {
                        const float f = exp_nonpositive(last - cm[s]) * dt[(tok0 + s) * heads + h];
                        const float *bs = b + ((tok0 + s) * groups + g) * n;
                        for (int64_t i = 0; i < n; i++) bt[i * q + s] = f * bs[i];
                    }
                    const float decay = exp_nonpositive(last);
                    for (int64_t i = 0; i < n * p; i++) st[i] *= decay;
                    gemm_acc(n, p, q, bt, q, xk, ldx, st, p, 0);
                }
                transpose(st, p, n, p, h_end + (r * heads + h) * p * n, n);
                free(st);
            }
        }
        restore_fp_mode(mode);
    }
    return failed ? -1 : 0;
}

/* Gated DeltaNet. q, k [R, K, Q, Hk, Dk] (already L2-normed where the layer norms them; q
 * already scaled); v [R, K, Q, Hv, Dv]; cum, beta [R, K, Q, Hv] (cum: running sum of the
 * log decays within each chunk); kk, qk [R, K, Hk, Q, Q] (k_t . k_s and q_t . k_s);
 * h0 [R, Hv, Dk, Dv]. Out: o, u [R, K, Q, Hv, Dv]; h_in [R, K, Hv, Dk, Dv] (NULL: not
 * kept); h_end [R, Hv, Dk, Dv]. All contiguous; value head h reads key head h / (Hv / Hk). */
int delta_chunk_scan_f32(const float *qn, const float *kn, const float *v, const float *cum,
                         const float *beta, const float *kk, const float *qk, const float *h0,
                         float *o, float *u, float *h_in, float *h_end, int64_t rows,
                         int64_t chunks, int64_t q, int64_t hk, int64_t hv, int64_t dk,
                         int64_t dv) {
    const int64_t per = hv / hk;
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: see flush_denormals.h */
        const fp_mode mode = flush_denormals();
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < hv; h++) {
                const int64_t g = h / per;
                float *s = malloc(sizeof(float) * (dk * dv + 2 * q * q + 2 * q * dk + dk * q +
                                                   2 * q * dv + 2 * q));
                if (!s) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                float *a = s + dk * dv;   /* [Q, Q] beta_t e^{G_t - G_s} k_t.k_s, s < t */
                float *wq = a + q * q;    /* [Q, Q] e^{G_t - G_s} q_t.k_s, s <= t */
                float *ke = wq + q * q;   /* [Q, Dk] e^{G_t} k_t */
                float *qe = ke + q * dk;  /* [Q, Dk] e^{G_t} q_t */
                float *kt = qe + q * dk;  /* [Dk, Q] k_s e^{G_end - G_s} */
                float *uk = kt + dk * q;  /* [Q, Dv] the chunk's new values */
                float *ok = uk + q * dv;  /* [Q, Dv] the chunk's outputs */
                float *cm = ok + q * dv;  /* [Q] */
                float *bt = cm + q;       /* [Q] */
                memcpy(s, h0 + (r * hv + h) * dk * dv, sizeof(float) * dk * dv);
                const int64_t ldk = hk * dk, ldv = hv * dv;
                for (int64_t c = 0; c < chunks; c++) {
                    const int64_t tok0 = (r * chunks + c) * q;
                    for (int64_t t = 0; t < q; t++) {
                        cm[t] = cum[(tok0 + t) * hv + h];
                        bt[t] = beta[(tok0 + t) * hv + h];
                    }
                    if (h_in)
                        memcpy(h_in + ((r * chunks + c) * hv + h) * dk * dv, s,
                               sizeof(float) * dk * dv);
                    const float *kkc = kk + ((r * chunks + c) * hk + g) * q * q;
                    const float *qkc = qk + ((r * chunks + c) * hk + g) * q * q;
                    const float *kc = kn + tok0 * ldk + g * dk;
                    const float *qc = qn + tok0 * ldk + g * dk;
                    const float *vc = v + tok0 * ldv + h * dv;
                    for (int64_t t = 0; t < q; t++) {
                        for (int64_t j = 0; j < q; j++) {
                            const float e = j <= t ? exp_nonpositive(cm[t] - cm[j]) : 0.0f;
                            a[t * q + j] = j < t ? bt[t] * e * kkc[t * q + j] : 0.0f;
                            wq[t * q + j] = e * qkc[t * q + j];
                        }
                        const float e = exp_nonpositive(cm[t]);
                        for (int64_t i = 0; i < dk; i++) {
                            ke[t * dk + i] = e * kc[t * ldk + i];
                            qe[t * dk + i] = e * qc[t * ldk + i];
                        }
                    }
                    /* u_t = beta_t (v_t - e^{G_t} S^T k_t) - sum_{s<t} A[t, s] u_s */
                    memset(uk, 0, sizeof(float) * q * dv);
                    gemm_acc(q, dv, dk, ke, dk, s, dv, uk, dv, 0);
                    for (int64_t t = 0; t < q; t++) {
                        float *ut = uk + t * dv;
                        const float *vt = vc + t * ldv;
                        for (int64_t j = 0; j < dv; j++) ut[j] = bt[t] * (vt[j] - ut[j]);
                        for (int64_t j = 0; j < t; j++) {
                            const float f = a[t * q + j];
                            const float *uj = uk + j * dv;
                            for (int64_t i = 0; i < dv; i++) ut[i] -= f * uj[i];
                        }
                    }
                    /* o_t = e^{G_t} S^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t.k_s) u_s */
                    memset(ok, 0, sizeof(float) * q * dv);
                    gemm_acc(q, dv, dk, qe, dk, s, dv, ok, dv, 0);
                    gemm_acc(q, dv, q, wq, q, uk, dv, ok, dv, 1);
                    for (int64_t t = 0; t < q; t++) {
                        memcpy(o + (tok0 + t) * ldv + h * dv, ok + t * dv, sizeof(float) * dv);
                        memcpy(u + (tok0 + t) * ldv + h * dv, uk + t * dv, sizeof(float) * dv);
                    }
                    /* S <- e^{G_end} S + sum_s e^{G_end - G_s} k_s u_s^T */
                    const float last = cm[q - 1];
                    for (int64_t t = 0; t < q; t++) {
                        const float f = exp_nonpositive(last - cm[t]);
                        for (int64_t i = 0; i < dk; i++) kt[i * q + t] = f * kc[t * ldk + i];
                    }
                    const float decay = exp_nonpositive(last);
                    for (int64_t i = 0; i < dk * dv; i++) s[i] *= decay;
                    gemm_acc(dk, dv, q, kt, q, uk, dv, s, dv, 0);
                }
                memcpy(h_end + (r * hv + h) * dk * dv, s, sizeof(float) * dk * dv);
                free(s);
            }
        }
        restore_fp_mode(mode);
    }
    return failed ? -1 : 0;
}

/* out[r, l, c] = silu(bias[c] + sum_j w[c, j] in[r, l - (K - 1) + j, c]), where inputs
 * before a row's first token come from its conv state: x [R, L, C] token-major (row
 * stride ldx_r, token stride ldx_t, unit channel stride), state [R, C, K - 1],
 * wt [K, C] (the weight transposed), bias [C] or NULL; out [R, L, C] contiguous. */
void causal_conv_silu_f32(const float *x, int64_t ldx_r, int64_t ldx_t, const float *state,
                          const float *wt, const float *bias, float *out, int64_t rows,
                          int64_t len, int64_t channels, int64_t width) {
    const int64_t block = 32; /* tokens per task */
    const int64_t blocks = (len + block - 1) / block;
#pragma omp parallel
    {
        /* per thread: see flush_denormals.h */
        const fp_mode mode = flush_denormals();
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t bl = 0; bl < blocks; bl++) {
                const float *xr = x + r * ldx_r;
                const float *sr = state + r * channels * (width - 1);
                const int64_t l1 = (bl + 1) * block < len ? (bl + 1) * block : len;
                for (int64_t l = bl * block; l < l1; l++) {
                    float *ot = out + (r * len + l) * channels;
                    if (bias)
                        memcpy(ot, bias, sizeof(float) * channels);
                    else
                        memset(ot, 0, sizeof(float) * channels);
                    for (int64_t j = 0; j < width; j++) {
                        const int64_t at = l - (width - 1) + j;
                        const float *wj = wt + j * channels;
                        if (at < 0) { /* from the conv state: strided, the row's first tokens */
                            const int64_t col = at + width - 1;
                            for (int64_t ch = 0; ch < channels; ch++)
                                ot[ch] += wj[ch] * sr[ch * (width - 1) + col];
                            continue;
                        }
                        const float *in = xr + at * ldx_t;
#pragma omp simd
                        for (int64_t ch = 0; ch < channels; ch++) ot[ch] += wj[ch] * in[ch];
                    }
#pragma omp simd
                    for (int64_t ch = 0; ch < channels; ch++) {
                        const float v = ot[ch];
                        const float e = exp_nonpositive(-fabsf(v));
                        ot[ch] = v * (v >= 0.0f ? 1.0f : e) / (1.0f + e);
                    }
                }
            }
        }
        restore_fp_mode(mode);
    }
}
