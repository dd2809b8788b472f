/* The elementwise work of a decode step of a few rows, one call each (CPU, float32).
 *
 * At one row a layer's norms, rotary, KV store and SwiGLU gate are a few thousand floats
 * each, and the torch path spends them as some 25 small operator calls per layer (a few
 * microseconds of dispatch each, against well under one of arithmetic). These loops do the
 * same arithmetic in one call per operation:
 *
 *   add_rms_norm  residual += x (unless x is NULL); out = residual * rsqrt(mean(r^2) + eps) * w
 *   rotary        q and k heads rotated in place (rotate-half): x1 c - x2 s, x2 c + x1 s,
 *                 the same products and differences as the torch path (built without
 *                 contracting them into FMAs, so they round alike)
 *   store_kv      k and v rows copied into their cache slots (slot < 0: skipped);
 *                 store_kv_bf16 rounds them to bfloat16 on the way, as torch does
 *   silu_mul      out = silu(gate) * up, gate and up the two halves of each input row
 *   rows_to_unit  each row divided by its largest magnitude (at least 1e-30), which is kept;
 *   rows_times    and each row multiplied back by it: the per-row scaling around a product
 *                 that quantizes its whole input with one scale (torch's x.abs().amax(),
 *                 x / s, y * s, in one pass each instead of four operator calls)
 *
 * Rows are contiguous unless a row stride is given. A decode step of a few rows runs on
 * this thread alone (too little work to share); prefill chunks and wide decode batches,
 * PARALLEL_MIN values or more, split their rows over the OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

/* Below this many values an operation stays on the calling thread: waking a sleeping
 * OpenMP thread (the worker's passive wait policy) costs tens of microseconds. */
#define PARALLEL_MIN (1 << 17)
/* The row scaling is one read and one write a value: a thread streams 128 x 1,536 values in
 * about 30 us, less than a wake-up (measured on a 2-core EPYC, passive wait). */
#define SCALE_PARALLEL_MIN (1 << 20)

void add_rms_norm(const float *x, float *residual, const float *w, float eps, float *out,
                  int64_t rows, int64_t h) {
#pragma omp parallel for if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * h;
        if (x) {
            const float *xr = x + r * h;
#pragma omp simd
            for (int64_t i = 0; i < h; i++) res[i] += xr[i];
        }
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < h; i++) s += res[i] * res[i];
        const float inv = 1.0f / sqrtf(s / (float)h + eps);
        float *o = out + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = (res[i] * inv) * w[i];
    }
}

/* heads [T] rows of `nheads` heads of `d` values at row stride `stride`. */
/* Returns -1 (touching nothing) when a position is outside 0..max_pos-1. */
int rotary(float *heads, int64_t tokens, int64_t stride, int64_t nheads, int64_t d,
           const int64_t *positions, const float *cos_table, const float *sin_table,
           int64_t max_pos) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
#pragma omp parallel for if (tokens * nheads * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * half, *s = sin_table + positions[t] * half;
        for (int64_t hd = 0; hd < nheads; hd++) {
            float *x1 = heads + t * stride + hd * d, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                const float b_s = b * s[i], a_s = a * s[i];
                x1[i] = a * c[i] - b_s;
                x2[i] = b * c[i] + a_s;
            }
        }
    }
    return 0;
}

/* x rounded to bfloat16 to the nearest, ties to even, as torch's tensor conversion
 * (ATen's vectorized float -> bfloat16) rounds: a NaN becomes 0xffff (a NaN, what ATen
 * writes for any NaN); anything else gets 0x7fff plus its kept lowest bit added, then
 * loses its low 16 bits (a value past the largest bfloat16 rounds to infinity). */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0xffff;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* k, v: [T] rows of `width` floats at row strides k_stride, v_stride; caches: num_slots
 * slots of `width` values, float32 or (`bf16`, a constant in each copy below) bfloat16,
 * rounded by to_bf16. Returns -1 (touching nothing) when a slot is past the cache. */
static inline __attribute__((always_inline)) int store_rows(
    const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache,
    void *v_cache, const int64_t *slots, int64_t tokens, int64_t width, int64_t num_slots,
    int bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        const float *ks = k + t * k_stride, *vs = v + t * v_stride;
        if (!bf16) {
            memcpy((float *)k_cache + slots[t] * width, ks, (size_t)width * sizeof(float));
            memcpy((float *)v_cache + slots[t] * width, vs, (size_t)width * sizeof(float));
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slots[t] * width;
        uint16_t *vd = (uint16_t *)v_cache + slots[t] * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) kd[i] = to_bf16(ks[i]);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) vd[i] = to_bf16(vs[i]);
    }
    return 0;
}

/* store_rows into float32 and into bfloat16 caches. The caches are `void *` so that
 * `decode_layers` holds either kind through one type. */
int store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
             void *k_cache, void *v_cache, const int64_t *slots, int64_t tokens,
             int64_t width, int64_t num_slots) {
    return store_rows(k, k_stride, v, v_stride, k_cache, v_cache, slots, tokens, width,
                      num_slots, 0);
}

int store_kv_bf16(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                  void *k_cache, void *v_cache, const int64_t *slots, int64_t tokens,
                  int64_t width, int64_t num_slots) {
    return store_rows(k, k_stride, v, v_stride, k_cache, v_cache, slots, tokens, width,
                      num_slots, 1);
}

/* gate_up [T, 2I] -> out [T, I]. silu(g) = g / (1 + e^-g), with e^-|g| only (no overflow):
 * for g < 0, g e^g / (1 + e^g). */
void silu_mul(const float *gate_up, float *out, int64_t tokens, int64_t inter) {
#pragma omp parallel for if (tokens * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            /* One division, its numerator chosen: a choice between two divisions is
             * control flow the vectorizer refuses (a division may trap), and the scalar
             * loop took 5x torch's time. */
            const float e = exp_nonpositive(-fabsf(g[i]));
            const float sig = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* scale[t] = max(max |x[t, :]|, 1e-30); out[t, :] = x[t, :] / scale[t]. A NaN in a row makes
 * its scale NaN (as torch's amax does), hence its whole output row. */
void rows_to_unit(const float *x, float *out, float *scale, int64_t tokens, int64_t width) {
#pragma omp parallel for if (tokens * width >= SCALE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const float *r = x + t * width;
        /* Selects, not fmaxf (whose NaN rule does not vectorize); NaNs counted aside. */
        float top = 0.0f, nans = 0.0f;
#pragma omp simd reduction(max : top) reduction(+ : nans)
        for (int64_t i = 0; i < width; i++) {
            const float a = fabsf(r[i]);
            top = a > top ? a : top;
            nans += a != a ? 1.0f : 0.0f;
        }
        const float s = nans > 0.0f ? NAN : top > 1e-30f ? top : 1e-30f;
        scale[t] = s;
        float *o = out + t * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = r[i] / s;
    }
}

/* y[t, :] *= scale[t], in place. */
void rows_times(float *y, const float *scale, int64_t tokens, int64_t width) {
#pragma omp parallel for if (tokens * width >= SCALE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        float *r = y + t * width;
        const float s = scale[t];
#pragma omp simd
        for (int64_t i = 0; i < width; i++) r[i] *= s;
    }
}
