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
 * reads it, its outputs side by side as torch.cat puts them. On return x and residual hold
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
} Segment;

typedef struct {
    const float *w;         /* float32 [n, k], or NULL when q, blocks or segments is set */
    const int8_t *q;        /* int8 [n, k] */
    const float *scales;    /* [n] */
    const float *wsum;      /* [n, k / 64] */
    const uint8_t *blocks;  /* the model file's blocks of the float32 weight's values */
    int64_t block_type;
    int64_t integer;        /* blocks read with x quantized to int8 (linear_blocks_q8) */
    const float *bias;      /* [n] or NULL */
    int64_t n, k;
    const Segment *segments; /* row segments of blocks (float32 values), in order */
    int64_t num_segments;
} Projection;

typedef struct {
    const float *attn_norm, *ffn_norm;
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* float32 or bfloat16: `store_kv` and `attention` match it */
} Layer;

typedef struct {
    int64_t rows, hidden, q_heads, kv_heads, head_dim, inter, block_size, num_slots, max_pos;
    int64_t bt_stride, parallel_min_bytes;
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
        code = f->linear_blocks(x, rows, p->k, g->blocks, (int)g->block_type, g->n,
                                p->bias ? p->bias + col : NULL, out, parallel_min_bytes);
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

/* Returns 0; else the failing kernel's code plus a tag of its kind: -100 + c for a
 * projection, -200 + c for rotary (a position out of range), -300 + c for the KV store (a
 * slot past the cache), -400 + c for attention (out of memory). */
int decode_layers(const Kernels *f, const Layer *layers, int64_t num_layers, const Step *s) {
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
