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
 *
 * A step of many rows (the int8 mode's, past the few-row kernels) comes here too, with
 * every projection in `matmul_q8`'s packed int8 form (`Projection.neg` set, the product
 * `Kernels.linear_rows`): the same loop, one kernel call after another, each many-row
 * kernel spreading its own work over the process's helper threads as it does when called
 * from Python. What it saves is Python's: about 5 ms of a 64-row step's 330 calls.
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
typedef int (*linear_rows_fn)(const float *x, int64_t m, int64_t k, const int8_t *w,
                              const int32_t *neg, const float *scales, int64_t n,
                              const float *bias, float *y, int64_t parallel_min_work);
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
    linear_rows_fn linear_rows; /* many rows against a packed int8 weight; may be NULL */
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
    const int32_t *neg; /* set: q, neg and scales are matmul_q8's packed form (many rows) */
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
    int64_t rows_min_work; /* linear_rows' parallel threshold */
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
                   float *y, int64_t parallel_min_bytes, int64_t rows_min_work) {
    if (p->neg)
        return f->linear_rows ? f->linear_rows(x, rows, p->k, p->q, p->neg, p->scales, p->n,
                                               p->bias, y, rows_min_work)
                              : 1;
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


/* --- The whole step in one parallel region --------------------------------------------
 *
 * Per call, every projection big enough to split opens its own OpenMP region, and under
 * the worker's passive wait policy (threads sleep between regions, so that a shared
 * machine keeps its cores) each region wakes the sleeping threads again: some 120 wake-ups
 * a SmolLM2-135M step. With `Step.threads` > 1 the step opens one region instead, and runs
 * as a list of phases, eight a layer: the small pieces (norms, rotary with the KV store
 * and attention, the gate), each run by whichever thread comes to it first, and the four
 * projections, each cut into chunks of output rows (whole units of 16, 8 or 4, the
 * kernels' groups, so every output is computed as the per-call path computes it, to the
 * bit) that the threads take one by one.
 *
 * The machine is shared: the services and the client wake on every token, and a thread
 * taken off its core by one of them must not hold the step. With fixed shares and a
 * barrier, the others waited for its share until the kernel scheduler gave its core back
 * (a step of 6 ms took 11-18). Here a thread that runs out of chunks while one taken by
 * another is still unfinished after `STEAL_NS` computes that chunk itself, into its own
 * scratch; whichever copy finishes first is committed (a compare-and-swap on the chunk's
 * state) and the other is thrown away. So a descheduled thread costs the step its chunk's
 * work once more, not its absence. Only a thread descheduled inside a small piece, or in
 * the copy of a committed chunk (a few hundred bytes), still holds the others; they spin
 * for a while and then sleep on the phase's futex word.
 *
 * A thread that falls behind finds the phases it missed done and walks through them; what
 * it computes for a chunk that was taken from it reads buffers of this call, which stay
 * alive until every thread has left the region, and is never written out. */
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
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

/* How long a thread waiting for a small piece spins before it sleeps: longer than those
 * pieces take (tens of microseconds), short against the timeslice of a process that took
 * the core of the thread running it. */
#define SPIN_NS 200000
/* How long a chunk may stay unfinished, once nothing is left to take, before a waiting
 * thread computes it too: at least this, and four times the slowest chunk the thread
 * computed of the same projection (a few microseconds at one row); short against a
 * timeslice. */
#define STEAL_NS 30000
/* Chunks a projection is cut into per thread: enough that the threads finish a projection
 * together, few enough that each call into a kernel still has rows to stream. */
#define CHUNKS_PER_THREAD 2
#define MOST_CHUNKS 32 /* of one weight (a segment's), whatever the threads */
#define MAX_SEGMENTS 8  /* q, k and v are three */
#define MAX_CHUNKS (MOST_CHUNKS * MAX_SEGMENTS)
#define PHASES_PER_LAYER 8

enum { FREE, TAKEN, COMMITTING, DONE };

typedef struct {
    _Atomic int next; /* chunks handed out (a small piece: 1 once a thread took it) */
    _Atomic int done; /* chunks whose outputs are in place (a small piece: 1 when run) */
    _Atomic int sleepers;
    _Atomic unsigned char state[MAX_CHUNKS];
} Phase;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* A projection's (or one of its segments') n output rows in `chunks` whole units. */
static int64_t unit_of(int64_t n) { return n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : n; }

static int chunks_of(int64_t n, int64_t threads) {
    int64_t most = CHUNKS_PER_THREAD * threads;
    most = most < MOST_CHUNKS ? most : MOST_CHUNKS;
    const int64_t units = n / unit_of(n);
    return (int)(units < most ? units : most);
}

typedef struct {
    const Segment *g; /* NULL: the projection's own weight */
    int64_t n0, n1, col;
} Piece;

static int total_chunks(const Projection *p, int64_t threads) {
    if (!p->num_segments) return chunks_of(p->n, threads);
    int total = 0;
    for (int64_t i = 0; i < p->num_segments; i++) total += chunks_of(p->segments[i].n, threads);
    return total;
}

static Piece chunk_piece(const Projection *p, int c, int64_t threads) {
    const Segment *g = NULL;
    int64_t n = p->n, col = 0;
    int k = 0;
    if (!p->num_segments) {
        k = chunks_of(n, threads);
    } else {
        for (int64_t i = 0; i < p->num_segments; i++) {
            g = p->segments + i;
            n = g->n;
            k = chunks_of(n, threads);
            if (c < k) break;
            c -= k;
            col += n;
        }
    }
    const int64_t unit = unit_of(n), units = n / unit;
    Piece piece = {g, unit * (c * units / k), unit * ((c + 1) * units / k), col};
    return piece;
}

/* Output rows [n0, n1) of one weight (a segment's, or the projection's own) into
 * out [rows, n1 - n0]. The kernels run on the slice of the weight (and of its scales and
 * bias) as on a whole one, on this thread alone. */
static int project_piece(const Kernels *f, const Projection *p, Piece c, const float *x,
                         int64_t rows, float *out) {
    const Segment *g = c.g;
    const int64_t n0 = c.n0, n = c.n1 - c.n0, k = p->k, alone = INT64_MAX;
    const float *bias = p->bias ? p->bias + c.col + n0 : NULL;
    if (g)
        return (p->integer ? f->linear_blocks_q8 : f->linear_blocks)(
            x, rows, k, g->blocks + n0 * g->row_bytes, (int)g->block_type, n, bias, out, alone);
    if (p->q)
        return f->linear_q8(x, rows, k, p->q + n0 * k, p->scales + n0, p->wsum + n0 * (k / 64),
                            n, bias, out, alone);
    if (p->blocks && p->integer)
        return f->linear_blocks_q8(x, rows, k, p->blocks + n0 * p->row_bytes,
                                   (int)p->block_type, n, bias, out, alone);
    if (p->blocks)
        return f->linear_blocks(x, rows, k, p->blocks + n0 * p->row_bytes, (int)p->block_type,
                                n, bias, out, alone);
    f->linear_f32(x, rows, k, p->w + n0 * k, n, bias, out, alone);
    return 0;
}

/* Chunks committed by a thread that did not take them (read by tests and benchmarks), and
 * a fault to inject: the next thread to take a chunk of phase `stall_phase` (counted from
 * the step's first) sleeps `stall_us` before it commits it, once. */
static _Atomic long stolen_chunks;
static _Atomic int stall_phase = -1, stall_us;

long decode_layers_stolen(void) { return atomic_load(&stolen_chunks); }

void decode_layers_stall_once(int phase, int us) {
    atomic_store(&stall_us, us);
    atomic_store(&stall_phase, phase);
}

static void maybe_stall(int phase) {
    int expected = phase;
    if (atomic_load(&stall_phase) == phase &&
        atomic_compare_exchange_strong(&stall_phase, &expected, -1)) {
        const struct timespec t = {0, (long)atomic_load(&stall_us) * 1000};
        nanosleep(&t, NULL);
    }
}

/* Computes chunk c into scratch and, unless another thread's copy was committed first
 * (its state no longer `seen`), writes it into y [rows, p->n] and counts it done. `mine`:
 * this thread took the chunk (else it computes one another thread took). */
static void run_chunk(const Kernels *f, const Projection *p, Phase *ph, int c, int seen,
                      int mine, const float *x, int64_t rows, float *y, float *scratch,
                      int64_t threads, _Atomic int *failed, int phase) {
    const Piece piece = chunk_piece(p, c, threads);
    const int code = project_piece(f, p, piece, x, rows, scratch);
    if (mine) maybe_stall(phase);
    unsigned char expected = (unsigned char)seen;
    if (!atomic_compare_exchange_strong(&ph->state[c], &expected, COMMITTING)) return;
    if (!mine) atomic_fetch_add(&stolen_chunks, 1);
    if (code != 0) atomic_store(failed, -100 + code);
    const int64_t n = piece.n1 - piece.n0;
    for (int64_t r = 0; r < rows; r++)
        memcpy(y + r * p->n + piece.col + piece.n0, scratch + r * n, (size_t)n * sizeof(float));
    atomic_store(&ph->state[c], DONE);
    atomic_fetch_add(&ph->done, 1);
}

/* This thread's part of a projection: chunks while any are left to take, then, until
 * every chunk is done, the chunks another thread took and has not finished. */
static void share_phase(const Kernels *f, const Projection *p, Phase *ph, const float *x,
                        int64_t rows, float *y, float *scratch, int64_t threads,
                        _Atomic int *failed, int phase) {
    const int chunks = total_chunks(p, threads);
    uint64_t patience = STEAL_NS; /* several times this thread's slowest chunk, at least */
    for (int c; (c = atomic_fetch_add(&ph->next, 1)) < chunks;) {
        unsigned char expected = FREE;
        if (atomic_compare_exchange_strong(&ph->state[c], &expected, TAKEN)) {
            const uint64_t start = now_ns();
            run_chunk(f, p, ph, c, TAKEN, 1, x, rows, y, scratch, threads, failed, phase);
            const uint64_t took = 4 * (now_ns() - start);
            patience = took > patience ? took : patience;
        }
    }
    uint64_t since = 0;
    for (unsigned spins = 1; atomic_load(&ph->done) < chunks; spins++) {
        if (spins % 64) {
            spin_pause();
            continue;
        }
        const uint64_t now = now_ns();
        if (!since) since = now;
        if (now - since < patience) continue;
        int stole = 0;
        for (int c = 0; c < chunks; c++) {
            const int seen = atomic_load(&ph->state[c]);
            if (seen == FREE || seen == TAKEN) {
                run_chunk(f, p, ph, c, seen, 0, x, rows, y, scratch, threads, failed, phase);
                stole = 1;
            }
        }
        if (!stole) sched_yield(); /* a committing copy: its thread needs a core */
        since = now_ns();
    }
}

/* A small piece: the first thread to come runs it, the others wait for it. True for the
 * thread that runs it. */
static int take_piece(Phase *ph) { return atomic_fetch_add(&ph->next, 1) == 0; }

static void piece_done(Phase *ph) {
    atomic_store(&ph->done, 1);
    if (atomic_load(&ph->sleepers) > 0)
        syscall(SYS_futex, &ph->done, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void await_piece(Phase *ph) {
    const uint64_t deadline = now_ns() + SPIN_NS;
    for (unsigned spins = 1; !atomic_load(&ph->done); spins++) {
        if (spins % 256 == 0 && now_ns() > deadline) {
            /* A sleeper counted before `done` is read again: the runner either sees it and
             * wakes it, or set `done` first, and the wait returns at once. */
            atomic_fetch_add(&ph->sleepers, 1);
            while (!atomic_load(&ph->done))
                syscall(SYS_futex, &ph->done, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
            atomic_fetch_sub(&ph->sleepers, 1);
            return;
        }
        spin_pause();
    }
}

static int decode_layers_together(const Kernels *f, const Layer *layers, int64_t num_layers,
                                  const Step *s, int widest) {
    const int64_t r = s->rows, d = s->head_dim, threads = s->threads;
    const int64_t q_width = s->q_heads * d, kv_width = s->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    Phase *phases = calloc((size_t)(num_layers * PHASES_PER_LAYER), sizeof(Phase));
    if (!phases) return -100 + 1;
    _Atomic int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        float *scratch = malloc((size_t)(r * widest) * sizeof(float));
        if (!scratch) atomic_store(&failed, -100 + 1);
        Phase *ph = phases;
/* The first thread to come runs the piece, the others wait for it. */
#define ALONE(body)                  \
    do {                             \
        if (take_piece(ph)) {        \
            body;                    \
            piece_done(ph);          \
        } else {                     \
            await_piece(ph);         \
        }                            \
        ph++;                        \
    } while (0)
#define SHARE(proj, in, out)                                                           \
    do {                                                                               \
        share_phase(f, &layer->proj, ph, in, r, out, scratch, threads, &failed,      \
                    (int)(ph - phases));                                               \
        ph++;                                                                          \
    } while (0)
        for (int64_t l = 0; l < num_layers && scratch && !atomic_load(&failed); l++) {
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
            if (atomic_load(&failed)) break;
            ALONE({
                int c = f->rotary(s->qkv, r, qkv_width, s->q_heads + s->kv_heads, d,
                                  s->positions, s->cos_table, s->sin_table, s->max_pos);
                if (c != 0) {
                    atomic_store(&failed, -200 + c);
                } else if ((c = f->store_kv(s->qkv + q_width, qkv_width,
                                            s->qkv + q_width + kv_width, qkv_width,
                                            layer->k_cache, layer->v_cache, s->slots, r,
                                            kv_width, s->num_slots)) != 0) {
                    atomic_store(&failed, -300 + c);
                } else if ((c = f->attention(s->qkv, qkv_width, d, layer->k_cache,
                                             layer->v_cache, s->block_tables, s->bt_stride,
                                             s->context_lens, s->query_start, s->attn, r,
                                             s->q_heads, s->kv_heads, d, s->block_size,
                                             s->scale)) != 0) {
                    atomic_store(&failed, -400 + c);
                }
            });
            if (atomic_load(&failed)) break;
            SHARE(o, s->attn, s->x);
            if (atomic_load(&failed)) break;
            ALONE(f->add_rms_norm(s->x, s->residual, layer->ffn_norm, s->eps, s->h, r,
                                  s->hidden));
            SHARE(gate_up, s->h, s->gate_up);
            if (atomic_load(&failed)) break;
            ALONE(f->silu_mul(s->gate_up, s->act, r, s->inter));
            SHARE(down, s->act, s->x);
        }
#undef ALONE
#undef SHARE
        free(scratch);
    }
    free(phases);
    return atomic_load(&failed);
}

/* Returns 0; else the failing kernel's code plus a tag of its kind: -100 + c for a
 * projection, -200 + c for rotary (a position out of range), -300 + c for the KV store (a
 * slot past the cache), -400 + c for attention (out of memory). */
int decode_layers(const Kernels *f, const Layer *layers, int64_t num_layers, const Step *s) {
    if (s->threads > 1) {
        int64_t widest = 0; /* the most output rows one projection has */
        int segments = 0;   /* the most segments one projection has */
        int packed = 0;     /* a many-row form: kernel by kernel */
        for (int64_t l = 0; l < num_layers; l++) {
            const Layer *y = layers + l;
            const Projection *p[4] = {&y->qkv, &y->o, &y->gate_up, &y->down};
            for (int i = 0; i < 4; i++) {
                widest = p[i]->n > widest ? p[i]->n : widest;
                segments = p[i]->num_segments > segments ? (int)p[i]->num_segments : segments;
                packed |= p[i]->neg != NULL;
            }
        }
        if (segments <= MAX_SEGMENTS && !packed)
            return decode_layers_together(f, layers, num_layers, s, (int)widest);
    }
    const int64_t r = s->rows, d = s->head_dim;
    const int64_t q_width = s->q_heads * d, kv_width = s->kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t pb = s->parallel_min_bytes, rw = s->rows_min_work;
    int code;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *layer = layers + l;
        if (l == 0) {
            memcpy(s->residual, s->x, (size_t)(r * s->hidden) * sizeof(float));
            f->add_rms_norm(NULL, s->residual, layer->attn_norm, s->eps, s->h, r, s->hidden);
        } else {
            f->add_rms_norm(s->x, s->residual, layer->attn_norm, s->eps, s->h, r, s->hidden);
        }
        if ((code = project(f, &layer->qkv, s->h, r, s->qkv, pb, rw)) != 0)
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
        if ((code = project(f, &layer->o, s->attn, r, s->x, pb, rw)) != 0)
            return -100 + code;
        f->add_rms_norm(s->x, s->residual, layer->ffn_norm, s->eps, s->h, r, s->hidden);
        if ((code = project(f, &layer->gate_up, s->h, r, s->gate_up, pb, rw)) != 0)
            return -100 + code;
        f->silu_mul(s->gate_up, s->act, r, s->inter);
        if ((code = project(f, &layer->down, s->act, r, s->x, pb, rw)) != 0)
            return -100 + code;
    }
    return 0;
}
