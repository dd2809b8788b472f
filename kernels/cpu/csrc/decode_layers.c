/* Every decoder layer of a few-row decode step in one call (CPU, float32 activations).
 *
 * At one to four rows a step's arithmetic is small and its weights stream at memory speed,
 * so what is left is the host's own work: some 330 calls from Python into the native
 * kernels per SmolLM2-135M step, each with its checks, views and allocations (about 8 of
 * an int8 step's 18 ms on a 2-core EPYC). This loop makes those same calls from C, in the
 * same order and with the same arguments, so its results are the per-call path's to the
 * bit: the kernels are not linked here but handed in as function pointers (`Kernels`),
 * each built by its own library with its own flags.
 *
 * Per layer: h = norm(residual += x); qkv = h Wqkv^T; rotary on q and k together (they are
 * neighbours in each qkv row); k, v into their cache slots; attention over each row's
 * cached context; x = attn Wo^T; h = norm(residual += x); x = (silu(g) * u) Wdown^T with
 * [g u] = h Wgate_up^T. Layer 0 starts from residual = x. Each projection is float32, int8
 * (`Projection.q` set) or the model file's blocks (`.blocks`), read as the float32 values
 * or, with `.integer`, with integer products against x quantized to int8. A projection may
 * also be row segments of blocks of several formats (`.segments`: a llama.cpp Q4_K_M file
 * writes q and k in one format and v in another), each segment read as the per-call path
 * reads it (as float32 values, or with `.integer` in its integer form), its outputs side
 * by side as torch.cat puts them. On return x and residual hold
 * the last layer's output. The KV cache is float32 or bfloat16: the caller
 * hands in the KV store and attention of that kind.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*linear_f32_fn)(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                              const float *bias, float *y, int64_t parallel_min_bytes);
typedef int (*linear_q8_fn)(const float *x, int64_t m, int64_t k, const int8_t *w,
                            const float *scales, const float *wsum, int64_t n,
                            const float *bias, float *y, int64_t parallel_min_bytes);
typedef int (*linear_blocks_fn)(const float *x, int64_t m, int64_t k, const uint8_t *w,
                                int type, int64_t n, const float *bias, float *y,
                                int64_t parallel_min_bytes);
typedef void (*norm_fn)(const float *x, float *residual, const float *w, float eps, float *out,
                        int64_t rows, int64_t h);
typedef int (*rotary_fn)(float *heads, int64_t tokens, int64_t stride, int64_t nheads,
                         int64_t d, const int64_t *positions, const float *cos_table,
                         const float *sin_table, int64_t max_pos);
typedef int (*store_kv_fn)(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                           void *k_cache, void *v_cache, const int64_t *slots,
                           int64_t tokens, int64_t width, int64_t num_slots);
typedef void (*silu_mul_fn)(const float *gate_up, float *out, int64_t tokens, int64_t inter);
typedef int (*attention_fn)(const float *q, int64_t q_token_stride, int64_t q_head_stride,
                            const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t bt_stride,
                            const int32_t *context_lens, const int64_t *query_start,
                            float *out, int64_t rows, int64_t q_heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, float scale);

typedef struct {
    linear_f32_fn linear_f32;
    linear_q8_fn linear_q8;
    linear_blocks_fn linear_blocks;
    linear_blocks_fn linear_blocks_q8;
    norm_fn add_rms_norm;
    rotary_fn rotary;
    store_kv_fn store_kv;
    silu_mul_fn silu_mul;
    attention_fn attention;
} Kernels;

typedef struct {
    const uint8_t *blocks; /* the file's blocks of rows [start, start + n) */
    int64_t block_type;
    int64_t n;
    int64_t row_bytes; /* bytes of one output row's blocks */
} Segment;

typedef struct {
    const float *w;         /* float32 [n, k], or NULL when q, blocks or segments is set */
    const int8_t *q;        /* int8 [n, k] */
    const float *scales;    /* [n] */
    const float *wsum;      /* [n, k / 64] */
    const uint8_t *blocks;  /* the model file's blocks of the float32 weight's values */
    int64_t block_type;
    int64_t integer;        /* blocks (or segments) read with x quantized to int8
                               (linear_blocks_q8) */
    const float *bias;      /* [n] or NULL */
    int64_t n, k;
    const Segment *segments; /* row segments of blocks (float32 values, or with `integer`
                                each segment's integer form), in order */
    int64_t num_segments;
    int64_t row_bytes; /* bytes of one output row of blocks (an interleaved form too) */
} Projection;

typedef struct {
    const float *attn_norm, *ffn_norm;
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* float32 or bfloat16: `store_kv` and `attention` match it */
} Layer;

typedef struct {
    int64_t rows, hidden, q_heads, kv_heads, head_dim, inter, block_size, num_slots, max_pos;
    int64_t bt_stride, parallel_min_bytes;
    int64_t threads; /* > 1: the whole step in one parallel region (see decode_layers) */
    float eps, scale;
    const int64_t *positions, *slots, *query_start;
    const int32_t *block_tables, *context_lens;
    const float *cos_table, *sin_table;
    /* x [R, H] (in: the embeddings), residual [R, H]; scratch: h [R, H], qkv [R, (Hq + 2
     * Hkv) D], attn [R, Hq D], gate_up [R, 2 I], act [R, I] */
    float *x, *residual, *h, *qkv, *attn, *gate_up, *act;
} Step;

/* Each segment's [rows, n_s] product into its columns of y [rows, n]: straight into y at
 * one row (its columns are contiguous there), through a scratch copy at more. */
static int project_segments(const Kernels *f, const Projection *p, const float *x,
                            int64_t rows, float *y, int64_t parallel_min_bytes) {
    float *scratch = NULL;
    int64_t col = 0;
    int code = 0;
    if (rows > 1 && !(scratch = malloc((size_t)(rows * p->n) * sizeof(float)))) return 1;
    for (int64_t i = 0; i < p->num_segments && code == 0; i++) {
        const Segment *g = p->segments + i;
        float *out = rows > 1 ? scratch : y + col;
        code = (p->integer ? f->linear_blocks_q8 : f->linear_blocks)(
            x, rows, p->k, g->blocks, (int)g->block_type, g->n, p->bias ? p->bias + col : NULL,
            out, parallel_min_bytes);
        if (rows > 1 && code == 0)
            for (int64_t r = 0; r < rows; r++)
                memcpy(y + r * p->n + col, scratch + r * g->n, (size_t)g->n * sizeof(float));
        col += g->n;
    }
    free(scratch);
    return code;
}

static int project(const Kernels *f, const Projection *p, const float *x, int64_t rows,
                   float *y, int64_t parallel_min_bytes) {
    if (p->num_segments)
        return project_segments(f, p, x, rows, y, parallel_min_bytes);
    if (p->q)
        return f->linear_q8(x, rows, p->k, p->q, p->scales, p->wsum, p->n, p->bias, y,
                            parallel_min_bytes);
    if (p->blocks && p->integer)
        return f->linear_blocks_q8(x, rows, p->k, p->blocks, (int)p->block_type, p->n, p->bias,
                                   y, parallel_min_bytes);
    if (p->blocks)
        return f->linear_blocks(x, rows, p->k, p->blocks, (int)p->block_type, p->n, p->bias, y,
                                parallel_min_bytes);
    f->linear_f32(x, rows, p->k, p->w, p->n, p->bias, y, parallel_min_bytes);
    return 0;
}

static inline int64_t min_rows(int64_t a, int64_t b) { return a < b ? a : b; }

/* --- The whole step in one parallel region --------------------------------------------
 *
 * Per call, every projection big enough to split opens its own OpenMP region, and under
 * the worker's passive wait policy (threads sleep between regions, so that a shared
 * machine keeps its cores) each region wakes the sleeping threads again: some 120 wake-ups
 * a SmolLM2-135M step. With `Step.threads` > 1 the step opens one region instead; every
 * thread takes its share of each projection's output rows (the same kernels on a slice of
 * the weight, so every output is computed as the per-call path computes it, to the bit),
 * thread 0 alone runs the small pieces in between (norms, rotary, the KV store, attention,
 * the gate), and the threads meet at `step_barrier`s, which spin for a while (the pieces
 * in between take microseconds) before they sleep, so that a thread waiting on one taken
 * off its core by another process gives that core back instead of spinning on. */
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define spin_pause() _mm_pause()
#else
#define spin_pause() ((void)0)
#endif

/* How long a thread at a barrier spins before it sleeps: longer than the serial pieces
 * between two projections of a decode step (tens of microseconds), short against the
 * timeslice of a process that took the waited-for thread's core. */
#define SPIN_NS 200000

typedef struct {
    _Atomic int arrived;
    _Atomic int phase; /* the futex word: bumped by the last thread to arrive */
    _Atomic int sleepers;
    _Atomic int failed; /* a kernel's failure code, set by any thread between barriers */
    _Atomic int verdict; /* `failed` as the last thread to arrive found it */
    int threads;
} StepBarrier;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Waits until every thread arrived; returns the step's failure code as it stood then.
 * Every thread leaves with the same code (`verdict` changes only at the next barrier's
 * release, after every thread arrived there): a thread deciding on `failed` itself could
 * see a failure of the next phase, leave the loop, and strand the others at a barrier. */
static int step_barrier(StepBarrier *b) {
    const int phase = atomic_load(&b->phase);
    if (atomic_fetch_add(&b->arrived, 1) == b->threads - 1) {
        atomic_store(&b->verdict, atomic_load(&b->failed));
        atomic_store(&b->arrived, 0);
        atomic_store(&b->phase, phase + 1);
        if (atomic_load(&b->sleepers) > 0)
            syscall(SYS_futex, &b->phase, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return atomic_load(&b->verdict);
    }
    const uint64_t deadline = now_ns() + SPIN_NS;
    for (unsigned spins = 1; atomic_load(&b->phase) == phase; spins++) {
        if (spins % 256 == 0 && now_ns() > deadline) {
            /* A sleeper counted before the phase is read again: the last thread either sees
             * it and wakes it, or bumped the phase first, and the wait returns at once. */
            atomic_fetch_add(&b->sleepers, 1);
            while (atomic_load(&b->phase) == phase)
                syscall(SYS_futex, &b->phase, FUTEX_WAIT_PRIVATE, phase, NULL, NULL, 0);
            atomic_fetch_sub(&b->sleepers, 1);
            return atomic_load(&b->verdict);
        }
        spin_pause();
    }
    return atomic_load(&b->verdict);
}

/* This thread's share [*n0, *n1) of n output rows, in whole units of 16 or 8 (the
 * interleaved blocks' groups: a weight is interleaved only where n is a multiple of its
 * group), else 4 (the block and int8 kernels' unit); an n of none goes whole to thread 0. */
static void share(int64_t n, int tid, int threads, int64_t *n0, int64_t *n1) {
    const int64_t unit = n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : n;
    const int64_t units = n / unit, per = (units + threads - 1) / threads;
    *n0 = min_rows(n, (int64_t)tid * per * unit);
    *n1 = min_rows(n, *n0 + per * unit);
}

/* Output rows [n0, n1) of one weight (a segment's, or the projection's own) into columns
 * col + n0.. of y [rows, width]: straight in at one row, through scratch at more. The
 * kernels run on the slice of the weight (and of its scales and bias) as on a whole one,
 * on this thread alone. */
static int project_rows(const Kernels *f, const Projection *p, const Segment *g,
                        const float *x, int64_t rows, int64_t n0, int64_t n1, float *y,
                        int64_t width, int64_t col, float *scratch) {
    const int64_t n = n1 - n0, k = p->k, alone = INT64_MAX;
    if (n <= 0) return 0;
    float *out = rows > 1 ? scratch : y + col + n0;
    const float *bias = p->bias ? p->bias + col + n0 : NULL;
    int code = 0;
    if (g)
        code = (p->integer ? f->linear_blocks_q8 : f->linear_blocks)(
            x, rows, k, g->blocks + n0 * g->row_bytes, (int)g->block_type, n, bias, out, alone);
    else if (p->q)
        code = f->linear_q8(x, rows, k, p->q + n0 * k, p->scales + n0, p->wsum + n0 * (k / 64),
                            n, bias, out, alone);
    else if (p->blocks && p->integer)
        code = f->linear_blocks_q8(x, rows, k, p->blocks + n0 * p->row_bytes,
                                   (int)p->block_type, n, bias, out, alone);
    else if (p->blocks)
        code = f->linear_blocks(x, rows, k, p->blocks + n0 * p->row_bytes, (int)p->block_type,
                                n, bias, out, alone);
    else
        f->linear_f32(x, rows, k, p->w + n0 * k, n, bias, out, alone);
    if (rows > 1 && code == 0)
        for (int64_t r = 0; r < rows; r++)
            memcpy(y + r * width + col + n0, scratch + r * n, (size_t)n * sizeof(float));
    return code;
}

/* This thread's share of a projection (of each of its segments). */
static int project_share(const Kernels *f, const Projection *p, const float *x, int64_t rows,
                         float *y, int tid, int threads, float *scratch) {
    int64_t n0, n1;
    if (!p->num_segments) {
        share(p->n, tid, threads, &n0, &n1);
        return project_rows(f, p, NULL, x, rows, n0, n1, y, p->n, 0, scratch);
    }
    int64_t col = 0;
    for (int64_t i = 0; i < p->num_segments; i++) {
        const Segment *g = p->segments + i;
        share(g->n, tid, threads, &n0, &n1);
        const int code = project_rows(f, p, g, x, rows, n0, n1, y, p->n, col, scratch);
        if (code != 0) return code;
        col += g->n;
    }
    return 0;
}

static int decode_layers_together(const Kernels *f, const Layer *layers, int64_t num_layers,
                                  const Step *s, int widest) {
    const int64_t r = s->rows, d = s->head_dim;
    const int64_t q_width = s->q_heads * d, kv_width = s->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    StepBarrier barrier = {0, 0, 0, 0, 0, 0};
#pragma omp parallel num_threads((int)s->threads)
    {
        const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp single
        barrier.threads = threads; /* the single's own barrier publishes it */
        float *scratch = r > 1 ? malloc((size_t)(r * widest) * sizeof(float)) : NULL;
        if (r > 1 && !scratch) atomic_store(&barrier.failed, -100 + 1);
        int failed = step_barrier(&barrier);
/* Each thread's share of a projection, then all wait for the whole of it. */
#define SHARE(proj, in, out)                                                              \
    do {                                                                                  \
        const int c_ = project_share(f, &layer->proj, in, r, out, tid, threads, scratch); \
        if (c_ != 0) atomic_store(&barrier.failed, -100 + c_);                            \
        failed = step_barrier(&barrier);                                                  \
    } while (0)
/* Thread 0 alone, then all wait. */
#define ALONE(body)                                                                       \
    do {                                                                                  \
        if (tid == 0) {                                                                   \
            body;                                                                         \
        }                                                                                 \
        failed = step_barrier(&barrier);                                                  \
    } while (0)
        for (int64_t l = 0; l < num_layers && !failed; l++) {
            const Layer *layer = layers + l;
            ALONE({
                if (l == 0) {
                    memcpy(s->residual, s->x, (size_t)(r * s->hidden) * sizeof(float));
                    f->add_rms_norm(NULL, s->residual, layer->attn_norm, s->eps, s->h, r,
                                    s->hidden);
                } else {
                    f->add_rms_norm(s->x, s->residual, layer->attn_norm, s->eps, s->h, r,
                                    s->hidden);
                }
            });
            SHARE(qkv, s->h, s->qkv);
            if (failed) break;
            ALONE({
                int c = f->rotary(s->qkv, r, qkv_width, s->q_heads + s->kv_heads, d,
                                  s->positions, s->cos_table, s->sin_table, s->max_pos);
                if (c != 0) {
                    atomic_store(&barrier.failed, -200 + c);
                } else if ((c = f->store_kv(s->qkv + q_width, qkv_width,
                                            s->qkv + q_width + kv_width, qkv_width,
                                            layer->k_cache, layer->v_cache, s->slots, r,
                                            kv_width, s->num_slots)) != 0) {
                    atomic_store(&barrier.failed, -300 + c);
                } else if ((c = f->attention(s->qkv, qkv_width, d, layer->k_cache,
                                             layer->v_cache, s->block_tables, s->bt_stride,
                                             s->context_lens, s->query_start, s->attn, r,
                                             s->q_heads, s->kv_heads, d, s->block_size,
                                             s->scale)) != 0) {
                    atomic_store(&barrier.failed, -400 + c);
                }
            });
            if (failed) break;
            SHARE(o, s->attn, s->x);
            if (failed) break;
            ALONE(f->add_rms_norm(s->x, s->residual, layer->ffn_norm, s->eps, s->h, r,
                                  s->hidden));
            SHARE(gate_up, s->h, s->gate_up);
            if (failed) break;
            ALONE(f->silu_mul(s->gate_up, s->act, r, s->inter));
            SHARE(down, s->act, s->x);
        }
#undef ALONE
#undef SHARE
        free(scratch);
    }
    return atomic_load(&barrier.failed);
}

/* Returns 0; else the failing kernel's code plus a tag of its kind: -100 + c for a
 * projection, -200 + c for rotary (a position out of range), -300 + c for the KV store (a
 * slot past the cache), -400 + c for attention (out of memory). */
int decode_layers(const Kernels *f, const Layer *layers, int64_t num_layers, const Step *s) {
    if (s->threads > 1) {
        int64_t widest = 0; /* the most output rows one projection has */
        for (int64_t l = 0; l < num_layers; l++) {
            const Layer *y = layers + l;
            const int64_t n[4] = {y->qkv.n, y->o.n, y->gate_up.n, y->down.n};
            for (int i = 0; i < 4; i++) widest = n[i] > widest ? n[i] : widest;
        }
        return decode_layers_together(f, layers, num_layers, s, (int)widest);
    }
    const int64_t r = s->rows, d = s->head_dim;
    const int64_t q_width = s->q_heads * d, kv_width = s->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    int code;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *layer = layers + l;
        if (l == 0) {
            memcpy(s->residual, s->x, (size_t)(r * s->hidden) * sizeof(float));
            f->add_rms_norm(NULL, s->residual, layer->attn_norm, s->eps, s->h, r, s->hidden);
        } else {
            f->add_rms_norm(s->x, s->residual, layer->attn_norm, s->eps, s->h, r, s->hidden);
        }
        if ((code = project(f, &layer->qkv, s->h, r, s->qkv, s->parallel_min_bytes)) != 0)
            return -100 + code;
        code = f->rotary(s->qkv, r, qkv_width, s->q_heads + s->kv_heads, d, s->positions,
                         s->cos_table, s->sin_table, s->max_pos);
        if (code != 0) return -200 + code;
        code = f->store_kv(s->qkv + q_width, qkv_width, s->qkv + q_width + kv_width, qkv_width,
                           layer->k_cache, layer->v_cache, s->slots, r, kv_width, s->num_slots);
        if (code != 0) return -300 + code;
        code = f->attention(s->qkv, qkv_width, d, layer->k_cache, layer->v_cache,
                            s->block_tables, s->bt_stride, s->context_lens, s->query_start,
                            s->attn, r, s->q_heads, s->kv_heads, d, s->block_size, s->scale);
        if (code != 0) return -400 + code;
        if ((code = project(f, &layer->o, s->attn, r, s->x, s->parallel_min_bytes)) != 0)
            return -100 + code;
        f->add_rms_norm(s->x, s->residual, layer->ffn_norm, s->eps, s->h, r, s->hidden);
        if ((code = project(f, &layer->gate_up, s->h, r, s->gate_up, s->parallel_min_bytes)) != 0)
            return -100 + code;
        f->silu_mul(s->gate_up, s->act, r, s->inter);
        if ((code = project(f, &layer->down, s->act, r, s->x, s->parallel_min_bytes)) != 0)
            return -100 + code;
    }
    return 0;
}
