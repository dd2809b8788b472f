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
 * this thread alone (too little work to share). Where the caller handed in the process's
 * helper threads (`pool.c`), the norm, rotary and gate of POOL_MIN values or more split
 * their rows into items there: a 64-row decode step's, which are too small for an OpenMP
 * region's wake-up, take the helper still spinning from the product before them. Without
 * the pool, PARALLEL_MIN values or more split their rows over the OpenMP threads. Each row
 * is computed the same way wherever it runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "pool.h"

/* Below this many values an operation stays on the calling thread: waking a sleeping
 * OpenMP thread (the worker's passive wait policy) costs tens of microseconds. */
#define PARALLEL_MIN (1 << 17)
/* The same on the pool, whose caller starts on the items at once and waits only for those
 * a helper took: a few microseconds of work are enough. */
#define POOL_MIN (1 << 13)
/* Items a pooled operation's rows are cut into (fewer where it has fewer rows): enough that
 * a helper coming late still finds some. */
#define POOL_PARTS 8

/* The process's shared helper threads, where the caller hands them in; NULL: OpenMP's. */
static pool_run_fn shared_pool;

void decode_ops_use_pool(pool_run_fn run) { shared_pool = run; }

/* Rows [r0, r1) of one operation's call (`ctx`). */
typedef void (*rows_fn)(const void *ctx, int64_t r0, int64_t r1);

typedef struct {
    rows_fn fn;
    const void *ctx;
    int64_t rows, parts;
} Split;

static void split_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const Split *s = ctx;
    s->fn(s->ctx, item * s->rows / s->parts, (item + 1) * s->rows / s->parts);
}

/* Whether the rows ran on the pool (handed in, not inside an OpenMP region, `values` at
 * least POOL_MIN); otherwise the caller runs them. */
static int pooled(rows_fn fn, const void *ctx, int64_t rows, int64_t values) {
    if (rows < 2 || values < POOL_MIN) return 0;
    const Split s = {fn, ctx, rows, rows < POOL_PARTS ? rows : POOL_PARTS};
    return pool_took(shared_pool, split_item, (void *)&s, s.parts);
}
/* The row scaling is one read and one write a value: a thread streams 128 x 1,536 values in
 * about 30 us, less than a wake-up (measured on a 2-core EPYC, passive wait). */
#define SCALE_PARALLEL_MIN (1 << 20)

typedef struct {
    const float *x;
    float *residual;
    const float *w;
    float eps;
    float *out;
    int64_t h;
} Norm;

static void norm_rows(const void *ctx, int64_t r0, int64_t r1) {
    const Norm *a = ctx;
    const int64_t h = a->h;
    for (int64_t r = r0; r < r1; r++) {
        float *res = a->residual + r * h;
        if (a->x) {
            const float *xr = a->x + r * h;
#pragma omp simd
            for (int64_t i = 0; i < h; i++) res[i] += xr[i];
        }
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < h; i++) s += res[i] * res[i];
        const float inv = 1.0f / sqrtf(s / (float)h + a->eps);
        float *o = a->out + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = (res[i] * inv) * a->w[i];
    }
}

void add_rms_norm(const float *x, float *residual, const float *w, float eps, float *out,
                  int64_t rows, int64_t h) {
    const Norm a = {x, residual, w, eps, out, h};
    if (pooled(norm_rows, &a, rows, rows * h)) return;
#pragma omp parallel for if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) norm_rows(&a, r, r + 1);
}

typedef struct {
    float *heads;
    int64_t stride, nheads, d;
    const int64_t *positions;
    const float *cos_table, *sin_table;
} Rotary;

static void rotary_rows(const void *ctx, int64_t t0, int64_t t1) {
    const Rotary *a = ctx;
    const int64_t half = a->d / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos_table + a->positions[t] * half;
        const float *s = a->sin_table + a->positions[t] * half;
        for (int64_t hd = 0; hd < a->nheads; hd++) {
            float *x1 = a->heads + t * a->stride + hd * a->d, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float p = x1[i], q = x2[i];
                const float q_s = q * s[i], p_s = p * s[i];
                x1[i] = p * c[i] - q_s;
                x2[i] = q * c[i] + p_s;
            }
        }
    }
}

/* heads [T] rows of `nheads` heads of `d` values at row stride `stride`. */
/* Returns -1 (touching nothing) when a position is outside 0..max_pos-1. */
int rotary(float *heads, int64_t tokens, int64_t stride, int64_t nheads, int64_t d,
           const int64_t *positions, const float *cos_table, const float *sin_table,
           int64_t max_pos) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
    const Rotary a = {heads, stride, nheads, d, positions, cos_table, sin_table};
    if (pooled(rotary_rows, &a, tokens, tokens * nheads * d)) return 0;
#pragma omp parallel for if (tokens * nheads * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) rotary_rows(&a, t, t + 1);
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

typedef struct {
    const float *gate_up;
    float *out;
    int64_t inter;
} Gate;

static void gate_rows(const void *ctx, int64_t t0, int64_t t1) {
    const Gate *a = ctx;
    const int64_t inter = a->inter;
    for (int64_t t = t0; t < t1; t++) {
        const float *g = a->gate_up + t * 2 * inter, *u = g + inter;
        float *o = a->out + t * inter;
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

/* gate_up [T, 2I] -> out [T, I]. silu(g) = g / (1 + e^-g), with e^-|g| only (no overflow):
 * for g < 0, g e^g / (1 + e^g). */
void silu_mul(const float *gate_up, float *out, int64_t tokens, int64_t inter) {
    const Gate a = {gate_up, out, inter};
    if (pooled(gate_rows, &a, tokens, tokens * inter)) return;
#pragma omp parallel for if (tokens * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) gate_rows(&a, t, t + 1);
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
