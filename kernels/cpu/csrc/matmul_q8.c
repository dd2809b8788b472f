/* y ~ x W^T + b for many rows (a batch's decode step, a prefill chunk) with W in int8, one
 * float32 scale per output row, and x quantized here to int8 per block of 64 values (one
 * scale per block: an outlier costs only its own block), products summed as integers. The
 * arithmetic of matvec.c's linear_q8 (a few rows), laid out for a batch:
 *
 *   y[i, j] = sw[j] * sum over blocks b of sx[i, b] * sum_{k in b}(qx[i, k] qw[j, k]) + bias[j]
 *
 * W comes packed (`pack` in matmul_q8.py): groups of 16 output rows, and within a group
 * for each 4 consecutive k the 16 rows' 4 bytes side by side, so that one 64-byte load holds
 * 16 outputs x 4 products. One input row's 4 bytes broadcast to every lane then give 16
 * outputs' partial sums per instruction (AVX-512 VNNI's dpbusd: 64 products into 16 int32
 * lanes), no horizontal sums. A register tile holds 4 input rows x 64 outputs; each block of
 * 64 k ends with the int32 sums turned to float and scaled by the rows' block scales.
 *
 * dpbusd multiplies unsigned by signed bytes: x is stored as q + 128 and each lane starts
 * from -128 times its weight's sum over the block (`neg`), which takes the 128s back out.
 * Without AVX-512 VNNI the same runs in 256-bit halves of each group, with AVX-VNNI's
 * dpbusd the same way, or with AVX2's maddubs + madd on |x| and w with x's sign (both in
 * -127..127: a pair's sum never saturates 16 bits). Every path sums the same integers and
 * does the same float operations per output, so the outputs are the same to the bit.
 *
 * x [M, K] and y [M, N] are contiguous float32; bias may be NULL; K is a multiple of 64 and
 * N of 16. Threads (OpenMP, the runtime torch uses) split the groups of 64 outputs; a
 * product under `parallel_min_work` multiply-adds runs on the calling thread alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "pool.h"
#include "quantize_q8.h"

/* The process's shared helper threads (`pool.c`), where the caller hands them in: a call
 * then wakes no OpenMP region (pool.c says why). NULL: OpenMP's threads. */
static pool_run_fn shared_pool;

void matmul_q8_use_pool(pool_run_fn run) { shared_pool = run; }

#define QB 64   /* activation block: 16 groups of 4 k */
#define COLS 16 /* outputs per packed group */
#define ROWS 4  /* input rows per register tile */
#define GROUPS 4 /* packed groups per register tile (64 outputs) */

#if defined(__AVX2__) && defined(__FMA__)

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define WIDE 1
#define INT8_DOT 3
#elif defined(__AVXVNNI__)
#define INT8_DOT 2
#else
#define INT8_DOT 1
#endif

/* Which integer dot product the library was built with: 1 AVX2 (maddubs), 2 AVX-VNNI, 3
 * AVX-512 VNNI. */
int matmul_q8_dot(void) { return INT8_DOT; }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* One row of x [k] -> q per block of QB (quantize_q8.h: + 128 where the dot product is
 * VNNI's, signed for AVX2's). */
static void quantize_row(const float *restrict x, int64_t k, uint8_t *restrict q,
                         float *restrict sx) {
    quantize_row_q8(x, k, q, sx, INT8_DOT >= 2);
}

#ifdef WIDE
/* Outputs of packed groups g0 .. g0 + nc - 1 for input rows i0 .. i0 + nr - 1 (nr and nc
 * literals at each call). The loops are unrolled by pragma, not left to the compiler: with
 * sixteen tile shapes in rows_vnni GCC 12 unrolled none of them fully, and the 4 x 4
 * tile's sums went through memory. Unrolled, one thread's 64-row products from L2 on a
 * Zen 5 EPYC: 570 -> 700-745 GOP/s (its dpbusd peak about 900), the same outputs. */
#define UNROLL4 _Pragma("GCC unroll 4")
static inline void tile(const uint8_t *restrict xq, const float *restrict sx, int64_t i0,
                        const int nr, const int8_t *restrict w, const int32_t *restrict neg,
                        int64_t g0, const int nc, int64_t k, __m512 acc[ROWS][GROUPS]) {
    const int64_t nb = k / QB;
    UNROLL4 for (int i = 0; i < nr; i++)
        UNROLL4 for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i sum[ROWS][GROUPS];
        UNROLL4 for (int c = 0; c < nc; c++) {
            const __m512i start = _mm512_loadu_si512(neg + ((g0 + c) * nb + b) * COLS);
            UNROLL4 for (int i = 0; i < nr; i++) sum[i][c] = start;
        }
        const int8_t *wb = w + b * QB * COLS;
#pragma GCC unroll 16
        for (int kq = 0; kq < QB / 4; kq++) {
            __m512i wv[GROUPS];
            UNROLL4 for (int c = 0; c < nc; c++)
                wv[c] = _mm512_loadu_si512(wb + (g0 + c) * k * COLS + kq * 4 * COLS);
            UNROLL4 for (int i = 0; i < nr; i++) {
                int32_t four;
                memcpy(&four, xq + (i0 + i) * k + b * QB + 4 * kq, sizeof four);
                const __m512i xb = _mm512_set1_epi32(four);
                UNROLL4 for (int c = 0; c < nc; c++)
                    sum[i][c] = _mm512_dpbusd_epi32(sum[i][c], xb, wv[c]);
            }
        }
        UNROLL4 for (int i = 0; i < nr; i++) {
            const __m512 s = _mm512_set1_ps(sx[(i0 + i) * nb + b]);
            UNROLL4 for (int c = 0; c < nc; c++)
                acc[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][c]), s, acc[i][c]);
        }
    }
}
#else
/* The same in 256-bit halves of each group (h = 0: outputs 0-7, 1: 8-15). */
static inline __m256i dot256(__m256i acc, __m256i xb, __m256i w) {
#if INT8_DOT == 2
    return _mm256_dpbusd_avx_epi32(acc, xb, w);
#else
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(w, xb));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

static inline void tile(const uint8_t *restrict xq, const float *restrict sx, int64_t i0,
                        const int nr, const int8_t *restrict w, const int32_t *restrict neg,
                        int64_t g0, const int nc, int64_t k, __m256 acc[ROWS][GROUPS][2]) {
    const int64_t nb = k / QB;
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) acc[i][c][0] = acc[i][c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < nc; c++)
            for (int h = 0; h < 2; h++) {
                __m256i sum[ROWS];
#if INT8_DOT == 2
                const __m256i start =
                    _mm256_loadu_si256((const __m256i *)(neg + ((g0 + c) * nb + b) * COLS + 8 * h));
#else
                const __m256i start = _mm256_setzero_si256();
#endif
                for (int i = 0; i < nr; i++) sum[i] = start;
                const int8_t *wb = w + b * QB * COLS + (g0 + c) * k * COLS + 32 * h;
                for (int kq = 0; kq < QB / 4; kq++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(wb + kq * 4 * COLS));
                    for (int i = 0; i < nr; i++) {
                        int32_t four;
                        memcpy(&four, xq + (i0 + i) * k + b * QB + 4 * kq, sizeof four);
                        sum[i] = dot256(sum[i], _mm256_set1_epi32(four), wv);
                    }
                }
                for (int i = 0; i < nr; i++) {
                    const __m256 s = _mm256_set1_ps(sx[(i0 + i) * nb + b]);
                    acc[i][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]), s, acc[i][c][h]);
                }
            }
}
#endif

/* The tile's outputs scaled by the weight scales (+ bias) into y. */
static inline void store_tile(int64_t i0, int nr, int64_t g0, int nc, const float *scales,
                              const float *bias, float *y, int64_t n,
#ifdef WIDE
                              __m512 acc[ROWS][GROUPS]
#else
                              __m256 acc[ROWS][GROUPS][2]
#endif
) {
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nc; c++) {
            const int64_t j = (g0 + c) * COLS;
            float *out = y + (i0 + i) * n + j;
#ifdef WIDE
            const __m512 sw = _mm512_loadu_ps(scales + j);
            _mm512_storeu_ps(out, bias ? _mm512_fmadd_ps(acc[i][c], sw, _mm512_loadu_ps(bias + j))
                                       : _mm512_mul_ps(acc[i][c], sw));
#else
            for (int h = 0; h < 2; h++) {
                const __m256 sw = _mm256_loadu_ps(scales + j + 8 * h);
                _mm256_storeu_ps(out + 8 * h,
                                 bias ? _mm256_fmadd_ps(acc[i][c][h], sw, _mm256_loadu_ps(bias + j + 8 * h))
                                      : _mm256_mul_ps(acc[i][c][h], sw));
            }
#endif
        }
}

/* x quantized row by row into fresh buffers (*xq [m, k], *sx [m, k / QB]); -1 when out of
 * memory. */
static int quantize_rows(const float *x, int64_t m, int64_t k, uint8_t **xq, float **sx) {
    const int64_t nb = k / QB;
    *xq = malloc((size_t)(m * k));
    *sx = malloc((size_t)(m * nb) * sizeof(float));
    if (!*xq || !*sx) {
        free(*xq);
        free(*sx);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) quantize_row(x + i * k, k, *xq + i * k, *sx + i * nb);
    return 0;
}

/* Rows i_from .. m - 1 of the packed groups g0 .. g0 + nc - 1 (nc <= GROUPS) in register
 * tiles of ROWS rows. */
static void rows_vnni(const uint8_t *xq, const float *sx, int64_t i_from, int64_t m,
                      const int8_t *w, const int32_t *neg, const float *scales, int64_t n,
                      const float *bias, float *y, int64_t g0, int nc, int64_t k) {
    for (int64_t i0 = i_from; i0 < m; i0 += ROWS) {
        const int nr = (int)min64(ROWS, m - i0);
#ifdef WIDE
        __m512 acc[ROWS][GROUPS];
#else
        __m256 acc[ROWS][GROUPS][2];
#endif
/* Literal tile sizes: each gets its own unrolled loops. */
#define TILE(r, c) tile(xq, sx, i0, r, w, neg, g0, c, k, acc)
#define COLS_OF(r)                  \
    switch (nc) {                   \
    case 1: TILE(r, 1); break;      \
    case 2: TILE(r, 2); break;      \
    case 3: TILE(r, 3); break;      \
    default: TILE(r, 4); break;     \
    }
        switch (nr) {
        case 1: COLS_OF(1); break;
        case 2: COLS_OF(2); break;
        case 3: COLS_OF(3); break;
        default: COLS_OF(4); break;
        }
#undef COLS_OF
#undef TILE
        store_tile(i0, nr, g0, nc, scales, bias, y, n, acc);
    }
}

typedef struct {
    const uint8_t *xq;
    const float *sx;
    int64_t m, k, n, groups;
    const int8_t *w;
    const int32_t *neg;
    const float *scales, *bias;
    float *y;
} Strips;

/* Strip `item` (outputs 64 item .. 64 item + 63) of every row. */
static void strip_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const Strips *s = ctx;
    const int64_t g0 = item * GROUPS;
    rows_vnni(s->xq, s->sx, 0, s->m, s->w, s->neg, s->scales, s->n, s->bias, s->y, g0,
              (int)min64(GROUPS, s->groups - g0), s->k);
}

/* Returns 0, -1 when out of memory, -2 when K is not a multiple of 64, N of 16 or M < 1. */
int linear_q8_rows(const float *x, int64_t m, int64_t k, const int8_t *w, const int32_t *neg,
                   const float *scales, int64_t n, const float *bias, float *y,
                   int64_t parallel_min_work) {
    if (k % QB != 0 || n % COLS != 0 || m < 1) return -2;
    const int64_t groups = n / COLS;
    uint8_t *xq;
    float *sx;
    if (quantize_rows(x, m, k, &xq, &sx) != 0) return -1;
    const int parallel = m * n * k >= parallel_min_work;
    const Strips strips = {xq, sx, m, k, n, groups, w, neg, scales, bias, y};
    const int64_t items = (groups + GROUPS - 1) / GROUPS;
    if (parallel && pool_took(shared_pool, strip_item, (void *)&strips, items)) {
        free(xq);
        free(sx);
        return 0;
    }
    /* Strips of 64 outputs handed out as threads come free: a few strips a projection
     * (9 for a 576-wide one) split statically left one thread a strip longer, and one
     * preempted by another process (a served system's gateway, scheduler and client share
     * the cores) kept its whole half. Measured on a 2-core Zen 5 EPYC, the 120 projections
     * of a 64-row SmolLM2-135M decode step: 1.07x quiet and 1.085x beside a neighbour busy
     * 2 ms in every 10. */
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
    for (int64_t g0 = 0; g0 < groups; g0 += GROUPS)
        rows_vnni(xq, sx, 0, m, w, neg, scales, n, bias, y, g0, (int)min64(GROUPS, groups - g0), k);
    free(xq);
    free(sx);
    return 0;
}

/* linear_q8_rows for many experts' rows in one call (a MoE layer's routed experts, in the
 * int8 mode). Group g is rows[g] rows of x from row0[g] (rows sorted by expert) against
 * expert expert[g]'s packed weight: the experts' weights packed as one [E N, K] weight
 * (w, neg, scales), whose groups of 16 outputs never straddle two experts (N % 16 == 0),
 * so expert e's is linear_q8_rows's packed weight at e's offsets. Writes the groups' rows
 * of y [R, N]. Items (group, strip of 64 outputs) go to the threads as they come free: one
 * region for the layer's projection, not a call and a wake-up per expert. Each output is
 * linear_q8_rows's on that expert's rows, to the bit. Returns 0, -1 out of memory, -2 K not
 * a multiple of 64 or N of 16. */
typedef struct {
    const uint8_t *xq;
    const float *sx;
    const int64_t *row0, *rows, *expert;
    int64_t k, n, strips;
    const int8_t *w;
    const int32_t *neg;
    const float *scales;
    float *y;
} ExpertStrips;

static void expert_strip(void *ctx, int64_t item, int worker) {
    (void)worker;
    const ExpertStrips *s = ctx;
    const int64_t g = item / s->strips, g0 = (item % s->strips) * GROUPS;
    const int64_t groups = s->n / COLS, nb = s->k / QB, e = s->expert[g], r0 = s->row0[g];
    rows_vnni(s->xq + r0 * s->k, s->sx + r0 * nb, 0, s->rows[g], s->w + e * s->n * s->k,
              s->neg + e * groups * nb * COLS, s->scales + e * s->n, s->n, NULL, s->y + r0 * s->n,
              g0, (int)min64(GROUPS, groups - g0), s->k);
}

int linear_q8_rows_experts(const float *x, const int64_t *row0, const int64_t *rows,
                           const int64_t *expert, int64_t count, int64_t k, const int8_t *w,
                           const int32_t *neg, const float *scales, int64_t n, float *y,
                           int64_t parallel_min_work) {
    if (k % QB != 0 || n % COLS != 0) return -2;
    int64_t total = 0, work = 0;
    for (int64_t g = 0; g < count; g++) {
        total = row0[g] + rows[g] > total ? row0[g] + rows[g] : total;
        work += rows[g] * n * k;
    }
    if (total == 0) return 0;
    uint8_t *xq;
    float *sx;
    if (quantize_rows(x, total, k, &xq, &sx) != 0) return -1;
    const int64_t strips = (n / COLS + GROUPS - 1) / GROUPS;
    const ExpertStrips s = {xq, sx, row0, rows, expert, k, n, strips, w, neg, scales, y};
    const int64_t items = count * strips;
    const int parallel = work >= parallel_min_work;
    if (!(parallel && pool_took(shared_pool, expert_strip, (void *)&s, items))) {
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
        for (int64_t item = 0; item < items; item++) expert_strip((void *)&s, item, 0);
    }
    free(xq);
    free(sx);
    return 0;
}

#include "matmul_q8_amx.h"
#else
int matmul_q8_dot(void) { return 0; }
#endif

#ifndef HAVE_AMX
/* Not built with AMX: the Python side never calls these (matmul_q8_amx() says so). */
int matmul_q8_amx(void) { return 0; }
int matmul_q8_amx_init(void) { return -1; }
int linear_q8_rows_amx(const float *x, int64_t m, int64_t k, const int8_t *w, const int32_t *neg,
                       const float *scales, int64_t n, const float *bias, float *y,
                       int64_t parallel_min_work) {
    (void)x, (void)m, (void)k, (void)w, (void)neg, (void)scales, (void)n, (void)bias, (void)y;
    (void)parallel_min_work;
    return -4;
}
#endif

#if !(defined(__AVX2__) && defined(__FMA__))

int linear_q8_rows(const float *x, int64_t m, int64_t k, const int8_t *w, const int32_t *neg,
                   const float *scales, int64_t n, const float *bias, float *y,
                   int64_t parallel_min_work) {
    (void)x, (void)m, (void)k, (void)w, (void)neg, (void)scales, (void)n, (void)bias, (void)y;
    (void)parallel_min_work;
    return -4; /* not built with AVX2 and FMA */
}

int linear_q8_rows_experts(const float *x, const int64_t *row0, const int64_t *rows,
                           const int64_t *expert, int64_t count, int64_t k, const int8_t *w,
                           const int32_t *neg, const float *scales, int64_t n, float *y,
                           int64_t parallel_min_work) {
    (void)x, (void)row0, (void)rows, (void)expert, (void)count, (void)k, (void)w, (void)neg;
    (void)scales, (void)n, (void)y, (void)parallel_min_work;
    return -4;
}
#endif
