/* Paged attention over the worker's KV cache, read in place (CPU, float32 arithmetic).
 *
 * The torch path gathers every row's blocks into a padded copy before attending, which
 * reads and writes the whole context once more per layer and step; these loops read each
 * row's blocks where they lie. One task per (row, KV head) covers that head's query group
 * (GQA), so each key and value is loaded once for the group (a task per row, all its heads,
 * in a step of many rows: see pool_item). Two passes per task: scores
 * (kept in a per-thread buffer), then softmax weights times values. Accumulates in float32.
 *
 * Layout (as kernels/ops.py states): q [T, Hq, D] (any row and head strides, unit stride
 * in D), caches [NB, BS, Hkv, D] contiguous, block_tables [R, MB] int32 (row stride
 * given), context_lens [R] int32, out [T, Hq, D] contiguous. Query i of row r sits at
 * position context_lens[r] - q_len + i and sees keys [0, that position].
 *
 * The cache holds float32 (`paged_attention_f32`) or bfloat16 (`paged_attention_bf16`:
 * half the bytes read per step, `--kv-cache-dtype bfloat16`). A bfloat16 value is the top
 * half of a float32, so each one is widened by a 16-bit shift (exact) and everything after
 * that is float32 arithmetic (the AVX-512 loops widen 32 values at a time into an even
 * and an odd vector, the query split alike; the portable ones widen a row per query
 * group). Both are built from one set of loops: `kv` (0 float32, 1 bfloat16) is a
 * compile-time constant in each copy, and the cache is addressed in elements from a
 * `const void *` base.
 */
#include <math.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "pool.h"

/* The process's shared helper threads, where the caller hands them in (`pool.c`: a call
 * then opens no OpenMP region); NULL: OpenMP's threads. */
static pool_run_fn shared_pool;

void paged_attention_use_pool(pool_run_fn run) { shared_pool = run; }

#define SERIAL_BELOW (1 << 18)

/* Element i of a cache of kind `kv` (0 float32, 1 bfloat16), as float32. */
static inline __attribute__((always_inline)) float kv_at(const void *base, int64_t i, int kv) {
    if (!kv) return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* a . b[at : at + n], b a cache of kind kv. */
static inline __attribute__((always_inline)) float dot(const float *restrict a, const void *b,
                                                       int64_t at, int64_t n, int kv) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * kv_at(b, at + d, kv);
    return s;
}

/* y += a x[at : at + n], x a cache of kind kv. */
static inline __attribute__((always_inline)) void axpy(float *restrict y, float a, const void *x,
                                                       int64_t at, int64_t n, int kv) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] += a * kv_at(x, at + d, kv);
}

/* Each of `group` rows of `visible` scores becomes exp(score - its max), unnormalised;
 * inv_total[g] gets 1 / that row's sum (the division comes last, once per output). */
static inline void softmax_weights(float *scores, int64_t group, int64_t visible, float *inv_total) {
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * visible;
        /* A vector max: the scalar loop's compare chain cost a tenth of the attention. */
        float max_score = -INFINITY;
#pragma omp simd reduction(max : max_score)
        for (int64_t t = 0; t < visible; t++) max_score = s[t] > max_score ? s[t] : max_score;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < visible; t++) {
            s[t] = exp_nonpositive(s[t] - max_score);
            total += s[t];
        }
        inv_total[g] = 1.0f / total;
    }
}

/* One bfloat16 row widened to float32: the bits shifted up as integers (a loop the
 * compiler vectorizes, unlike a per-value conversion inside the dot product, which made
 * an AVX2 build's bfloat16 attention 1.9x slower than its float32 one), read as floats
 * through the union (GNU C's type punning). */
#define WIDE_MAX 1024
typedef union {
    uint32_t u[WIDE_MAX];
    float f[WIDE_MAX];
} Wide;

static inline void widen(const void *base, int64_t at, int64_t n, Wide *out) {
    const uint16_t *src = (const uint16_t *)base + at;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) out->u[d] = (uint32_t)src[d] << 16;
}

/* The attention of one query group (the G query heads sharing a KV head) over keys
 * [0, visible) of one row: q_g at q + g * q_head_stride, out_g at out + g * head_dim.
 * The head's keys and values start at element `head` of k_cache and v_cache. scores
 * holds G * visible floats. A bfloat16 cache's rows (head_dim <= WIDE_MAX) are widened
 * once for the whole group, then read as float32. */
static inline __attribute__((always_inline)) void attend_group(const float *q, int64_t q_head_stride, int64_t group,
                         const void *k_cache, const void *v_cache, int64_t head, const int32_t *table,
                         int64_t visible, int64_t block_size, int64_t token_stride,
                         int64_t block_stride, int64_t head_dim, float scale,
                         float *restrict scores, float *restrict out, int kv) {
    memset(out, 0, (size_t)(group * head_dim) * sizeof(float));
    if (visible <= 0) return;
    const int wide_rows = kv && head_dim <= WIDE_MAX;
    Wide wide;
    /* Pass 1: every score, each key loaded once for the whole group. */
    for (int64_t start = 0, b = 0; start < visible; start += block_size, b++) {
        const int64_t k_block = head + (int64_t)table[b] * block_stride;
        const int64_t n = visible - start < block_size ? visible - start : block_size;
        for (int64_t o = 0; o < n; o++) {
            const int64_t k = k_block + o * token_stride;
            if (wide_rows) widen(k_cache, k, head_dim, &wide);
            for (int64_t g = 0; g < group; g++) {
                const float *q_g = q + g * q_head_stride;
                const float s = wide_rows ? dot(q_g, wide.f, 0, head_dim, 0)
                                          : dot(q_g, k_cache, k, head_dim, kv);
                scores[g * visible + start + o] = s * scale;
            }
        }
    }
    /* Softmax weights, unnormalised; the division comes last. */
    float inv_total[group];
    softmax_weights(scores, group, visible, inv_total);
    /* Pass 2: weights times values, each value loaded once for the whole group. */
    for (int64_t start = 0, b = 0; start < visible; start += block_size, b++) {
        const int64_t v_block = head + (int64_t)table[b] * block_stride;
        const int64_t n = visible - start < block_size ? visible - start : block_size;
        for (int64_t o = 0; o < n; o++) {
            const int64_t v = v_block + o * token_stride;
            if (wide_rows) widen(v_cache, v, head_dim, &wide);
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[g * visible + start + o];
                if (wide_rows)
                    axpy(out + g * head_dim, w, wide.f, 0, head_dim, 0);
                else
                    axpy(out + g * head_dim, w, v_cache, v, head_dim, kv);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv_total[g];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The next block's rows of one head (D values each) on their way to the cache while this
 * block is computed: a row's blocks lie anywhere in the cache, where the hardware
 * prefetcher cannot follow (measured on the 2-core Xeon, one thread, 64 rows at context
 * 190, SmolLM2-135M's heads: float32 70 -> 66 ms a step's 30 layers, bfloat16 56 -> 44).
 * Into L2, not L1: a block's 32-64 lines at once overrun L1's few outstanding misses, and
 * the prefetches then wait like loads. On a 2-core Zen 4 EPYC, 64 rows at context 192
 * scattered over the cache, two threads (alternated, medians of 8): float32 38.3 -> 28.3
 * ms a step's 30 layers, bfloat16 26.7 -> 16.1; the Sapphire Rapids Xeon read level. */
static inline __attribute__((always_inline)) void prefetch_rows(const void *base, int64_t at,
                                                                int64_t rows, int64_t stride,
                                                                int64_t D, int kv) {
    const int64_t size = kv ? 2 : 4;
    const char *p = (const char *)base + at * size;
    for (int64_t t = 0; t < rows; t++)
        for (int64_t line = 0; line < D * size; line += 64)
            _mm_prefetch(p + t * stride * size + line, _MM_HINT_T1);
}

/* Sixteen vectors in, one out: lane t holds the sum of a[t]'s lanes (a transpose folded
 * into the additions: 45 instructions for 16 sums, against 4 shuffles and 4 adds each). */
static inline __m512 sum16(const __m512 *a) {
    __m512 pair[8], quad[4];
    for (int i = 0; i < 8; i++)
        pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(pair[2 * i]), y = _mm512_castps_pd(pair[2 * i + 1]);
        quad[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xdd));
    const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                   _mm512_shuffle_f32x4(quad[2], quad[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xdd));
}

/* bfloat16 keys and values by pairs: one 64-byte load holds 32 of them, and the even ones
 * (shifted up 16 bits) and the odd ones (their low 16 bits cleared) are two float32
 * vectors with no shuffle at all. A dot product does not care about the order of its
 * terms, so the query is split the same way (`split_pairs`); the weighted sum of values
 * keeps its accumulators split and interleaves them once at the end. */
static inline __attribute__((always_inline)) void load_pairs(const void *base, int64_t i,
                                                             __m512 *even, __m512 *odd) {
    const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)base + i));
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* q [D] -> out[2c] = q[32c + 2j], out[2c + 1] = q[32c + 2j + 1] (j < 16), c < D / 32. */
static inline __attribute__((always_inline)) void split_pairs(const float *q, int64_t D,
                                                              __m512 *out) {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4,
                                           2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
#pragma GCC unroll 4
    for (int64_t c = 0; c < D / 32; c++) {
        const __m512 a = _mm512_loadu_ps(q + 32 * c), b = _mm512_loadu_ps(q + 32 * c + 16);
        out[2 * c] = _mm512_permutex2var_ps(a, evens, b);
        out[2 * c + 1] = _mm512_permutex2var_ps(a, odds, b);
    }
}

/* A query's D / 16 vectors: as they lie (float32 keys), or split by split_pairs (bfloat16
 * keys, read by pairs). */
static inline __attribute__((always_inline)) void query_vectors(const float *q, int64_t D,
                                                                __m512 *qv, int kv) {
    if (kv) {
        split_pairs(q, D, qv);
        return;
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
}

/* q . k for the key at element k of the cache, as a vector whose lanes sum to it. */
static inline __attribute__((always_inline)) __m512 key_dot(const __m512 *qv, const void *k_cache,
                                                            int64_t k, int64_t D, int kv) {
    if (!kv) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps((const float *)k_cache + k));
#pragma GCC unroll 8
        for (int64_t c = 1; c < D / 16; c++)
            a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps((const float *)k_cache + k + 16 * c), a);
        return a;
    }
    __m512 even, odd;
    load_pairs(k_cache, k, &even, &odd);
    __m512 a = _mm512_fmadd_ps(qv[1], odd, _mm512_mul_ps(qv[0], even));
#pragma GCC unroll 4
    for (int64_t c = 1; c < D / 32; c++) {
        load_pairs(k_cache, k + 32 * c, &even, &odd);
        a = _mm512_fmadd_ps(qv[2 * c], even, a);
        a = _mm512_fmadd_ps(qv[2 * c + 1], odd, a);
    }
    return a;
}

/* scores[t] = scale * q . k_t for the n (<= 16) keys of one block (qv: query_vectors). */
static inline __attribute__((always_inline)) void block_scores(
    const __m512 *qv, const void *k_cache, int64_t k_block, int64_t n, int64_t token_stride,
    int64_t D, float scale, float *scores, int kv) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int64_t t = 0; t < 16; t++) {
        if (t < n)
            acc[t] = key_dot(qv, k_cache, k_block + t * token_stride, D, kv);
        else
            acc[t] = _mm512_setzero_ps();
    }
    const __m512 s = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores, (__mmask16)((1u << n) - 1u), s);
}

/* out_g += sum_t w_g[t] v_t for GB heads g of the group at once (their accumulators stay
 * in registers: GB * D / 16 of them), then out_g *= inv_total[g]. bfloat16 values are
 * read by pairs: acc[g][2c] sums the even values of chunk c, acc[g][2c + 1] the odd. */
static inline __attribute__((always_inline)) void weighted_values(
    const void *v_cache, int64_t head, const int32_t *table, int64_t visible, int64_t block_size,
    int64_t token_stride, int64_t block_stride, int64_t D, int64_t GB, const float *weights,
    int64_t weight_stride, const float *inv_total, float *out, int kv) {
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int64_t g = 0; g < GB; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t start = 0, b = 0; start < visible; start += block_size, b++) {
        const int64_t v_block = head + (int64_t)table[b] * block_stride;
        const int64_t n = visible - start < block_size ? visible - start : block_size;
        if (start + block_size < visible)
            prefetch_rows(v_cache, head + (int64_t)table[b + 1] * block_stride, block_size,
                          token_stride, D, kv);
        for (int64_t o = 0; o < n; o++) {
            const int64_t v = v_block + o * token_stride;
            __m512 vv[8];
            if (kv) {
#pragma GCC unroll 4
                for (int64_t c = 0; c < D / 32; c++)
                    load_pairs(v_cache, v + 32 * c, &vv[2 * c], &vv[2 * c + 1]);
            } else {
#pragma GCC unroll 8
                for (int64_t c = 0; c < D / 16; c++) vv[c] = _mm512_loadu_ps((const float *)v_cache + v + 16 * c);
            }
#pragma GCC unroll 4
            for (int64_t g = 0; g < GB; g++) {
                const __m512 w = _mm512_set1_ps(weights[g * weight_stride + start + o]);
#pragma GCC unroll 8
                for (int64_t c = 0; c < D / 16; c++)
                    acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
            }
        }
    }
    /* bfloat16 values: out[32c + 2j] = even[j], out[32c + 2j + 1] = odd[j], the halves
     * interleaved back. */
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
#pragma GCC unroll 4
    for (int64_t g = 0; g < GB; g++) {
        const __m512 inv = _mm512_set1_ps(inv_total[g]);
        float *o = out + g * D;
        if (kv) {
#pragma GCC unroll 4
            for (int64_t c = 0; c < D / 32; c++) {
                const __m512 e = acc[g][2 * c], od = acc[g][2 * c + 1];
                _mm512_storeu_ps(o + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(e, low, od), inv));
                _mm512_storeu_ps(o + 32 * c + 16,
                                 _mm512_mul_ps(_mm512_permutex2var_ps(e, high, od), inv));
            }
        } else {
#pragma GCC unroll 8
            for (int64_t c = 0; c < D / 16; c++)
                _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[g][c], inv));
        }
    }
}

/* attend_group for head_dim D (64 or 128: a multiple of 32, at most 128). */
static inline __attribute__((always_inline)) void attend_group_avx512(
    const float *q, int64_t q_head_stride, int64_t group, const void *k_cache,
    const void *v_cache, int64_t head, const int32_t *table, int64_t visible, int64_t block_size,
    int64_t token_stride, int64_t block_stride, int64_t D, float scale,
    float *restrict scores, float *restrict out, int kv) {
    if (visible <= 0) {
        memset(out, 0, (size_t)(group * D) * sizeof(float));
        return;
    }
    /* Pass 1: every score, a block of keys at a time (they stay in L1 across the group). */
    for (int64_t g = 0; g < group; g++) {
        __m512 qv[8];
        query_vectors(q + g * q_head_stride, D, qv, kv);
        for (int64_t start = 0, b = 0; start < visible; start += block_size, b++) {
            const int64_t k_block = head + (int64_t)table[b] * block_stride;
            const int64_t n = visible - start < block_size ? visible - start : block_size;
            if (g == 0 && start + block_size < visible)
                prefetch_rows(k_cache, head + (int64_t)table[b + 1] * block_stride, block_size,
                              token_stride, D, kv);
            for (int64_t o = 0; o < n; o += 16)
                block_scores(qv, k_cache, k_block + o * token_stride, n - o < 16 ? n - o : 16,
                             token_stride, D, scale, scores + g * visible + start + o, kv);
        }
    }
    /* Softmax weights, unnormalised; the division comes last. */
    float inv_total[group];
    softmax_weights(scores, group, visible, inv_total);
    /* Pass 2: weights times values, heads a few at a time with their sums in registers. */
    const int64_t per_pass = D <= 64 ? 4 : 2;
    for (int64_t g = 0; g < group;) {
        const int64_t left = group - g;
        const float *w = scores + g * visible;
        float *o = out + g * D;
#define VALUES(GB)                                                                        \
    weighted_values(v_cache, head, table, visible, block_size, token_stride, block_stride, \
                    D, GB, w, visible, inv_total + g, o, kv)
        if (left >= per_pass) {
            if (per_pass == 4) {
                VALUES(4);
            } else {
                VALUES(2);
            }
            g += per_pass;
        } else if (left == 3) {
            VALUES(3);
            g += 3;
        } else if (left == 2) {
            VALUES(2);
            g += 2;
        } else {
            VALUES(1);
            g += 1;
        }
#undef VALUES
    }
}
#define HAVE_AVX512_ATTENTION 1
#endif

/* attend_group for one query group: its own copy for each common head size (unrolled for
 * that size), through the AVX-512 loops where they are built. */
static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t q_head_stride, int64_t group, const void *k_cache,
    const void *v_cache, int64_t head, const int32_t *table, int64_t visible, int64_t block_size,
    int64_t token_stride, int64_t block_stride, int64_t head_dim, float scale,
    float *restrict scores, float *restrict out, int kv) {
#define ATTEND(FN, D)                                                                      \
    FN(q, q_head_stride, group, k_cache, v_cache, head, table, visible, block_size,         \
       token_stride, block_stride, D, scale, scores, out, kv)
#if defined(HAVE_AVX512_ATTENTION)
    if (head_dim == 64)
        ATTEND(attend_group_avx512, 64);
    else if (head_dim == 128)
        ATTEND(attend_group_avx512, 128);
    else
#endif
    if (head_dim == 64)
        ATTEND(attend_group, 64);
    else if (head_dim == 128)
        ATTEND(attend_group, 128);
    else
        ATTEND(attend_group, head_dim);
#undef ATTEND
}

/* One call's arguments, and what follows from them. */
typedef struct {
    const float *q;
    int64_t q_token_stride, q_head_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *context_lens;
    const int64_t *query_start;
    float *out;
    int64_t q_heads, kv_heads, head_dim, block_size, group, token_stride, block_stride, room;
    float scale;
    int whole_rows; /* a pool item is a row (all its KV heads), not a (row, KV head) */
    /* The pool's path: each worker's scores (allocated by the worker on its first item),
     * and whether one could not be had. */
    float *scratch[MOST_WORKERS];
    _Atomic int failed;
} Call;

/* Every query of row r with KV head h's query group; scores holds c->room floats. */
static inline __attribute__((always_inline)) void row_head(const Call *c, int64_t r, int64_t h,
                                                           float *scores, int kv) {
    const int64_t first = c->query_start[r], last = c->query_start[r + 1];
    const int64_t ctx = c->context_lens[r];
    const int32_t *table = c->block_tables + r * c->table_stride;
    const int64_t head_at = h * c->head_dim, head = h * c->group;
    for (int64_t i = first; i < last; i++) {
        const int64_t visible = ctx - (last - i) + 1;
        const float *q_group = c->q + i * c->q_token_stride + head * c->q_head_stride;
        float *out_group = c->out + (i * c->q_heads + head) * c->head_dim;
        attend(q_group, c->q_head_stride, c->group, c->k_cache, c->v_cache, head_at, table,
               visible, c->block_size, c->token_stride, c->block_stride, c->head_dim, c->scale,
               scores, out_group, kv);
    }
}

#define WHOLE_ROWS_FROM 16
/* A pool item: (row, KV head) = (item / kv_heads, item % kv_heads), or from
 * WHOLE_ROWS_FROM rows on, row `item` with all its KV heads. A cache block holds each
 * token's heads side by side, so a (row, KV head) item reads every third run of a head's
 * bytes, and two threads on the same row's heads each pulled the row's whole blocks in
 * (the cores' prefetchers stream whole pages): a row's heads one after another on one
 * thread read its blocks once. On a 2-core Sapphire Rapids Xeon, a 64-row decode step of
 * SmolLM2-135M at context 192 (`bench.p1_step --quantize int8`, alternated): float32
 * cache 36.9-37.9 -> 30.7-31.2 ms a step's attention, bfloat16 25.0-27.2 -> 21.3-21.6. */
static inline __attribute__((always_inline)) void pool_item(void *ctx, int64_t item, int worker,
                                                            int kv) {
    Call *c = ctx;
    if (c->scratch[worker] == NULL) {
        c->scratch[worker] = malloc((size_t)c->room * sizeof(float));
        if (c->scratch[worker] == NULL) {
            atomic_store(&c->failed, 1);
            return;
        }
    }
    if (c->whole_rows)
        for (int64_t h = 0; h < c->kv_heads; h++) row_head(c, item, h, c->scratch[worker], kv);
    else
        row_head(c, item / c->kv_heads, item % c->kv_heads, c->scratch[worker], kv);
}
static void pool_item_f32(void *ctx, int64_t item, int worker) { pool_item(ctx, item, worker, 0); }
static void pool_item_bf16(void *ctx, int64_t item, int worker) { pool_item(ctx, item, worker, 1); }

/* Every query of every row: rows' queries packed back to back (query_start [R + 1]);
 * a row of one query is a decode row. Returns 0, or -1 when a buffer could not be had. */
static inline __attribute__((always_inline)) int paged_attention(
    const float *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
    const void *v_cache, const int32_t *block_tables, int64_t table_stride,
    const int32_t *context_lens, const int64_t *query_start, float *out, int64_t rows,
    int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
    int kv) {
    int64_t longest = 0, pairs = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (context_lens[r] > longest) longest = context_lens[r];
        pairs += (query_start[r + 1] - query_start[r]) * context_lens[r];
    }
    Call c = {
        .q = q, .q_token_stride = q_token_stride, .q_head_stride = q_head_stride,
        .k_cache = k_cache, .v_cache = v_cache, .block_tables = block_tables,
        .table_stride = table_stride, .context_lens = context_lens,
        .query_start = query_start, .out = out, .q_heads = q_heads, .kv_heads = kv_heads,
        .head_dim = head_dim, .block_size = block_size, .group = q_heads / kv_heads,
        .token_stride = kv_heads * head_dim, .block_stride = block_size * kv_heads * head_dim,
        .room = (longest > 0 ? longest : 1) * (q_heads / kv_heads), .scale = scale,
    };
    atomic_init(&c.failed, 0);
    /* Keys and values read (floats, counted again for each query): a step under
     * SERIAL_BELOW runs on this thread alone. A batch-1 decode step at context 200 reads
     * 77k, some 20 us of work, and waking a sleeping OpenMP thread (the worker's passive
     * wait policy) cost more than that on a 2-core VM; with it alone, the attention of a
     * SmolLM2-135M step at context 200 went from about 110 to 30 us per layer. */
    const int64_t work = pairs * kv_heads * head_dim * 2;
    c.whole_rows = rows >= WHOLE_ROWS_FROM;
    if (work >= SERIAL_BELOW &&
        pool_took(shared_pool, kv ? pool_item_bf16 : pool_item_f32, &c,
                  c.whole_rows ? rows : rows * kv_heads)) {
        for (int w = 0; w < MOST_WORKERS; w++) free(c.scratch[w]);
        return atomic_load(&c.failed) ? -1 : 0;
    }
#pragma omp parallel if (work >= SERIAL_BELOW)
    {
        float *scores = (float *)malloc((size_t)c.room * sizeof(float));
        if (scores == NULL) atomic_store(&c.failed, 1);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL) continue;
                /* The kind is a value of the parallel region (outlined once for both
                 * kinds), so each kind takes its own copy of the loops from here. */
                if (kv)
                    row_head(&c, r, h, scores, 1);
                else
                    row_head(&c, r, h, scores, 0);
            }
        }
        free(scores);
    }
    return atomic_load(&c.failed) ? -1 : 0;
}

/* The two cache kinds, each its own copy of the loops (the kind folded in at compile time).
 * The caches are `const void *` here so that `decode_layers` can hold either through one
 * function-pointer type. */
#define PAGED_ATTENTION(NAME, KV)                                                           \
    int NAME(const float *q, int64_t q_token_stride, int64_t q_head_stride,                 \
             const void *k_cache, const void *v_cache, const int32_t *block_tables,         \
             int64_t table_stride, const int32_t *context_lens, const int64_t *query_start, \
             float *out, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim,  \
             int64_t block_size, float scale) {                                             \
        return paged_attention(q, q_token_stride, q_head_stride, k_cache, v_cache,          \
                               block_tables, table_stride, context_lens, query_start, out,  \
                               rows, q_heads, kv_heads, head_dim, block_size, scale, KV);   \
    }
PAGED_ATTENTION(paged_attention_f32, 0)
PAGED_ATTENTION(paged_attention_bf16, 1)
#undef PAGED_ATTENTION
