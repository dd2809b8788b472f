/* A MoE layer's experts in one call (CPU, float32): routed experts and the shared expert.
 *
 * A decode step of 16-64 rows sends its (token, k) pairs to most of a layer's experts, a
 * few rows each, so the step is a stream of expert weights: each expert's weights should be
 * read once for all its rows, and the time per expert spent on anything but that stream
 * (a Python call, an OpenMP fork and join per product) is what a step loses. Here the
 * pairs are grouped by expert (a counting sort, stable in token order) and the whole layer
 * is one OpenMP region whose threads take work items from one list (a thread that another
 * process holds off its core leaves its share to the others):
 *
 *   1. gate_up: item (expert, 32 intermediate columns): for every row of the expert, its
 *      32 gate and 32 up outputs, then act = silu(gate) * up * the pair's routing weight
 *      (down is linear, so this equals scaling its output);
 *   2. down: item (expert, 64 hidden columns): dout[pair] = act[pair] W_down^T, once the
 *      expert's gate_up items are done;
 *   3. after the region: out[t] = sum over k of dout[(t, k)], then + the shared expert's
 *      row, in that order.
 *
 * The shared expert (DeepSeek's, Granite's, Qwen3-Next's) is one more expert that every
 * token goes to, with weight 1 or (Qwen3-Next) sigmoid(x . shared_gate).
 *
 * Products are tiles of up to 4 rows by 4 outputs (16 accumulators of one vector each; the
 * 4 weight rows stay in L1 while the expert's rows pass over them), so an expert's weights
 * come from memory once per step however many rows it has. Each output is one dot product
 * summed in one fixed order, whichever thread computes it: the result does not depend on
 * the thread count or the schedule.
 */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "fast_exp.h"

#define GATE_COLS 32 /* intermediate columns per phase-1 item (x2: gate and up rows) */
#define DOWN_COLS 64 /* hidden columns per phase-2 item */

/* The four outputs y[r][0..3] = a[r] . w[j], j < 4 (w: 4 rows of k), for rows r < MR. */
#if defined(__AVX512F__)
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v) \
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    const __m256 a8 = HALVES(a), b8 = HALVES(b), c8 = HALVES(c), d8 = HALVES(d);
#undef HALVES
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline __attribute__((always_inline)) void tile(const float *const *a, const int mr,
                                                       const float *w, int64_t k,
                                                       float out[4][4]) {
    __m512 c[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        /* The next tile's 4 rows, 4 lines a step, in address order. Without it the 4
         * rows read at once (4 streams 2 KB apart) came from memory at 6-9 GB/s on a
         * 2-core EPYC (one thread), where one row at a time read 10-14 and this 18-20. */
        _mm_prefetch((const char *)(w + 4 * k + 4 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 4 * k + 4 * i + 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 4 * k + 4 * i + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 4 * k + 4 * i + 48), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + k + i);
        const __m512 w2 = _mm512_loadu_ps(w + 2 * k + i), w3 = _mm512_loadu_ps(w + 3 * k + i);
        for (int r = 0; r < mr; r++) {
            const __m512 av = _mm512_loadu_ps(a[r] + i);
            c[r][0] = _mm512_fmadd_ps(av, w0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(av, w1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(av, w2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(av, w3, c[r][3]);
        }
    }
    if (i < k) { /* the tail, masked */
        const __mmask16 m = (__mmask16)((1u << (k - i)) - 1u);
        const __m512 w0 = _mm512_maskz_loadu_ps(m, w + i), w1 = _mm512_maskz_loadu_ps(m, w + k + i);
        const __m512 w2 = _mm512_maskz_loadu_ps(m, w + 2 * k + i);
        const __m512 w3 = _mm512_maskz_loadu_ps(m, w + 3 * k + i);
        for (int r = 0; r < mr; r++) {
            const __m512 av = _mm512_maskz_loadu_ps(m, a[r] + i);
            c[r][0] = _mm512_fmadd_ps(av, w0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(av, w1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(av, w2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(av, w3, c[r][3]);
        }
    }
    for (int r = 0; r < mr; r++) _mm_storeu_ps(out[r], reduce4(c[r][0], c[r][1], c[r][2], c[r][3]));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline __attribute__((always_inline)) void tile(const float *const *a, const int mr,
                                                       const float *w, int64_t k,
                                                       float out[4][4]) {
    __m256 c[4][4];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        _mm_prefetch((const char *)(w + 4 * k + 4 * i), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 4 * k + 4 * i + 16), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + k + i);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * k + i), w3 = _mm256_loadu_ps(w + 3 * k + i);
        for (int r = 0; r < mr; r++) {
            const __m256 av = _mm256_loadu_ps(a[r] + i);
            c[r][0] = _mm256_fmadd_ps(av, w0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(av, w1, c[r][1]);
            c[r][2] = _mm256_fmadd_ps(av, w2, c[r][2]);
            c[r][3] = _mm256_fmadd_ps(av, w3, c[r][3]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm_storeu_ps(out[r], reduce4(c[r][0], c[r][1], c[r][2], c[r][3]));
        for (int64_t t = i; t < k; t++)
            for (int j = 0; j < 4; j++) out[r][j] += a[r][t] * w[j * k + t];
    }
}
#else
static inline void tile(const float *const *a, const int mr, const float *w, int64_t k,
                        float out[4][4]) {
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 4; j++) {
            float s = 0.0f;
            for (int64_t t = 0; t < k; t++) s += a[r][t] * w[j * k + t];
            out[r][j] = s;
        }
}
#endif

/* One output (w's row j) of row a: the columns past the last whole group of 4. */
static inline float dot1(const float *a, const float *w, int64_t k) {
    float s = 0.0f;
    for (int64_t t = 0; t < k; t++) s += a[t] * w[t];
    return s;
}

/* y[r][j] = a[r] . w[j] for r < mr, j < n (w: n rows of k; row r of y at y + r * ys), by
 * 4x4 tiles: the 4 weight rows stay in L1 while each group of 4 input rows passes over
 * them, so a few rows read the weights once and many rows do 16 FMAs per 8 loads. */
static void project(const float *const *a, int64_t mr, const float *w, int64_t k, int64_t n,
                    float *y, int64_t ys) {
    float o[4][4];
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        for (int64_t r0 = 0; r0 < mr; r0 += 4) {
            const int64_t m = mr - r0 < 4 ? mr - r0 : 4;
            switch (m) { /* a constant count in each case: the loops over rows unroll */
            case 4: tile(a + r0, 4, w + j * k, k, o); break;
            case 3: tile(a + r0, 3, w + j * k, k, o); break;
            case 2: tile(a + r0, 2, w + j * k, k, o); break;
            default: tile(a + r0, 1, w + j * k, k, o); break;
            }
            for (int64_t r = 0; r < m; r++) memcpy(y + (r0 + r) * ys + j, o[r], 4 * sizeof(float));
        }
    for (; j < n; j++)
        for (int64_t r = 0; r < mr; r++) y[r * ys + j] = dot1(a[r], w + j * k, k);
}

static inline float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)); /* one division: it vectorizes */
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* An expert's job: its rows (pairs start..start+rows of the sorted order) and weights. */
typedef struct {
    const float *gate_up; /* [2 inter, h] */
    const float *down;    /* [h, inter] */
    int64_t inter, start, rows;
} Job;

/* Rows of a job taken at a time: the gate and up outputs of that many rows stay on the
 * stack. */
#define ROW_BLOCK 64

/* Phase 1 for job `j`, intermediate columns c0..c1: act rows of its pairs. The gate rows
 * c0..c1 first, then the up rows (two runs of contiguous weight rows). */
static void gate_up_item(const Job *j, const float *x, int64_t h, const int64_t *tokens,
                         const float *scale, float *act, int64_t act_stride, int64_t c0,
                         int64_t c1) {
    const float *a[ROW_BLOCK];
    float g[ROW_BLOCK * GATE_COLS], u[ROW_BLOCK * GATE_COLS];
    const int64_t n = c1 - c0;
    for (int64_t p0 = 0; p0 < j->rows; p0 += ROW_BLOCK) {
        const int64_t mr = min64(ROW_BLOCK, j->rows - p0);
        for (int64_t r = 0; r < mr; r++) a[r] = x + tokens[j->start + p0 + r] * h;
        project(a, mr, j->gate_up + c0 * h, h, n, g, n);
        project(a, mr, j->gate_up + (j->inter + c0) * h, h, n, u, n);
        for (int64_t r = 0; r < mr; r++) {
            const int64_t p = j->start + p0 + r;
            float *o = act + p * act_stride + c0;
            for (int64_t q = 0; q < n; q++) o[q] = silu(g[r * n + q]) * u[r * n + q] * scale[p];
        }
    }
}

/* Phase 2 for job `j`, hidden columns c0..c1: dout rows of its pairs. */
static void down_item(const Job *j, const float *act, int64_t act_stride, float *dout,
                      int64_t h, int64_t c0, int64_t c1) {
    const float *a[ROW_BLOCK];
    for (int64_t p0 = 0; p0 < j->rows; p0 += ROW_BLOCK) {
        const int64_t mr = min64(ROW_BLOCK, j->rows - p0);
        for (int64_t r = 0; r < mr; r++) a[r] = act + (j->start + p0 + r) * act_stride;
        project(a, mr, j->down + c0 * j->inter, j->inter, c1 - c0,
                dout + (j->start + p0) * h + c0, h);
    }
}

/* out [T, H] = the routed experts' weighted sum (+ the shared expert's row) for x [T, H].
 * ids, weights [T, K]: each token's experts and routing weights. w_gate_up [E, 2I, H]
 * (each expert's gate rows, then its up rows), w_down [E, H, I]. shared_gate_up
 * [2 Is, H] and shared_down [H, Is] may be NULL (no shared expert); shared_gate [H] may be
 * NULL (weight 1), else the shared row is scaled by sigmoid(x . shared_gate). All float32,
 * contiguous. `parallel`: whether to use the OpenMP threads (a small layer runs on the
 * calling thread alone). Returns 0, -1 when out of memory, -2 for an expert id outside
 * [0, E). */
int experts_f32(const float *x, int64_t t, int64_t h, const int64_t *ids, const float *weights,
                int64_t k, const float *w_gate_up, const float *w_down, int64_t e, int64_t inter,
                const float *shared_gate_up, const float *shared_down, int64_t shared_inter,
                const float *shared_gate, float *out, int parallel) {
    const int shared = shared_gate_up != NULL && shared_down != NULL;
    const int64_t pairs = t * k, rows = pairs + (shared ? t : 0);
    const int64_t act_stride = inter > shared_inter || !shared ? inter : shared_inter;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= e) return -2;
    int64_t *counts = calloc((size_t)e + 1, sizeof(int64_t));
    int64_t *tokens = malloc((size_t)rows * sizeof(int64_t)); /* sorted pair -> token */
    int64_t *where = malloc((size_t)pairs * sizeof(int64_t)); /* pair (t, k) -> sorted index */
    float *scale = malloc((size_t)rows * sizeof(float));
    Job *jobs = malloc((size_t)(e + 1) * sizeof(Job));
    float *act = malloc((size_t)(rows * act_stride) * sizeof(float));
    float *dout = malloc((size_t)(rows * h) * sizeof(float));
    int code = 0;
    if (!counts || !tokens || !where || !scale || !jobs || !act || !dout) {
        code = -1;
        goto done;
    }
    /* Counting sort of the pairs by expert, token order within each expert. */
    for (int64_t p = 0; p < pairs; p++) counts[ids[p] + 1]++;
    int64_t njobs = 0;
    for (int64_t ex = 0; ex < e; ex++) {
        if (counts[ex + 1])
            jobs[njobs++] = (Job){w_gate_up + ex * 2 * inter * h, w_down + ex * h * inter, inter,
                                  counts[ex], counts[ex + 1]};
        counts[ex + 1] += counts[ex];
    }
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s = counts[ids[p]]++;
        tokens[s] = p / k;
        where[p] = s;
        scale[s] = weights[p];
    }
    if (shared) {
        jobs[njobs++] = (Job){shared_gate_up, shared_down, shared_inter, pairs, t};
        for (int64_t i = 0; i < t; i++) {
            tokens[pairs + i] = i;
            scale[pairs + i] = 1.0f;
            if (shared_gate) {
                const float z = dot1(x + i * h, shared_gate, h);
                scale[pairs + i] = 1.0f / (1.0f + expf(-z));
            }
        }
    }
    /* Work items: (job, column chunk) for each phase, numbered across jobs. */
    int64_t *first_up = malloc((size_t)(njobs + 1) * sizeof(int64_t));
    int64_t *first_down = malloc((size_t)(njobs + 1) * sizeof(int64_t));
    _Atomic int64_t *up_left = malloc((size_t)(njobs + 1) * sizeof(_Atomic int64_t));
    if (!first_up || !first_down || !up_left) {
        free(first_up);
        free(first_down);
        free((void *)up_left);
        code = -1;
        goto done;
    }
    first_up[0] = first_down[0] = 0;
    const int64_t down_chunks = (h + DOWN_COLS - 1) / DOWN_COLS;
    for (int64_t j = 0; j < njobs; j++) {
        first_up[j + 1] = first_up[j] + (jobs[j].inter + GATE_COLS - 1) / GATE_COLS;
        first_down[j + 1] = first_down[j] + down_chunks;
        atomic_init(&up_left[j], first_up[j + 1] - first_up[j]);
    }
    const int64_t up_items = first_up[njobs], items = up_items + first_down[njobs];
    /* One list, gate_up items first: by the time a thread takes a job's down item, all of
     * the job's gate_up items are taken, and it waits only for one another thread is in
     * the middle of. No barrier between the phases (on a shared machine a barrier waits
     * for a thread that another process holds off its core, for as long as it is held
     * off), and the tokens' sums are made on the calling thread after the region. */
    _Atomic int64_t next;
    atomic_init(&next, 0);
#pragma omp parallel if (parallel)
    {
        int64_t j = 0;
        for (;;) {
            int64_t item = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (item >= items) break;
            if (item < up_items) {
                while (first_up[j + 1] <= item) j++;
                while (first_up[j] > item) j--;
                const int64_t c0 = (item - first_up[j]) * GATE_COLS;
                gate_up_item(&jobs[j], x, h, tokens, scale, act, act_stride, c0,
                             min64(c0 + GATE_COLS, jobs[j].inter));
                atomic_fetch_sub_explicit(&up_left[j], 1, memory_order_release);
                continue;
            }
            item -= up_items;
            while (first_down[j + 1] <= item) j++;
            while (first_down[j] > item) j--;
            for (int spins = 1; atomic_load_explicit(&up_left[j], memory_order_acquire) > 0; spins++)
                if (spins % 1024 == 0) sched_yield(); /* let a held-off thread finish it */
            const int64_t c0 = (item - first_down[j]) * DOWN_COLS;
            down_item(&jobs[j], act, act_stride, dout, h, c0, min64(c0 + DOWN_COLS, h));
        }
    }
    for (int64_t i = 0; i < t; i++) {
        float *o = out + i * h;
        if (k > 0)
            memcpy(o, dout + where[i * k] * h, (size_t)h * sizeof(float));
        else
            memset(o, 0, (size_t)h * sizeof(float));
        for (int64_t q = 1; q < k; q++) {
            const float *d = dout + where[i * k + q] * h;
            for (int64_t c = 0; c < h; c++) o[c] += d[c];
        }
        if (shared) {
            const float *d = dout + (pairs + i) * h;
            for (int64_t c = 0; c < h; c++) o[c] += d[c];
        }
    }
    free(first_up);
    free(first_down);
    free((void *)up_left);
done:
    free(counts);
    free(tokens);
    free(where);
    free(scale);
    free(jobs);
    free(act);
    free(dout);
    return code;
}
