/* Projections of a few rows (y = x W^T + b) for small decode steps (CPU).
 *
 * At one to a few rows a projection is a weight stream: every weight is read once and used
 * once per row, so its time is the weight bytes over memory bandwidth, and oneDNN's and
 * fbgemm's kernels (built for many rows) leave some of that bandwidth unused. These loops
 * stream W in order, four output rows at a time (four independent accumulators hide the
 * FMA latency), and split the output rows between the OpenMP threads. Two weight forms:
 *
 *   linear_f32: float32 W [N, K] (AVX-512F, or AVX2 with FMA);
 *   linear_q8:  int8 W [N, K], one float32 scale per output row, and x quantized here to
 *               8 bits per block of QB values (one scale per block, like llama.cpp's Q8_0:
 *               an outlier costs only its own block the precision that one scale per row
 *               loses). With AVX-512 VNNI (u8 x s8 -> s32) x is stored as q + 128 (VNNI
 *               wants one unsigned operand) and wsum, each block's weight sum per output
 *               row, takes the 128s back out. With AVX2 alone x stays signed and each
 *               product is |x| * (w with x's sign) (maddubs, u8 x s8 -> s16 pairs): both
 *               sides lie in -127..127, so a pair's sum (at most 2 * 127 * 127) never
 *               saturates 16 bits, and wsum goes unused. Both give the same integer dots.
 *   linear_blocks_f32, linear_blocks_q8: W in the model file's own blocks (GGUF Q4_1,
 *               Q8_0 here, the other types in matvec_blocks_more.h and
 *               matvec_integer_more.h), turned into float32 in registers, or read with
 *               integer products against x quantized per block of 32 (see each below).
 *
 * x [M, K] and y [M, N] are contiguous float32; bias may be NULL. A projection under
 * `parallel_min_bytes` of weights runs on the calling thread alone: waking a sleeping
 * OpenMP thread (passive wait policy) costs more than it saves on a small one.
 * Built only where the CPU has the instructions; `matvec_features` says what is fast.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "pool.h"
#include "quantize_q8.h"

/* The process's shared helper threads, where the caller hands them in (`pool.c`): the
 * panel kernel's many-row products then open no OpenMP region. NULL: OpenMP's threads. */
static pool_run_fn shared_pool;

void matvec_use_pool(pool_run_fn run) { shared_pool = run; }

#define QB 64
/* Output rows per OpenMP chunk: a multiple of 4 (the inner blocking), large enough that
 * scheduling costs nothing against the chunk's bytes. */
#define CHUNK 64

enum { HAS_F32 = 1, HAS_Q8 = 2, HAS_BLOCKS = 4, HAS_BLOCKS_Q8 = 8, HAS_DEQUANT = 16,
       HAS_BLOCKS_X16 = 32, HAS_BLOCKS_X8 = 64, HAS_BLOCKS_ROWS = 128 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_VNNI 1
#elif defined(__AVX2__)
#define Q8_AVX2 1
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define F32_SIMD 1
#endif

int matvec_features(void) {
    int f = HAS_DEQUANT; /* plain C: dequantize_rows, linear_dequant_f32 */
#ifdef F32_SIMD
    f |= HAS_F32;
#endif
#if defined(Q8_VNNI) || defined(Q8_AVX2)
    f |= HAS_Q8;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    f |= HAS_BLOCKS | HAS_BLOCKS_Q8;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    f |= HAS_BLOCKS_ROWS; /* linear_blocks_rows (blocks_gemm.h) */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__) && defined(__F16C__) && defined(__FMA__)
    f |= HAS_BLOCKS_X16; /* BLOCKS_X16 below: the same conditions */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    f |= HAS_BLOCKS_X8; /* BLOCKS_X8 below */
#endif
    return f;
}

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The same 64 bytes of the next four output rows, fetched while this four's are used (int8
 * rows are only a few hundred bytes, each a new stream for the hardware prefetcher).
 * Measured on the 2-core Xeon, SmolLM2-135M's 121 projections as int8 (weights streamed
 * from memory, same results): 20.8 -> 15.3 ms; float32 rows, four times longer, gained
 * nothing (48.5 ms either way), so they go without. Prefetches never fault, so the last
 * rows may point past the weight. */
#define prefetch_next_rows(p, k)                                                   \
    do {                                                                           \
        _mm_prefetch((const char *)((p) + 4 * (k)), _MM_HINT_T0);                  \
        _mm_prefetch((const char *)((p) + 5 * (k)), _MM_HINT_T0);                  \
        _mm_prefetch((const char *)((p) + 6 * (k)), _MM_HINT_T0);                  \
        _mm_prefetch((const char *)((p) + 7 * (k)), _MM_HINT_T0);                  \
    } while (0)

/* The weight loads of linear_f32's loops, one per element type: float32 W as it is, and
 * F16 / BF16 W (GGUF files' 16-bit tensors, kept so in memory) widened to float32 in
 * registers. Widening is exact, and the loops below are one text for all three (instances
 * of DEFINE_LINEAR), so a 16-bit weight's outputs are the float32 weight's to the bit. */
static inline float load1_f32(const float *w, int64_t i) { return w[i]; }
/* s + a w of the scalar tails: one rounding (fused) where the CPU fuses, two where it
 * cannot, written out, so that the compiler's choice to contract (which differed between
 * the element types' copies of one loop) never decides the outputs. */
static inline float madd(float a, float w, float s) {
#if defined(__FMA__) || defined(__AVX512F__)
    return fmaf(a, w, s);
#else
    return s + a * w;
#endif
}
static inline float load1_bf16(const uint16_t *w, int64_t i) {
    const uint32_t bits = (uint32_t)w[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#ifdef __AVX512F__
static inline __m512 loadv_f32(const float *w, int64_t i) { return _mm512_loadu_ps(w + i); }
static inline __m512 loadv_bf16(const uint16_t *w, int64_t i) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#ifdef __F16C__
static inline __m512 loadv_f16(const uint16_t *w, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
}
#endif
#elif defined(F32_SIMD)
static inline __m256 loadv_f32(const float *w, int64_t i) { return _mm256_loadu_ps(w + i); }
static inline __m256 loadv_bf16(const uint16_t *w, int64_t i) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#ifdef __F16C__
static inline __m256 loadv_f16(const uint16_t *w, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
}
#endif
#endif
#ifdef __F16C__
static inline float load1_f16(const uint16_t *w, int64_t i) { return _cvtsh_ss(w[i]); }
#endif

#ifdef __AVX512F__
/* Output rows j..j+3 of one input row a. */
#define DEFINE_DOT4(T, WT)                                                                 \
    static inline void dot4_##T(const float *restrict a, const WT *restrict w, int64_t k, \
                                float *restrict out) {                                     \
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                        \
        int64_t i = 0;                                                                     \
        for (; i + 16 <= k; i += 16) {                                                     \
            const __m512 av = _mm512_loadu_ps(a + i);                                      \
            c0 = _mm512_fmadd_ps(av, loadv_##T(w, i), c0);                                 \
            c1 = _mm512_fmadd_ps(av, loadv_##T(w, k + i), c1);                             \
            c2 = _mm512_fmadd_ps(av, loadv_##T(w, 2 * k + i), c2);                         \
            c3 = _mm512_fmadd_ps(av, loadv_##T(w, 3 * k + i), c3);                         \
        }                                                                                  \
        float s[4] = {_mm512_reduce_add_ps(c0), _mm512_reduce_add_ps(c1),                  \
                      _mm512_reduce_add_ps(c2), _mm512_reduce_add_ps(c3)};                 \
        for (; i < k; i++)                                                                 \
            for (int r = 0; r < 4; r++) s[r] = madd(a[i], load1_##T(w, r * k + i), s[r]); \
        for (int r = 0; r < 4; r++) out[r] = s[r];                                         \
    }
#elif defined(F32_SIMD)
/* The same with 8-wide vectors (AVX2 + FMA). */
#define DEFINE_DOT4(T, WT)                                                                 \
    static inline void dot4_##T(const float *restrict a, const WT *restrict w, int64_t k, \
                                float *restrict out) {                                     \
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;                        \
        int64_t i = 0;                                                                     \
        for (; i + 8 <= k; i += 8) {                                                       \
            const __m256 av = _mm256_loadu_ps(a + i);                                      \
            c0 = _mm256_fmadd_ps(av, loadv_##T(w, i), c0);                                 \
            c1 = _mm256_fmadd_ps(av, loadv_##T(w, k + i), c1);                             \
            c2 = _mm256_fmadd_ps(av, loadv_##T(w, 2 * k + i), c2);                         \
            c3 = _mm256_fmadd_ps(av, loadv_##T(w, 3 * k + i), c3);                         \
        }                                                                                  \
        float s[4] = {hsum256(c0), hsum256(c1), hsum256(c2), hsum256(c3)};                 \
        for (; i < k; i++)                                                                 \
            for (int r = 0; r < 4; r++) s[r] = madd(a[i], load1_##T(w, r * k + i), s[r]); \
        for (int r = 0; r < 4; r++) out[r] = s[r];                                         \
    }
#endif

#define DEFINE_DOT(T, WT)                                                                  \
    static inline float dot_##T(const float *restrict a, const WT *restrict w, int64_t k) { \
        float s = 0.0f;                                                                    \
        for (int64_t i = 0; i < k; i++) s = madd(a[i], load1_##T(w, i), s);                \
        return s;                                                                          \
    }

#ifdef F32_SIMD
#define DOT4_GROUPS(T) for (; j + 4 <= n1; j += 4) dot4_##T(a, w + j * k, k, out + j);
#else
#define DOT4_GROUPS(T)
#endif

/* y = x W^T + b for W of element type WT; `bytes` per weight decide the split. */
#define DEFINE_LINEAR(T, WT, RET)                                                          \
    RET linear_##T(const float *x, int64_t m, int64_t k, const WT *w, int64_t n,           \
                   const float *bias, float *y, int64_t parallel_min_bytes) {              \
        const int parallel = n * k * (int64_t)sizeof(WT) >= parallel_min_bytes;           \
        _Pragma("omp parallel for schedule(static) if (parallel)")                         \
        for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {                                        \
            const int64_t n1 = min64(n0 + CHUNK, n);                                       \
            for (int64_t row = 0; row < m; row++) {                                        \
                const float *a = x + row * k;                                              \
                float *out = y + row * n;                                                  \
                int64_t j = n0;                                                            \
                DOT4_GROUPS(T)                                                             \
                for (; j < n1; j++) out[j] = dot_##T(a, w + j * k, k);                     \
                if (bias)                                                                  \
                    for (j = n0; j < n1; j++) out[j] += bias[j];                           \
            }                                                                              \
        }                                                                                  \
    }

#ifdef F32_SIMD
DEFINE_DOT4(f32, float)
#endif
DEFINE_DOT(f32, float)
DEFINE_LINEAR(f32, float, void)

#if defined(Q8_VNNI) || defined(Q8_AVX2)
/* One row of x -> q per block of QB (quantize_q8.h: stored + 128 for VNNI), scale
 * amax / 127 per block (round to nearest even). */
#ifdef Q8_VNNI
#define X_OFFSET 128
#else
#define X_OFFSET 0
#endif
static void quantize_row(const float *x, int64_t k, uint8_t *xu, float *sx) {
    quantize_row_q8(x, k, xu, sx, X_OFFSET != 0);
}

#ifdef Q8_VNNI
/* Output rows j..j+3 (unscaled) of one quantized input row: per block, the 64 products go
 * into 16 int32 lanes, which are scaled by the block's x scale into float accumulators. */
static inline void dot4_q8(const uint8_t *restrict xu, const float *restrict sx,
                           const int8_t *restrict w, const float *restrict wsum, int64_t k,
                           float *restrict out) {
    const int64_t nb = k / QB;
    const __m512i z = _mm512_setzero_si512();
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int64_t b = 0; b < nb; b++) {
        const __m512i xv = _mm512_loadu_si512(xu + b * QB);
        const __m512 s = _mm512_set1_ps(sx[b]);
        const int8_t *wb = w + b * QB;
        prefetch_next_rows(wb, k);
#define BLOCK(f, r) \
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, xv, _mm512_loadu_si512(wb + (r) * k))), s, f)
        BLOCK(f0, 0);
        BLOCK(f1, 1);
        BLOCK(f2, 2);
        BLOCK(f3, 3);
#undef BLOCK
    }
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < 4; r++)
        for (int64_t b = 0; b < nb; b++) c[r] += sx[b] * wsum[r * nb + b];
    out[0] = _mm512_reduce_add_ps(f0) - 128.0f * c[0];
    out[1] = _mm512_reduce_add_ps(f1) - 128.0f * c[1];
    out[2] = _mm512_reduce_add_ps(f2) - 128.0f * c[2];
    out[3] = _mm512_reduce_add_ps(f3) - 128.0f * c[3];
}
#endif

#ifdef Q8_AVX2
/* The same with AVX2 alone (x signed, wsum unused): per block, two 32-byte halves, each
 * |x| * sign(w, x) summed in 16-bit pairs (maddubs), then in 32-bit lanes (madd); the halves
 * are added as 32 bits, where two 16-bit sums could overflow. */
static inline void dot4_q8(const uint8_t *restrict xu, const float *restrict sx,
                           const int8_t *restrict w, const float *restrict wsum, int64_t k,
                           float *restrict out) {
    (void)wsum;
    const int64_t nb = k / QB;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xu + b * QB));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xu + b * QB + 32));
        const __m256i a0 = _mm256_sign_epi8(x0, x0), a1 = _mm256_sign_epi8(x1, x1);
        const __m256 s = _mm256_set1_ps(sx[b]);
        const int8_t *wb = w + b * QB;
        prefetch_next_rows(wb, k);
#define HALF(a, x, p) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(p)), x)), ones)
#define BLOCK(f, r)                                                                     \
    f = _mm256_fmadd_ps(                                                                \
        _mm256_cvtepi32_ps(_mm256_add_epi32(HALF(a0, x0, wb + (r) * k), HALF(a1, x1, wb + (r) * k + 32))), \
        s, f)
        BLOCK(f0, 0);
        BLOCK(f1, 1);
        BLOCK(f2, 2);
        BLOCK(f3, 3);
#undef BLOCK
#undef HALF
    }
    out[0] = hsum256(f0);
    out[1] = hsum256(f1);
    out[2] = hsum256(f2);
    out[3] = hsum256(f3);
}
#endif

/* Returns 0, -1 when out of memory, -2 when K or N is not a multiple of QB or 4. */
int linear_q8(const float *x, int64_t m, int64_t k, const int8_t *w, const float *scales,
              const float *wsum, int64_t n, const float *bias, float *y,
              int64_t parallel_min_bytes) {
    if (k % QB != 0 || n % 4 != 0) return -2;
    const int64_t nb = k / QB;
    uint8_t *xu = malloc((size_t)(m * k));
    float *sx = malloc((size_t)(m * nb) * sizeof(float));
    if (!xu || !sx) {
        free(xu);
        free(sx);
        return -1;
    }
    for (int64_t row = 0; row < m; row++)
        quantize_row(x + row * k, k, xu + row * k, sx + row * nb);
    const int parallel = n * k >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
        const int64_t n1 = min64(n0 + CHUNK, n);
        for (int64_t row = 0; row < m; row++) {
            float *out = y + row * n;
            for (int64_t j = n0; j < n1; j += 4)
                dot4_q8(xu + row * k, sx + row * nb, w + j * k, wsum + j * nb, k, out + j);
            for (int64_t j = n0; j < n1; j++)
                out[j] = out[j] * scales[j] + (bias ? bias[j] : 0.0f);
        }
    }
    free(xu);
    free(sx);
    return 0;
}

/* linear_q8_experts: linear_q8's product for many experts' rows in one call (a MoE layer's
 * routed experts at a decode step: a few rows each, most experts). Group g is rows[g] rows
 * of x from row0[g] (rows sorted by expert) against expert expert[g]'s int8 weight, at
 * w + expert[g] * n * k (a stack [E, N, K], scales [E, N], wsum [E, N, K / QB]), into the
 * same rows of y [R, N]. Every row is quantized once; then the items (group, CHUNK outputs)
 * go to the threads as they come free, one region for the layer's projection instead of a
 * call and a thread wake-up per expert. Each output is linear_q8's sum in linear_q8's
 * order: the same values. Returns 0, -1 out of memory, -2 K or N not a multiple of QB or 4. */
typedef struct {
    const uint8_t *xu;
    const float *sx;
    const int64_t *row0, *rows, *expert;
    const int8_t *w;
    const float *scales, *wsum;
    int64_t k, n, chunks;
    float *y;
} ExpertItems;

static void expert_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const ExpertItems *e = ctx;
    const int64_t g = item / e->chunks, n0 = (item % e->chunks) * CHUNK;
    const int64_t n1 = min64(n0 + CHUNK, e->n), k = e->k, nb = k / QB, n = e->n;
    const int64_t x0 = e->expert[g];
    const int8_t *w = e->w + x0 * n * k;
    const float *scales = e->scales + x0 * n, *wsum = e->wsum + x0 * n * nb;
    for (int64_t row = e->row0[g]; row < e->row0[g] + e->rows[g]; row++) {
        float *out = e->y + row * n;
        for (int64_t j = n0; j < n1; j += 4)
            dot4_q8(e->xu + row * k, e->sx + row * nb, w + j * k, wsum + j * nb, k, out + j);
        for (int64_t j = n0; j < n1; j++) out[j] = out[j] * scales[j] + 0.0f; /* linear_q8's */
    }
}

int linear_q8_experts(const float *x, const int64_t *row0, const int64_t *rows,
                      const int64_t *expert, int64_t groups, int64_t k, const int8_t *w,
                      const float *scales, const float *wsum, int64_t n, float *y,
                      int64_t parallel_min_bytes) {
    if (k % QB != 0 || n % 4 != 0) return -2;
    const int64_t nb = k / QB;
    int64_t total = 0;
    for (int64_t g = 0; g < groups; g++) total = row0[g] + rows[g] > total ? row0[g] + rows[g] : total;
    uint8_t *xu = malloc((size_t)(total * k) + 1);
    float *sx = malloc((size_t)(total * nb) * sizeof(float) + 1);
    if (!xu || !sx) {
        free(xu);
        free(sx);
        return -1;
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t row = row0[g]; row < row0[g] + rows[g]; row++)
            quantize_row(x + row * k, k, xu + row * k, sx + row * nb);
    ExpertItems e = {xu, sx, row0, rows, expert, w, scales, wsum, k, n, (n + CHUNK - 1) / CHUNK, y};
    const int64_t items = groups * e.chunks;
    const int parallel = groups * n * k >= parallel_min_bytes;
    if (!(parallel && pool_took(shared_pool, expert_item, (void *)&e, items))) {
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
        for (int64_t item = 0; item < items; item++) expert_item((void *)&e, item, 0);
    }
    free(xu);
    free(sx);
    return 0;
}
#else
int linear_q8(const float *x, int64_t m, int64_t k, const int8_t *w, const float *scales,
              const float *wsum, int64_t n, const float *bias, float *y,
              int64_t parallel_min_bytes) {
    (void)x, (void)m, (void)k, (void)w, (void)scales, (void)wsum, (void)n, (void)bias, (void)y;
    (void)parallel_min_bytes;
    return -3; /* not built with VNNI or AVX2: matvec_features() says so */
}

int linear_q8_experts(const float *x, const int64_t *row0, const int64_t *rows,
                      const int64_t *expert, int64_t groups, int64_t k, const int8_t *w,
                      const float *scales, const float *wsum, int64_t n, float *y,
                      int64_t parallel_min_bytes) {
    (void)x, (void)row0, (void)rows, (void)expert, (void)groups, (void)k, (void)w, (void)scales;
    (void)wsum, (void)n, (void)y, (void)parallel_min_bytes;
    return -3;
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* linear_blocks_f32: y = x W^T + b with W read in the model file's own blocks of 32 (GGUF
 * Q4_1: f16 d, f16 m, 16 bytes of nibbles, w = d q + m; Q8_0: f16 d, 32 int8, w = d q)
 * and turned into float32 in registers. d q is exact in float32 (an 11-bit mantissa times a
 * small integer), so each weight rounds once, as the loader's dequantization rounds it:
 * the weights are the float32 model's to the bit, and with the same order of products
 * (16 lanes with AVX-512, else 8; k in order, then the lanes' sum, as dot4_f32 does) so
 * are the outputs. A one-row step reads 0.625 (Q4_1) or 1.06 (Q8_0) bytes per weight
 * instead of 4. Measured on a loaded AVX-512 EPYC, one thread, CPU time of 32 of
 * SmolLM2's Q4_1 projections: 8-lane loop 2.24 ms, 16-lane 1.88 (the integer path 1.98). */
enum { BLOCK_Q4_1 = 0, BLOCK_Q8_0 = 1 };
/* The other block types (matvec_blocks_more.h reads them; Q5_0's one-row loop is
 * dot4_blocks's below). */
enum { BLOCK_Q4_0 = 2, BLOCK_Q5_0 = 3, BLOCK_Q5_1 = 4, BLOCK_Q4_K = 5, BLOCK_Q5_K = 6, BLOCK_Q6_K = 7 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* The 32 weights of one block as four 8-lane vectors, in k order. */
static inline void block_weights(const uint8_t *blk, int type, __m256 w[4]) {
    if (type == BLOCK_Q4_1) {
        uint32_t dm; /* d and m converted together */
        memcpy(&dm, blk, sizeof dm);
        const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        const __m256 d = _mm256_broadcastss_ps(dmf);
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dmf));
        /* Bytes 0-7 and 8-15 widened to 32 bits each: their low nibbles are values 0-15,
         * their high nibbles values 16-31. */
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 12)));
        const __m256i nibble = _mm256_set1_epi32(0x0F);
        const __m256i parts[4] = {_mm256_and_si256(b0, nibble), _mm256_and_si256(b1, nibble),
                                  _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(parts[i]), m);
    } else if (type == BLOCK_Q5_0) {
        /* w = d (q - 16): an f16 times a 5-bit integer, exact in float32 (no rounding) */
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        uint32_t qh;
        memcpy(&qh, blk + 2, sizeof qh);
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 6)));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 14)));
        const __m256i nibble = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
        const __m256i parts[4] = {_mm256_and_si256(b0, nibble), _mm256_and_si256(b1, nibble),
                                  _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
        const __m256i h = _mm256_set1_epi32((int)qh);
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for (int i = 0; i < 4; i++) { /* value 8 i + l's fifth bit: bit 8 i + l of qh */
            const __m256i bit = _mm256_and_si256(
                _mm256_srlv_epi32(h, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i))), one);
            const __m256i q = _mm256_or_si256(parts[i], _mm256_slli_epi32(bit, 4));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))));
        }
    } else {
        const __m256 d = _mm256_set1_ps(half_to_float(blk));
        for (int i = 0; i < 4; i++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
    }
}

#ifdef __AVX512F__
static inline __m512 iota16(float from) {
    return _mm512_add_ps(_mm512_set1_ps(from),
                         _mm512_setr_ps(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, 8.0f,
                                        9.0f, 10.0f, 11.0f, 12.0f, 13.0f, 14.0f, 15.0f));
}

/* Q4_1's 16 possible weights of one block, fma(d, q, m) for q = 0..15: the rounding
 * block_weights makes per weight, made once per block. A nibble then picks its weight with
 * one vpermps, which reads only the low 4 bits of each index lane: a byte widened to 32
 * bits indexes by its low nibble as it is, and shifted right by 4 by its high one. */
static inline __m512 q4_1_table(__m512 d, __m512 m) {
    return _mm512_fmadd_ps(d, iota16(0.0f), m);
}

/* A 16-bit mask straight from memory (a load): the intrinsic compiles to a load into a
 * general register and a move to the mask register, which takes the shuffle port the
 * permutes need. */
static inline __mmask16 load_mask16(const uint8_t *p) {
    __mmask16 k;
    __asm__("kmovw %1, %0" : "=k"(k) : "m"(*(const uint16_t *)p));
    return k;
}

/* The 32 weights of one block as two 16-lane vectors, in k order (the same values as
 * block_weights: each weight rounds once, in the fused d q + m). */
static inline void block_weights16(const uint8_t *blk, int type, __m512 w[2]) {
    if (type == BLOCK_Q4_1) {
        uint32_t dm;
        memcpy(&dm, blk, sizeof dm);
        const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        const __m512 lut = q4_1_table(_mm512_broadcastss_ps(dmf),
                                      _mm512_broadcastss_ps(_mm_movehdup_ps(dmf)));
        /* the 16 bytes widened: low nibbles are values 0-15, high nibbles 16-31 */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4)));
        w[0] = _mm512_permutexvar_ps(b, lut);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    } else {
        const __m512 d = _mm512_set1_ps(half_to_float(blk));
        for (int i = 0; i < 2; i++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i));
            w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        }
    }
}

/* Blocks whose scales (and Q4_1's minimums) dot4_blocks converts ahead, per output row. */
#define SCALE_RUN 32
/* How far ahead dot4_blocks fetches: the same block of the row this many rows on (three
 * groups of four). Measured on the 2-core Xeon, one thread, SmolLM2's 30 gate_up
 * projections streamed from memory: 4.5-4.9 ms at 4 rows (the next group), 3.6-4.3 at
 * 8-24; its Q8_0 lm_head 2.1-2.6 ms at 4, 1.8 at 12 or more. */
#define PREFETCH_ROWS 12

/* The f16 scales of four rows' blocks b0..b0+count (count <= SCALE_RUN) as float32:
 * for Q4_1 d and m of block j at out[r][2j], out[r][2j + 1]; for Q8_0 (and any block of
 * `block_bytes` that starts with its d: Q5_0) d at out[r][j]. Converted 16 at a time
 * from a copy of the halves, so that the dot loop broadcasts them from memory (load
 * ports) instead of converting and broadcasting each in the vector ports its products
 * need. */
static inline void block_scales(const uint8_t *restrict w, int64_t row_bytes, int64_t b0,
                                int64_t count, int type, int64_t block_bytes,
                                float out[4][2 * SCALE_RUN]) {
    for (int r = 0; r < 4; r++) {
        if (type == BLOCK_Q4_1) {
            uint32_t h[SCALE_RUN] __attribute__((aligned(64))) = {0}; /* d, m: two halves */
            const uint8_t *blk = w + r * row_bytes + b0 * 20;
            for (int64_t j = 0; j < count; j++) memcpy(h + j, blk + 20 * j, 4);
            _mm512_store_ps(out[r], _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)h)));
            for (int i = 8; i < SCALE_RUN; i += 8)
                _mm512_store_ps(out[r] + 2 * i,
                                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(h + i))));
        } else {
            uint16_t h[SCALE_RUN] __attribute__((aligned(32))) = {0};
            const uint8_t *blk = w + r * row_bytes + b0 * block_bytes;
            for (int64_t j = 0; j < count; j++) memcpy(h + j, blk + block_bytes * j, 2);
            for (int i = 0; i < SCALE_RUN; i += 16)
                _mm512_store_ps(out[r] + i,
                                _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(h + i))));
        }
    }
}

/* Block b's 32 weights of one output row in two 16-lane vectors, in k order, from its
 * scales as block_scales left them (the row's `scales`, block b at j): Q4_1's from the
 * block's 16-entry table (q4_1_table), Q8_0's as d q. Q5_0's (w = d (q - 16), q 5 bits)
 * from a 16-entry table d (q - 16) for q = 0..15, the fifth bit added as 16 d under a mask
 * loaded from qh: d (q - 16) + 16 d is d q exactly (each a multiple of d by an integer
 * under 2^5, exact in float32), so each weight is gguf-py's d (q + 16 - 16) to the bit (a
 * zero may come out +0 where it gives -0, which no sum tells apart: the accumulators
 * start at +0). */
static inline void scaled_weights(const uint8_t *restrict blk, const int type,
                                  const float *restrict scales, int64_t j, __m512 v[2]) {
    if (type == BLOCK_Q4_1) {
        const __m512 lut =
            q4_1_table(_mm512_set1_ps(scales[2 * j]), _mm512_set1_ps(scales[2 * j + 1]));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4)));
        v[0] = _mm512_permutexvar_ps(q, lut);
        v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
    } else if (type == BLOCK_Q8_0) {
        const __m512 d = _mm512_set1_ps(scales[j]);
        for (int i = 0; i < 2; i++)
            v[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * i)))));
    } else { /* Q5_0: f16 d, qh, 16 bytes of nibbles (block_scales puts 16 d at SCALE_RUN on) */
        const __m512 lut = _mm512_mul_ps(_mm512_set1_ps(scales[j]), iota16(-16.0f));
        const __m512 d16 = _mm512_set1_ps(scales[SCALE_RUN + j]);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 6)));
        const __m512 w0 = _mm512_permutexvar_ps(q, lut);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
        v[0] = _mm512_mask_add_ps(w0, load_mask16(blk + 2), w0, d16);
        v[1] = _mm512_mask_add_ps(w1, load_mask16(blk + 4), w1, d16);
    }
}

/* Output rows j..j+3 of one input row a in 16-lane vectors, per block: a0 (the first 16 of
 * its 32 inputs) times the first 16 weights, then a1 times the last 16, into one
 * accumulator per output; the lanes' sum at the end. The weights come from
 * scaled_weights, the scales from block_scales. The loop is bound by its vector
 * instructions (the conversions, not the bytes): per Q4_1 block and output row one FMA
 * for the table, a widening, a shift, two permutes and the two product FMAs (7), where
 * converting each weight and its scales in place took 15. Measured on the 2-core Xeon,
 * one thread, CPU time, SmolLM2's 30 gate_up projections from cache: 2.36 -> 1.75 ns a
 * block and row; all 121 projections of a step from memory 11.8 -> 9.0 ms. Q5_0 adds two
 * masked adds (three shuffle-port instructions a block and row, where a 32-entry table's
 * loop, as Q5_1's, took six: a scale broadcast from a register and two index vectors
 * built from qh): the 166 Q5_0 projections of SmolLM2's Q4_K_M file 11.2 -> 7.3 ms.
 * Called with a literal type, so that each type gets its own loop. */
static inline void dot4_blocks(const float *restrict a, const uint8_t *restrict w,
                               int64_t row_bytes, int64_t nb, int64_t block_bytes,
                               const int type, float *restrict out) {
    __m512 c[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    float scales[4][2 * SCALE_RUN] __attribute__((aligned(64)));
    for (int64_t b0 = 0; b0 < nb; b0 += SCALE_RUN) {
        const int64_t count = min64(SCALE_RUN, nb - b0);
        block_scales(w, row_bytes, b0, count, type, block_bytes, scales);
        if (type == BLOCK_Q5_0) /* 16 d beside each d */
            for (int r = 0; r < 4; r++)
                for (int i = 0; i < SCALE_RUN; i += 16)
                    _mm512_store_ps(scales[r] + SCALE_RUN + i,
                                    _mm512_mul_ps(_mm512_load_ps(scales[r] + i), _mm512_set1_ps(16.0f)));
        for (int64_t j = 0; j < count; j++) {
            const int64_t b = b0 + j;
            const __m512 a0 = _mm512_loadu_ps(a + 32 * b), a1 = _mm512_loadu_ps(a + 32 * b + 16);
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = w + r * row_bytes + b * block_bytes;
                _mm_prefetch((const char *)(blk + PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
                __m512 v[2];
                scaled_weights(blk, type, scales[r], j, v);
                c[r] = _mm512_fmadd_ps(a0, v[0], c[r]);
                c[r] = _mm512_fmadd_ps(a1, v[1], c[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) out[r] = _mm512_reduce_add_ps(c[r]);
}

/* Output rows j..j+R-1 of m input rows (R * m <= 16 accumulators), each weight block
 * turned into float32 once for all m rows: a verify step's few positions of one sequence
 * cost about one row's conversions, not m. Each (output, input) pair is summed exactly as
 * dot4_blocks sums it (per block a0 v0 then a1 v1 into one 16-lane accumulator, the
 * lanes' sum at the end), so every row's outputs are the one-row call's to the bit.
 * Called with literal R and m, and the loops unrolled by pragma so that the accumulators
 * stay in registers: left to GCC 12 (some twenty R, m pairs) they were not, and the sums
 * went through memory. Unrolled, one thread, a 576 x 3072 Q4_1 weight from L2 on a Zen 5
 * EPYC: 2 rows 158 -> 82-91 us, 4 rows 277 -> 146-197, 8 rows 296 -> 246-258, the same
 * outputs. */
static inline void dot_rows_blocks(const float *restrict x, int64_t k,
                                   const uint8_t *restrict w, int64_t row_bytes, int64_t nb,
                                   int64_t block_bytes, int type, const int R, const int m,
                                   int64_t n, float *restrict out) {
    __m512 c[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < m; i++) c[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * row_bytes + b * block_bytes;
            _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
            __m512 v[2];
            block_weights16(blk, type, v);
#pragma GCC unroll 8
            for (int i = 0; i < m; i++) {
                const float *a = x + i * k + 32 * b;
                c[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(a), v[0], c[r][i]);
                c[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16), v[1], c[r][i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < m; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) out[i * n + r] = _mm512_reduce_add_ps(c[r][i]);
}
#else
/* Output rows j..j+3 of one input row a; row r's blocks start at w + r * row_bytes. */
static inline void dot4_blocks(const float *restrict a, const uint8_t *restrict w,
                               int64_t row_bytes, int64_t nb, int64_t block_bytes, int type,
                               float *restrict out) {
    __m256 c[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256 a0 = _mm256_loadu_ps(a + 32 * b), a1 = _mm256_loadu_ps(a + 32 * b + 8);
        const __m256 a2 = _mm256_loadu_ps(a + 32 * b + 16), a3 = _mm256_loadu_ps(a + 32 * b + 24);
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * row_bytes + b * block_bytes;
            _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
            __m256 v[4];
            block_weights(blk, type, v);
            c[r] = _mm256_fmadd_ps(a0, v[0], c[r]);
            c[r] = _mm256_fmadd_ps(a1, v[1], c[r]);
            c[r] = _mm256_fmadd_ps(a2, v[2], c[r]);
            c[r] = _mm256_fmadd_ps(a3, v[3], c[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum256(c[r]);
}

/* dot_rows_blocks with 8-lane vectors (sixteen registers: R * m <= 8 accumulators), each
 * pair summed as this dot4_blocks sums it. */
static inline void dot_rows_blocks(const float *restrict x, int64_t k,
                                   const uint8_t *restrict w, int64_t row_bytes, int64_t nb,
                                   int64_t block_bytes, int type, const int R, const int m,
                                   int64_t n, float *restrict out) {
    __m256 c[4][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < m; i++) c[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * row_bytes + b * block_bytes;
            _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
            __m256 v[4];
            block_weights(blk, type, v);
            for (int i = 0; i < m; i++) {
                const float *a = x + i * k + 32 * b;
                c[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(a), v[0], c[r][i]);
                c[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), v[1], c[r][i]);
                c[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 16), v[2], c[r][i]);
                c[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + 24), v[3], c[r][i]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < R; r++) out[i * n + r] = hsum256(c[r][i]);
}
#endif

/* Accumulator registers dot_rows_blocks may use: output rows per pass R for m input rows
 * is the most of 4, 2, 1 with R * m within them. */
#ifdef __AVX512F__
#define ROW_PAIRS 16
#else
#define ROW_PAIRS 8
#endif
#define ROWS_PER_PASS(m) (4 * (m) <= ROW_PAIRS ? 4 : 2 * (m) <= ROW_PAIRS ? 2 : 1)

/* Output rows j..j+3 of input rows x[0..m) (any m), through dot_rows_blocks in groups of
 * up to 8 input rows. */
static void dot4_blocks_rows(const float *restrict x, int64_t m, int64_t k,
                             const uint8_t *restrict w, int64_t row_bytes, int64_t nb,
                             int64_t block_bytes, int type, int64_t n, float *restrict y) {
    for (int64_t i0 = 0; i0 < m; i0 += 8) {
        const float *a = x + i0 * k;
        float *out = y + i0 * n;
#define PASS(M)                                                                         \
    for (int r0 = 0; r0 < 4; r0 += ROWS_PER_PASS(M))                                   \
        dot_rows_blocks(a, k, w + r0 * row_bytes, row_bytes, nb, block_bytes, type,    \
                        ROWS_PER_PASS(M), M, n, out + r0)
        switch (min64(8, m - i0)) {
        case 1: PASS(1); break;
        case 2: PASS(2); break;
        case 3: PASS(3); break;
        case 4: PASS(4); break;
        case 5: PASS(5); break;
        case 6: PASS(6); break;
        case 7: PASS(7); break;
        default: PASS(8); break;
        }
#undef PASS
    }
}

#include "matvec_blocks_more.h"

int linear_dequant_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t parallel_min_bytes);

/* The 16-bit float types (GGUF F16, BF16): linear_f32's loops on the widened weight. */
enum { BLOCK_F16 = 8, BLOCK_BF16 = 9 };
DEFINE_DOT4(f16, uint16_t)
DEFINE_DOT4(bf16, uint16_t)
DEFINE_DOT(f16, uint16_t)
DEFINE_DOT(bf16, uint16_t)
DEFINE_LINEAR(f16, uint16_t, static void)
DEFINE_LINEAR(bf16, uint16_t, static void)

/* Returns 0, -1 when a buffer cannot be allocated, -2 when K is not a multiple of the
 * block's values or N of 4, -3 for an unknown block type. F16 / BF16 take any K and N. A
 * type of matvec_blocks_more.h at several rows goes through linear_dequant_f32 (each
 * chunk of rows dequantized once for all of them): the same outputs, row by row. */
int linear_blocks_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                      int64_t n, const float *bias, float *y, int64_t parallel_min_bytes) {
    if (type == BLOCK_F16 || type == BLOCK_BF16) {
        (type == BLOCK_F16 ? linear_f16 : linear_bf16)(x, m, k, (const uint16_t *)w, n, bias, y,
                                                        parallel_min_bytes);
        return 0;
    }
    int64_t values, bytes;
    if (more_block(type, &values, &bytes)) {
        if (k % values != 0 || n % 4 != 0) return -2;
        if (m > 1) return linear_dequant_f32(x, m, k, w, type, n, bias, y, parallel_min_bytes);
        const int64_t nb = k / values, row_bytes = nb * bytes;
        const int parallel = n * row_bytes >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
            const int64_t n1 = min64(n0 + CHUNK, n);
            for (int64_t j = n0; j < n1; j += 4)
                dot4_more(x, w + j * row_bytes, row_bytes, nb, values, bytes, type, y + j);
            if (bias)
                for (int64_t j = n0; j < n1; j++) y[j] += bias[j];
        }
        return 0;
    }
    if (k % 32 != 0 || n % 4 != 0) return -2;
    if (type != BLOCK_Q4_1 && type != BLOCK_Q8_0) return -3;
    const int64_t block_bytes = type == BLOCK_Q4_1 ? 20 : 34, nb = k / 32;
    const int64_t row_bytes = nb * block_bytes;
    /* Split by the bytes read times the rows they serve: at one row as linear_blocks_q8
     * splits, since a one-row step's layer projections take 50-150 us on one thread, where
     * waking a sleeping thread for each costs about what it saves (MatvecKernels.tune picks
     * the bound that pays here); a verify step of several rows does several times the
     * products per byte, and splits sooner. */
    const int parallel = n * row_bytes * m >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
        const int64_t n1 = min64(n0 + CHUNK, n);
        for (int64_t j = n0; j < n1; j += 4) {
            if (m == 1 && type == BLOCK_Q4_1)
                dot4_blocks(x, w + j * row_bytes, row_bytes, nb, 20, BLOCK_Q4_1, y + j);
            else if (m == 1)
                dot4_blocks(x, w + j * row_bytes, row_bytes, nb, 34, BLOCK_Q8_0, y + j);
            else  /* several rows: each block converted once for all of them */
                dot4_blocks_rows(x, m, k, w + j * row_bytes, row_bytes, nb, block_bytes, type,
                                 n, y + j);
        }
        if (bias)
            for (int64_t row = 0; row < m; row++)
                for (int64_t j = n0; j < n1; j++) y[row * n + j] += bias[j];
    }
    return 0;
}
#else
int linear_blocks_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                      int64_t n, const float *bias, float *y, int64_t parallel_min_bytes) {
    (void)x, (void)m, (void)k, (void)w, (void)type, (void)n, (void)bias, (void)y;
    (void)parallel_min_bytes;
    return -4; /* not built with AVX2, FMA and F16C: matvec_features() says so */
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* linear_blocks_q8: y ~ x W^T + b with W in the model file's blocks (Q4_1, Q8_0 here; Q5_0,
 * Q4_K and Q6_K in matvec_integer_more.h) and x
 * quantized here per block of 32 values to int8 (one float scale per block, and for Q4_1
 * its sum: llama.cpp's Q8_1), the products summed as integers, as llama.cpp's
 * ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q8_0_q8_0 do. Per block of 32:
 *
 *   Q4_1 (w = d q + m, q in 0..15):  d dx sum(q qx) + m (dx sum(qx))
 *   Q8_0 (w = d q, q in -127..127):  d dx sum(q qx)
 *
 * The integer sums take u8 x s8 products: the nibbles are the unsigned side as they are;
 * for Q8_0, |qx| times q with qx's sign. The instruction is VNNI's dpbusd where the CPU
 * has it (AVX-512 VNNI in 256-bit form, or AVX-VNNI), else AVX2's maddubs (pairs summed
 * to 16 bits: 2 * 15 * 127 and 2 * 127 * 127 fit) and madd; both give the same integers,
 * so the outputs are the same on either path. One row reads 0.625 (Q4_1) bytes a weight
 * with next to no arithmetic per byte: the weights stream at memory speed. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT8_DOT 3
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVXVNNI__)
#define INT8_DOT 2
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#else
#define INT8_DOT 1
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

/* Which integer dot product linear_blocks_q8 was built with: 1 AVX2 (maddubs), 2
 * AVX-VNNI, 3 AVX-512 VNNI; 0 none. */
int matvec_int8_dot(void) { return INT8_DOT; }

/* One row of x [k] -> q [k] int8, scale d and d * sum(q) per block of 32 (round to
 * nearest even, the scale amax / 127: q in -127..127). */
static void quantize_blocks32(const float *restrict x, int64_t k, int8_t *restrict q,
                              float *restrict d, float *restrict s) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / 32; b++) {
        const float *p = x + 32 * b;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float top = _mm_cvtss_f32(m4);
        const float inv = top > 0.0f ? 127.0f / top : 0.0f;
        const __m256 scale = _mm256_set1_ps(inv);
        __m256i i32[4];
        for (int i = 0; i < 4; i++) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                             _mm256_add_epi32(i32[2], i32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        /* packs interleave the 128-bit lanes: the permute puts the 32 values back in order */
        const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
        const __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), order);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), i8);
        d[b] = top / 127.0f;
        s[b] = d[b] * (float)_mm_cvtsi128_si32(s4);
    }
}

/* One call's rows of x quantized per block of 32 (row i's values at q + i * k, its blocks'
 * entries at i * nb): the int8 values, each block's scale d and d * sum, and (for the
 * 16-row kernels) each block's integer sum and those of its two halves. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *sum32, *sum16;
    int64_t k, nb;
} QX;

/* Output rows j..j+3 of all m (1 to 4) quantized input rows; row r's blocks start at
 * w + r * row_bytes, input row i's at xq + i * k, its outputs at out + i * n. Each weight
 * block is unpacked once for the m rows. The integer sum of each block is scaled into
 * float32 lanes (8 per output); Q4_1's offset term is one scalar per block. Called with a
 * literal m, so that each count gets its own loops, accumulators in registers. Measured
 * on a loaded AVX-512 EPYC, one thread, CPU time of 32 of SmolLM2's Q4_1 projections
 * against unpacking the weights again for each row: 1.51 / 1.52 ms at one row, 1.93 /
 * 2.41 at two, 2.55 / 4.05 at four (equal outputs). The other types' sums are
 * more_q8_sums's (matvec_integer_more.h). */
static inline void more_q8_sums(const int8_t *restrict xq, const float *restrict xd,
                                const float *restrict xs, int64_t k,
                                const uint8_t *restrict w, int64_t row_bytes, int type,
                                const int m, __m256 c[4][4], float offset[4][4]);

static inline void dot4_blocks_q8(const int8_t *restrict xq, const float *restrict xd,
                                  const float *restrict xs, int64_t k, const uint8_t *restrict w,
                                  int64_t row_bytes, int64_t nb, int type, const int m,
                                  int64_t n, float *restrict out) {
    __m256 c[4][4];
    float offset[4][4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < m; i++) {
            c[r][i] = _mm256_setzero_ps();
            offset[r][i] = 0.0f;
        }
    const __m256i low = _mm256_set1_epi8(0x0F);
    /* this loop reads Q4_1 and Q8_0; more_q8_sums the others */
    const int64_t own = type == BLOCK_Q4_1 || type == BLOCK_Q8_0 ? nb : 0;
    if (!own) more_q8_sums(xq, xd, xs, k, w, row_bytes, type, m, c, offset);
    for (int64_t b = 0; b < own; b++) {
        __m256i xv[4];
        for (int i = 0; i < m; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * b));
        if (type == BLOCK_Q4_1) {
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = w + r * row_bytes + b * 20;
                _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
                uint32_t dm;
                memcpy(&dm, blk, sizeof dm);
                const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
                const float d = _mm_cvtss_f32(dmf), mo = _mm_cvtss_f32(_mm_movehdup_ps(dmf));
                const __m128i packed = _mm_loadu_si128((const __m128i *)(blk + 4));
                /* bytes 0-15: values 0-15 (low nibbles); 16-31: values 16-31 (high) */
                const __m256i wv = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                for (int i = 0; i < m; i++) {
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wv, xv[i]));
                    c[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[i * nb + b]), dot, c[r][i]);
                    offset[r][i] += mo * xs[i * nb + b];
                }
            }
        } else {
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = w + r * row_bytes + b * 34;
                _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 2));
                const float d = half_to_float(blk);
                for (int i = 0; i < m; i++) {
                    const __m256i ax = _mm256_sign_epi8(xv[i], xv[i]);
                    const __m256 dot =
                        _mm256_cvtepi32_ps(dot_u8s8(ax, _mm256_sign_epi8(qv, xv[i])));
                    c[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[i * nb + b]), dot, c[r][i]);
                }
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int r = 0; r < 4; r++) out[i * n + r] = hsum256(c[r][i]) + offset[r][i];
}

#if INT8_DOT == 3 && defined(__AVX512BW__)
#define BLOCKS_X16 1
/* The interleaved forms (`matvec.interleave`): the same blocks regrouped at load so that
 * one 512-bit dpbusd sums 4 products for each of 16 output rows. Read one block at a time,
 * a Q4_1 row costs a dpbusd, a float conversion, a scale product and an FMA per 32 weights
 * (plus the f16 scales and the offset term): at one row the per-block float work, not the
 * bytes, bounds it (on a 2-core EPYC with AVX-512 VNNI, one thread, SmolLM2's projections
 * took 10.0 ms against 10.9 for the float32 blocks). Interleaved, 16 rows share each
 * conversion and FMA, and a block's integer sum stays whole (exact) until it is scaled.
 * The same integers as linear_blocks_q8's row-at-a-time loop; the float steps differ in
 * order (a block's sum is scaled whole, not in eight partial lanes).
 *
 * Layout, per group of 16 output rows (rows 16g..16g+15), nb = K / 32 blocks:
 *   Q4_1x16: nb x [d f16 x 16][m f16 x 16], then nb x 256 bytes of nibbles: vector v
 *            (0..3) holds, at byte 4r + j, the file's byte 4v + j of row r's block (low
 *            nibble: value 4v + j, high: value 16 + 4v + j), so one AND and one shift
 *            give the u8 operands of products 4v..4v+3 and 16+4v..16+4v+3 of 16 rows.
 *   Q8_0x16: nb x [d f16 x 16], then nb x 512 bytes: vector t (0..7) holds, at byte
 *            4r + j, row r's value 4t + j plus 128 (u8; dpbusd wants one unsigned side),
 *            the 128s taken back out as 128 sum(qx), one integer per block of x.
 * Both keep the file's bytes per weight. */
enum { BLOCK_Q4_1_X16 = 16, BLOCK_Q8_0_X16 = 17, BLOCK_Q5_0_X16 = 18, BLOCK_Q4_K_X16 = 19,
       BLOCK_Q6_K_X16 = 20 };
#define X16_MAX_ROWS 8

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* 16 output rows (a group at w) of all m (1 to 8) quantized rows of x; m literal. Its
 * loops stay the compiler's: unrolled by pragma (as dot_rows_blocks) they gained at 8 rows
 * from L2 but lost 2-5% at 2 and 4 rows streamed from memory on a Zen 5 EPYC, and served
 * 4-stream int8 decoding read 0.95x. */
static inline void dot16_q4_1(const int8_t *restrict xq, const float *restrict xd,
                              const float *restrict xs, int64_t k, const uint8_t *restrict w,
                              int64_t nb, const int m, int64_t n, float *restrict out) {
    __m512 c[X16_MAX_ROWS], o[X16_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = o[i] = _mm512_setzero_ps();
    const uint8_t *scales = w, *quants = w + 64 * nb;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = quants + 256 * b;
        _mm_prefetch((const char *)(q + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 1024 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 1024 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 1024 + 192), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 64 * b)));
        const __m512 mn =
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 64 * b + 32)));
        __m512i wv[8];
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(q + 64 * v));
            wv[v] = _mm512_and_si512(raw, low);
            wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int i = 0; i < m; i++) {
            const int8_t *xb = xq + i * k + 32 * b;
            __m512i acc = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) acc = _mm512_dpbusd_epi32(acc, wv[t], bcast4(xb + 4 * t));
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nb + b]));
            c[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), c[i]);
            o[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[i * nb + b]), o[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * n, _mm512_add_ps(c[i], o[i]));
}

static inline void dot16_q8_0(const int8_t *restrict xq, const float *restrict xd,
                              const int32_t *restrict xsum, int64_t k,
                              const uint8_t *restrict w, int64_t nb, const int m, int64_t n,
                              float *restrict out) {
    __m512 c[X16_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = _mm512_setzero_ps();
    const uint8_t *scales = w, *quants = w + 32 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = quants + 512 * b;
        for (int p = 0; p < 8; p++) _mm_prefetch((const char *)(q + 2048 + 64 * p), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32 * b)));
        __m512i wv[8];
        for (int t = 0; t < 8; t++) wv[t] = _mm512_loadu_si512((const void *)(q + 64 * t));
        for (int i = 0; i < m; i++) {
            const int8_t *xb = xq + i * k + 32 * b;
            __m512i acc = _mm512_set1_epi32(-128 * xsum[i * nb + b]);
            for (int t = 0; t < 8; t++) acc = _mm512_dpbusd_epi32(acc, wv[t], bcast4(xb + 4 * t));
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nb + b]));
            c[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), c[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * n, c[i]);
}

#endif

#include "matvec_integer_more.h"

#ifdef BLOCKS_X16
/* Bytes of one output row in an interleaved form (a group's bytes / 16: the file's); 0 for
 * a code that is none. */
static int64_t x16_row_bytes(int type, int64_t k) {
    switch (type) {
    case BLOCK_Q4_1_X16: return k / 32 * 20;
    case BLOCK_Q8_0_X16: return k / 32 * 34;
    case BLOCK_Q5_0_X16: return k / 32 * 22;
    case BLOCK_Q4_K_X16: return k / 256 * 144;
    case BLOCK_Q6_K_X16: return k / 256 * 210;
    default: return 0;
    }
}

static void linear_x16(const QX *x, int64_t m, const uint8_t *w, int type, int64_t n,
                       const float *bias, float *y, int64_t parallel_min_bytes) {
    const int64_t k = x->k, nb = x->nb, group_bytes = 16 * x16_row_bytes(type, k);
    const int parallel = (n / 16) * group_bytes >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
        const int64_t n1 = min64(n0 + CHUNK, n);
        for (int64_t j = n0; j < n1; j += 16) {
            const uint8_t *wg = w + (j / 16) * group_bytes;
#define Q4(rows) dot16_q4_1(x->q, x->d, x->s, k, wg, nb, rows, n, y + j)
#define Q8(rows) dot16_q8_0(x->q, x->d, x->sum32, k, wg, nb, rows, n, y + j)
#define Q5(rows) dot16_q5_0(x, wg, rows, n, y + j)
#define Q4K(rows) dot16_q4_k(x, wg, rows, n, y + j)
#define Q6K(rows) dot16_q6_k(x, wg, rows, n, y + j)
#define ROWS(F)                                                                          \
    switch (m) {                                                                         \
    case 1: F(1); break;                                                                 \
    case 2: F(2); break;                                                                 \
    case 3: F(3); break;                                                                 \
    case 4: F(4); break;                                                                 \
    case 5: F(5); break;                                                                 \
    case 6: F(6); break;                                                                 \
    case 7: F(7); break;                                                                 \
    default: F(8); break;                                                                \
    }
            switch (type) {
            case BLOCK_Q4_1_X16: ROWS(Q4) break;
            case BLOCK_Q8_0_X16: ROWS(Q8) break;
            case BLOCK_Q5_0_X16: ROWS(Q5) break;
            case BLOCK_Q4_K_X16: ROWS(Q4K) break;
            default: ROWS(Q6K) break;
            }
#undef ROWS
#undef Q6K
#undef Q4K
#undef Q5
#undef Q8
#undef Q4
        }
        if (bias)
            for (int64_t row = 0; row < m; row++)
                for (int64_t j = n0; j < n1; j++) y[row * n + j] += bias[j];
    }
}
#endif

#ifndef BLOCKS_X16
#define BLOCKS_X8 1
/* The 8-row interleaved forms, for CPUs without AVX-512 VNNI (AVX2's maddubs, or AVX-VNNI's
 * 256-bit dpbusd): the BLOCKS_X16 layouts above at 8 output rows a group, so that one
 * 256-bit vector holds 4 consecutive values of each of 8 rows. Row at a time, a Q4_1 block
 * of one row costs an unpacking, a maddubs, a madd, a float conversion, a scale product and
 * an FMA per 32 weights: on a 2-core AVX2 EPYC (Zen 3), one thread, CPU time, SmolLM2's 121
 * projections at one row took 10.2 ms against 13.1 for the float32 blocks, while the same
 * core reads their 96 MB in about 6. Interleaved, the unpacking and the float work are
 * shared by 8 rows and a Q4_1 block's eight maddubs sums add up in 16 bits (each at most
 * 2 * 15 * 127, eight of them 30,480: no saturation) before one madd.
 *
 *   Q4_1x8: nb x [d f16 x 8][m f16 x 8], then nb x 128 bytes: vector v (0..3) holds, at
 *           byte 4r + j, the file's byte 4v + j of row r's block.
 *   Q8_0x8: nb x [d f16 x 8], then nb x 256 bytes: vector t (0..7) holds, at byte 4r + j,
 *           row r's value 4t + j (signed, as in the file: maddubs takes |q| and qx with
 *           q's sign, so every pair sum fits 16 bits).
 * The same integers as the row-at-a-time loop; the float steps differ in order. */
enum { BLOCK_Q4_1_X8 = 21, BLOCK_Q8_0_X8 = 22, BLOCK_Q5_0_X8 = 23 };
#define X8_MAX_ROWS 8

static inline __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* The sum over t of the u8 x s8 products of u[t] and the 4 values of x at xb + 4t, per
 * 32-bit lane. With maddubs, `per_madd` (literal) of its 16-bit sums are added before each
 * madd: 8 where u < 16 (Q4_1: 8 * 2 * 15 * 127 fits 16 bits), 4 where u < 32 (Q5_0). */
static inline __m256i dot8_u8s8(const __m256i u[8], const int8_t *xb, const int per_madd) {
    __m256i acc = _mm256_setzero_si256();
#if INT8_DOT >= 2
    (void)per_madd;
    for (int t = 0; t < 8; t++) {
#if INT8_DOT == 3
        acc = _mm256_dpbusd_epi32(acc, u[t], bcast4_256(xb + 4 * t));
#else
        acc = _mm256_dpbusd_avx_epi32(acc, u[t], bcast4_256(xb + 4 * t));
#endif
    }
#else
    for (int t0 = 0; t0 < 8; t0 += per_madd) {
        __m256i s16 = _mm256_maddubs_epi16(u[t0], bcast4_256(xb + 4 * t0));
        for (int t = t0 + 1; t < t0 + per_madd; t++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[t], bcast4_256(xb + 4 * t)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    }
#endif
    return acc;
}

/* Byte i of the result: 16 where bit i of `mask` is set, else 0 (each byte of the
 * broadcast mask spread over 8 bytes, then tested for its own bit). */
static inline __m256i bits_to_16s(uint32_t mask) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mask), spread);
    const __m256i all_but_own = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(v, all_but_own), _mm256_set1_epi8(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* 8 output rows (a group at w) of all m (1 to 8) quantized rows of x; m literal. */
static inline void dot8_q4_1(const int8_t *restrict xq, const float *restrict xd,
                             const float *restrict xs, int64_t k, const uint8_t *restrict w,
                             int64_t nb, const int m, int64_t n, float *restrict out) {
    __m256 c[X8_MAX_ROWS], o[X8_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = o[i] = _mm256_setzero_ps();
    const uint8_t *scales = w, *quants = w + 32 * nb;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = quants + 128 * b;
        _mm_prefetch((const char *)(q + 512), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 512 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(scales + 32 * b + 128), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 * b)));
        const __m256 mn =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 * b + 16)));
        __m256i wv[8];
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * v));
            wv[v] = _mm256_and_si256(raw, low);
            wv[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int i = 0; i < m; i++) {
            const __m256i acc = dot8_u8s8(wv, xq + i * k + 32 * b, 8);
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b]));
            c[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc), c[i]);
            o[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[i * nb + b]), o[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * n, _mm256_add_ps(c[i], o[i]));
}

static inline void dot8_q8_0(const int8_t *restrict xq, const float *restrict xd, int64_t k,
                             const uint8_t *restrict w, int64_t nb, const int m, int64_t n,
                             float *restrict out) {
    __m256 c[X8_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = _mm256_setzero_ps();
    const uint8_t *scales = w, *quants = w + 16 * nb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = quants + 256 * b;
        for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(q + 1024 + 64 * p), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * b)));
        __m256i wa[8];
        for (int t = 0; t < 8; t++)
            wa[t] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(q + 32 * t)));
        for (int i = 0; i < m; i++) {
            const int8_t *xb = xq + i * k + 32 * b;
            __m256i acc = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(q + 32 * t));
                const __m256i sx = _mm256_sign_epi8(bcast4_256(xb + 4 * t), wq);
#if INT8_DOT == 3
                acc = _mm256_dpbusd_epi32(acc, wa[t], sx);
#elif INT8_DOT == 2
                acc = _mm256_dpbusd_avx_epi32(acc, wa[t], sx);
#else
                acc = _mm256_add_epi32(
                    acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[t], sx), _mm256_set1_epi16(1)));
#endif
            }
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + b]));
            c[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc), c[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * n, c[i]);
}

/* Q5_0x8, per block: [d f16 x 8], 8 masks of 32 bits (mask t: bit 4r + j is the fifth bit
 * of row r's value 4t + j, the BLOCKS_X16 masks at 8 rows), then the nibbles as Q4_1x8's. */
#define Q5_0X8_BYTES 176
static inline void dot8_q5_0(const QX *x, const uint8_t *restrict w, const int m, int64_t n,
                             float *restrict out) {
    __m256 c[X8_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *p = w + Q5_0X8_BYTES * b;
        for (int l = 0; l < Q5_0X8_BYTES; l += 64)
            _mm_prefetch((const char *)(p + 4 * Q5_0X8_BYTES + l), _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        uint32_t masks[8];
        memcpy(masks, p + 16, sizeof masks);
        __m256i wv[8];
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 48 + 32 * v));
            wv[v] = _mm256_or_si256(_mm256_and_si256(raw, low), bits_to_16s(masks[v]));
            wv[v + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                        bits_to_16s(masks[v + 4]));
        }
        for (int i = 0; i < m; i++) {
            __m256i acc = dot8_u8s8(wv, x->q + i * x->k + 32 * b, 4);
            acc = _mm256_add_epi32(acc, _mm256_set1_epi32(-16 * x->sum32[i * x->nb + b]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->d[i * x->nb + b]));
            c[i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc), c[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm256_storeu_ps(out + i * n, c[i]);
}

/* Bytes of one output row in an 8-row form (the file's); 0 for a code that is none. */
static int64_t x8_row_bytes(int type, int64_t k) {
    switch (type) {
    case BLOCK_Q4_1_X8: return k / 32 * 20;
    case BLOCK_Q8_0_X8: return k / 32 * 34;
    case BLOCK_Q5_0_X8: return k / 32 * 22;
    default: return 0;
    }
}

static void linear_x8(const QX *x, int64_t m, const uint8_t *w, int type, int64_t n,
                      const float *bias, float *y, int64_t parallel_min_bytes) {
    const int64_t k = x->k, nb = x->nb, group_bytes = 8 * x8_row_bytes(type, k);
    const int parallel = (n / 8) * group_bytes >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
        const int64_t n1 = min64(n0 + CHUNK, n);
        for (int64_t j = n0; j < n1; j += 8) {
            const uint8_t *wg = w + (j / 8) * group_bytes;
#define Q4(rows) dot8_q4_1(x->q, x->d, x->s, k, wg, nb, rows, n, y + j)
#define Q8(rows) dot8_q8_0(x->q, x->d, k, wg, nb, rows, n, y + j)
#define Q5(rows) dot8_q5_0(x, wg, rows, n, y + j)
#define ROWS(F)                                                                          \
    switch (m) {                                                                         \
    case 1: F(1); break;                                                                 \
    case 2: F(2); break;                                                                 \
    case 3: F(3); break;                                                                 \
    case 4: F(4); break;                                                                 \
    case 5: F(5); break;                                                                 \
    case 6: F(6); break;                                                                 \
    case 7: F(7); break;                                                                 \
    default: F(8); break;                                                                \
    }
            switch (type) {
            case BLOCK_Q4_1_X8: ROWS(Q4) break;
            case BLOCK_Q8_0_X8: ROWS(Q8) break;
            default: ROWS(Q5) break;
            }
#undef ROWS
#undef Q5
#undef Q8
#undef Q4
        }
        if (bias)
            for (int64_t row = 0; row < m; row++)
                for (int64_t j = n0; j < n1; j++) y[row * n + j] += bias[j];
    }
}
#endif

/* Values and bytes of one block of a type the row-at-a-time loops read; 0 for any other. */
static int q8_block(int type, int64_t *values, int64_t *bytes) {
    if (type == BLOCK_Q4_1 || type == BLOCK_Q8_0) {
        *values = 32, *bytes = type == BLOCK_Q4_1 ? 20 : 34;
        return 1;
    }
    return (type == BLOCK_Q5_0 || type == BLOCK_Q4_K || type == BLOCK_Q6_K) &&
           more_block(type, values, bytes);
}

/* Returns 0, -1 when out of memory, -2 when K is not a multiple of the block's values, N of
 * 4 (8 or 16 for an interleaved form) or M is not 1 to 4 (to 8), -3 for an unknown block
 * type. */
int linear_blocks_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                     int64_t n, const float *bias, float *y, int64_t parallel_min_bytes) {
    int64_t values = 32, bytes = 0;
    int interleaved = 0; /* an 8- or 16-row form */
#ifdef BLOCKS_X16
    const int x16 = x16_row_bytes(type, 256) != 0;
    interleaved = x16;
    if (x16) {
        values = type == BLOCK_Q4_K_X16 || type == BLOCK_Q6_K_X16 ? 256 : 32;
        if (k % values != 0 || n % 16 != 0 || m < 1 || m > X16_MAX_ROWS) return -2;
    }
#endif
#ifdef BLOCKS_X8
    const int x8 = x8_row_bytes(type, 256) != 0;
    if (x8 && (k % 32 != 0 || n % 8 != 0 || m < 1 || m > X8_MAX_ROWS)) return -2;
    interleaved = x8;
#endif
    if (!interleaved) {
        if (!q8_block(type, &values, &bytes)) return -3;
        if (k % values != 0 || n % 4 != 0 || m < 1 || m > 4) return -2;
    }
    const int64_t nb = k / 32;
    int8_t *xq = malloc((size_t)(m * k));
    float *xd = malloc((size_t)(2 * m * nb) * sizeof(float));
    int32_t *sums = malloc((size_t)(3 * m * nb) * sizeof(int32_t));
    if (!xq || !xd || !sums) {
        free(xq), free(xd), free(sums);
        return -1;
    }
    for (int64_t row = 0; row < m; row++)
        quantize_blocks32(x + row * k, k, xq + row * k, xd + row * nb, xd + (m + row) * nb);
    int32_t *sum32 = sums, *sum16 = sums + m * nb;
    for (int64_t i = 0; i < 2 * m * nb; i++) {
        int32_t total = 0;
        for (int j = 0; j < 16; j++) total += xq[16 * i + j];
        sum16[i] = total;
    }
    for (int64_t i = 0; i < m * nb; i++) sum32[i] = sum16[2 * i] + sum16[2 * i + 1];
    const QX qx = {xq, xd, xd + m * nb, sum32, sum16, k, nb};
#ifdef BLOCKS_X16
    if (x16) {
        linear_x16(&qx, m, w, type, n, bias, y, parallel_min_bytes);
        free(xq), free(xd), free(sums);
        return 0;
    }
#endif
#ifdef BLOCKS_X8
    if (x8) {
        linear_x8(&qx, m, w, type, n, bias, y, parallel_min_bytes);
        free(xq), free(xd), free(sums);
        return 0;
    }
#endif
    const float *xs = qx.s;
    const int64_t row_bytes = k / values * bytes;
    const int parallel = n * row_bytes >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
        const int64_t n1 = min64(n0 + CHUNK, n);
        for (int64_t j = n0; j < n1; j += 4) {
            const uint8_t *wj = w + j * row_bytes;
#define DOT(rows) dot4_blocks_q8(xq, xd, xs, k, wj, row_bytes, nb, type, rows, n, y + j)
            switch (m) {
            case 1: DOT(1); break;
            case 2: DOT(2); break;
            case 3: DOT(3); break;
            default: DOT(4); break;
            }
#undef DOT
        }
        if (bias)
            for (int64_t row = 0; row < m; row++)
                for (int64_t j = n0; j < n1; j++) y[row * n + j] += bias[j];
    }
    free(xq), free(xd), free(sums);
    return 0;
}
#else
int matvec_int8_dot(void) { return 0; }

int linear_blocks_q8(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                     int64_t n, const float *bias, float *y, int64_t parallel_min_bytes) {
    (void)x, (void)m, (void)k, (void)w, (void)type, (void)n, (void)bias, (void)y;
    (void)parallel_min_bytes;
    return -4; /* not built with AVX2, FMA and F16C: matvec_features() says so */
}
#endif

/* --- GGUF blocks to float32 ------------------------------------------------------------
 *
 * dequantize_rows turns rows of the model file's blocks into float32 exactly as gguf-py's
 * dequantize does (the numbers transformers loads): every product here (an f16 scale, an
 * f16 scale times a 6- or 8-bit sub-block scale, times a quantized value of at most 6
 * bits) fits float32's 24-bit mantissa, so it is exact, and each weight rounds once, in
 * its final addition or subtraction of the minimum, whatever the compiler fuses. Plain C
 * (no vector instructions assumed): a weight kept in blocks is dequantized a tile at a
 * time for many-row products, or a chunk of rows at a time under linear_dequant_f32.
 * Codes: BLOCK_Q4_1, BLOCK_Q8_0 as above, then the rest (DQ_* below; matvec's
 * BLOCK_CODES mirrors them). */
enum { DQ_Q4_1 = 0, DQ_Q8_0 = 1, DQ_Q4_0 = 2, DQ_Q5_0 = 3, DQ_Q5_1 = 4, DQ_Q4_K = 5,
       DQ_Q5_K = 6, DQ_Q6_K = 7, DQ_F16 = 8, DQ_BF16 = 9 };

/* IEEE half to float (exact; no F16C needed). */
static inline float f16_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Values and bytes per block of each code; 0 for an unknown code. */
static int dq_block(int type, int64_t *values, int64_t *bytes) {
    static const int64_t v[] = {32, 32, 32, 32, 32, 256, 256, 256, 1, 1};
    static const int64_t b[] = {20, 34, 18, 22, 24, 144, 176, 210, 2, 2};
    if (type < 0 || type > DQ_BF16) return 0;
    *values = v[type];
    *bytes = b[type];
    return 1;
}

/* The blocks of rows k wide: 0 with *values, *bytes (per block) and *row_bytes set; -3 for
 * an unknown code, -2 when k is not a multiple of the block's values. */
static int dq_layout(int type, int64_t k, int64_t *values, int64_t *bytes, int64_t *row_bytes) {
    if (!dq_block(type, values, bytes)) return -3;
    if (k % *values != 0) return -2;
    *row_bytes = k / *values * *bytes;
    return 0;
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (gguf-py's get_scale_min). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

static void dq_block_values(const uint8_t *blk, int type, float *out) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (type == DQ_Q4_1 || type == DQ_Q8_0 || type == DQ_Q5_0) {
        /* the fused kernels' conversion (the codes are theirs): the same values */
        __m256 w[4];
        block_weights(blk, type, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 8 * i, w[i]);
        return;
    }
#endif
    switch (type) {
    case DQ_Q4_0: {
        const float d = f16_bits(blk);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((blk[2 + j] & 0x0F) - 8);
            out[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
        }
        break;
    }
    case DQ_Q4_1: {
        const float d = f16_bits(blk), m = f16_bits(blk + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(blk[4 + j] & 0x0F) + m;
            out[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
        }
        break;
    }
    case DQ_Q5_0:
    case DQ_Q5_1: {
        const int one = type == DQ_Q5_1; /* Q5_1: d, m, qh, qs; Q5_0: d, qh, qs */
        const float d = f16_bits(blk), m = one ? f16_bits(blk + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, blk + 2 + 2 * one, sizeof qh);
        const uint8_t *qs = blk + 6 + 2 * one;
        for (int j = 0; j < 32; j++) {
            const int lo = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
            const int q = lo | (int)(((qh >> j) & 1u) << 4);
            out[j] = one ? d * (float)q + m : d * (float)(q - 16);
        }
        break;
    }
    case DQ_Q8_0: {
        const float d = f16_bits(blk);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)blk[2 + j] * d;
        break;
    }
    case DQ_Q4_K:
    case DQ_Q5_K: { /* d, dmin, scales[12], (qh[32],) qs[128] */
        const int five = type == DQ_Q5_K;
        const float d = f16_bits(blk), dmin = f16_bits(blk + 2);
        const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + 16 + 32 * five;
        float ds[8], dm[8];
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            k_scale_min(scales, s, &sc, &mn);
            ds[s] = d * (float)sc;
            dm[s] = dmin * (float)mn;
        }
        /* Sub-blocks 2 j and 2 j + 1 share 32 bytes of qs (low, high nibbles): constant
         * shifts, so that the compiler vectorizes each loop. */
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = qs + 32 * j;
            float *lo = out + 64 * j, *hi = lo + 32;
            if (five) {
                for (int l = 0; l < 32; l++) {
                    const int h0 = (qh[l] >> (2 * j)) & 1, h1 = (qh[l] >> (2 * j + 1)) & 1;
                    lo[l] = ds[2 * j] * (float)((q[l] & 0x0F) | (h0 << 4)) - dm[2 * j];
                    hi[l] = ds[2 * j + 1] * (float)((q[l] >> 4) | (h1 << 4)) - dm[2 * j + 1];
                }
            } else {
                for (int l = 0; l < 32; l++) {
                    lo[l] = ds[2 * j] * (float)(q[l] & 0x0F) - dm[2 * j];
                    hi[l] = ds[2 * j + 1] * (float)(q[l] >> 4) - dm[2 * j + 1];
                }
            }
        }
        break;
    }
    case DQ_Q6_K: { /* ql[128], qh[64], scales[16] int8, d */
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = f16_bits(blk + 208);
        float ds[16];
        for (int i = 0; i < 16; i++) ds[i] = d * (float)scales[i];
        /* Values 128 g + 32 s + l: low nibble of ql[64 g + 32 (s % 2) + l] shifted by
         * 4 (s / 2), two high bits of qh[32 g + l] shifted by 2 s; a scale per 16 values. */
        for (int g = 0; g < 2; g++) {
            const uint8_t *ql = blk + 64 * g, *qh = blk + 128 + 32 * g;
            float *o = out + 128 * g;
            const float *sc = ds + 8 * g;
            for (int l = 0; l < 32; l++) {
                const int half = l / 16;
                const int q0 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                const int q1 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                const int q2 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                const int q3 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                o[l] = sc[half] * (float)(q0 - 32);
                o[l + 32] = sc[2 + half] * (float)(q1 - 32);
                o[l + 64] = sc[4 + half] * (float)(q2 - 32);
                o[l + 96] = sc[6 + half] * (float)(q3 - 32);
            }
        }
        break;
    }
    }
}

/* n 16-bit floats (F16, BF16: "blocks" of one value) -> float32, exactly. */
static void widen_halves(const uint8_t *w, int type, int64_t n, float *out) {
    int64_t i = 0;
    if (type == DQ_BF16) {
        for (; i < n; i++) {
            uint16_t h;
            memcpy(&h, w + 2 * i, sizeof h);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(out + i, &bits, sizeof bits);
        }
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))));
#endif
    for (; i < n; i++) out[i] = f16_bits(w + 2 * i);
}

/* Rows [rows, k] of blocks -> out [rows, k] float32. */
static void dq_rows(const uint8_t *w, int type, int64_t values, int64_t bytes, int64_t rows,
                    int64_t k, float *out) {
    if (type == DQ_F16 || type == DQ_BF16) {
        widen_halves(w, type, rows * k, out);
        return;
    }
    const int64_t nb = k / values;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++)
            dq_block_values(w + (r * nb + b) * bytes, type, out + r * k + b * values);
}

/* Returns 0, -2 when k is not a multiple of the block's values, -3 for an unknown code. */
int dequantize_rows(const uint8_t *w, int type, int64_t rows, int64_t k, float *out,
                    int64_t parallel_min_bytes) {
    int64_t values, bytes, row_bytes;
    const int layout = dq_layout(type, k, &values, &bytes, &row_bytes);
    if (layout != 0) return layout;
    const int parallel = rows * k * (int64_t)sizeof(float) >= parallel_min_bytes;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r0 = 0; r0 < rows; r0 += CHUNK)
        dq_rows(w + r0 * row_bytes, type, values, bytes, min64(CHUNK, rows - r0), k, out + r0 * k);
    return 0;
}

/* linear_dequant_f32: linear_f32 on a weight kept in blocks of any code above: each chunk
 * of CHUNK output rows is dequantized into a per-thread buffer, then summed by the very
 * loop linear_f32 runs (dot4_f32 in groups of four from the chunk's start, dot_f32 for the
 * rest, bias last), so the outputs are linear_f32's on the float32 weight to the bit, at
 * the blocks' bytes read. Returns 0, -1 when a buffer cannot be allocated, -2 / -3 as
 * dequantize_rows. */
int linear_dequant_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t parallel_min_bytes) {
    int64_t values, bytes, row_bytes;
    const int layout = dq_layout(type, k, &values, &bytes, &row_bytes);
    if (layout != 0) return layout;
    const int parallel = n * k * (int64_t)sizeof(float) >= parallel_min_bytes;
    int failed = 0;
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        float *tile = malloc((size_t)(CHUNK * k) * sizeof(float));
        failed |= tile == NULL;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < n; n0 += CHUNK) {
            if (tile == NULL) continue;
            const int64_t n1 = min64(n0 + CHUNK, n);
            dq_rows(w + n0 * row_bytes, type, values, bytes, n1 - n0, k, tile);
            for (int64_t row = 0; row < m; row++) {
                const float *a = x + row * k;
                float *out = y + row * n;
                int64_t j = n0;
#ifdef F32_SIMD
                for (; j + 4 <= n1; j += 4) dot4_f32(a, tile + (j - n0) * k, k, out + j);
#endif
                for (; j < n1; j++) out[j] = dot_f32(a, tile + (j - n0) * k, k);
                if (bias)
                    for (j = n0; j < n1; j++) out[j] += bias[j];
            }
        }
        free(tile);
    }
    return failed ? -1 : 0;
}

#include "blocks_gemm.h"
