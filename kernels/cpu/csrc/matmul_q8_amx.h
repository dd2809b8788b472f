/* The many-row int8 product of matmul_q8.c on AMX's tile unit (included by it, after its
 * quantization, VNNI tiles and store_tile; built only with -mamx-tile -mamx-int8).
 *
 * The packed weight is AMX's B layout as it is: one block of 64 k of one group is 16 rows
 * of 64 bytes (16 outputs x 4 consecutive k), stride 64. An A tile is 16 input rows x the
 * block's 64 bytes (stride k); a C tile (16 rows x 16 int32) starts as `neg` loaded with
 * stride 0 (every row the same 16 values), so `tdpbusd` (unsigned x by signed w, as VNNI's
 * dpbusd) leaves the same int32 block sums the VNNI tile holds. Each block's sums are
 * stored, turned to float and multiplied by the row's block scale into float accumulators
 * in the same order as the VNNI path, then store_tile applies the weight scales and bias:
 * the outputs are the VNNI path's to the bit.
 *
 * A span of up to 128 rows and a pair of groups (32 outputs) goes block by block: the two
 * B tiles are loaded once per block, then each step of 16 rows loads its A tile and two C
 * tiles and runs two tdpbusd; step j's products start between step j - 1's tile stores and
 * its float epilogue, so the tile unit works while the vector units scale. The span's
 * float accumulators (16 KB) stay in L1. Rows past the last multiple of 16 go through the
 * VNNI tiles. Linux grants the tile data state per process on request
 * (`matmul_q8_amx_init`, once); each thread loads its own tile configuration (on the
 * kernels' shared helper threads, once per item: `amx_item`).
 *
 * What bounds it: the per-block epilogue. The tile unit does a block of 32 x 32 outputs
 * (65536 products) in about 21 ns on the Xeon this was written on, storing its four C
 * tiles takes about 21 ns more, and their cvt + fma about 45 ns, and the vector loads of
 * the stored sums wait for the tile stores: about 130 ns in all, some 500 G products/s a
 * core. Four C tiles a block (32 x 32, accumulators in L1), two with the stores and scaling
 * of one step overlapping the next (this), and one 16 x 16 tile with its accumulators in
 * registers all measured within a few percent of each other; the epilogue cannot be
 * skipped, since each block's int32 sums must become float before the next block's, as
 * on VNNI, for the outputs to match.
 */
#if defined(WIDE) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16 /* rows of an A or C tile */
#define SPAN 128    /* rows whose float accumulators a pass keeps (16 KB) */

/* Palette 1's 64-byte configuration. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused */

int matmul_q8_amx(void) { return 1; }

/* Asks Linux for the tile data state (process-wide, inherited by every thread); 0 when
 * granted. Without it the first tile instruction would kill the process. */
int matmul_q8_amx_init(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1 ? 0 : -1;
}

static void load_tile_config(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {  /* tmm0-3 C, tmm4-5 A, tmm6-7 B: 16 rows of 64 bytes */
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* acc[r][0..15] += float(c[r][0..15]) * s[r * nb] for the 16 rows of one C tile (fma, the
 * VNNI tile's operation). */
static inline void scale_block(const int32_t c[AMX_ROWS][COLS], const float *s, int64_t nb,
                               float *acc, int64_t acc_stride) {
    for (int r = 0; r < AMX_ROWS; r++) {
        float *a = acc + r * acc_stride;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c[r]));
        _mm512_store_ps(a, _mm512_fmadd_ps(sum, _mm512_set1_ps(s[r * nb]), _mm512_load_ps(a)));
    }
}

/* Tiles: C sums of the even (tmm0, tmm1) and odd (tmm2, tmm3) steps of 16 rows, A of the
 * even (tmm4) and odd (tmm5) steps, B of the block's first and second group (tmm6, tmm7).
 * Step j's products start (ISSUE) between step j - 1's tile stores and its float epilogue,
 * so the tile unit works while the vector units scale the previous step's sums. */
#define ISSUE(c0, c1, a, x, nc)                   \
    do {                                          \
        _tile_loadd(c0, nb0, 0);                  \
        if (nc == 2) _tile_loadd(c1, nb1, 0);     \
        _tile_loadd(a, x, k);                     \
        _tile_dpbusd(c0, a, 6);                   \
        if (nc == 2) _tile_dpbusd(c1, a, 7);      \
    } while (0)
#define STORE(c0, c1, buf, nc)                    \
    do {                                          \
        _tile_stored(c0, buf[0], 64);             \
        if (nc == 2) _tile_stored(c1, buf[1], 64); \
    } while (0)

/* Rows i0 .. i0 + rows - 1 (a multiple of 16, at most SPAN) of groups g0 .. g0 + nc - 1:
 * block by block, each block's B tiles loaded once for all the span's rows (the float
 * accumulators, 128 B a row, stay in L1). `next`: weights to fetch into L2 meanwhile. */
static inline void amx_span(const uint8_t *restrict xq, const float *restrict sx, int64_t i0,
                            int64_t rows, const int8_t *restrict w,
                            const int32_t *restrict neg, int64_t g0, const int nc, int64_t k,
                            const float *scales, const float *bias, float *y, int64_t n,
                            const int8_t *next) {
    const int64_t nb = k / QB, steps = rows / AMX_ROWS;
    _Alignas(64) float acc[SPAN][2 * COLS];
    _Alignas(64) int32_t c[2][2][AMX_ROWS][COLS];
    memset(acc, 0, (size_t)rows * sizeof acc[0]);
    const int8_t *w0 = w + g0 * k * COLS, *w1 = w + (g0 + 1) * k * COLS;
    const int32_t *n0 = neg + g0 * nb * COLS, *n1 = neg + (g0 + 1) * nb * COLS;
    for (int64_t b = 0; b < nb; b++) {
        if (next)
            for (int l = 0; l < 2 * QB * COLS; l += 64)
                _mm_prefetch((const char *)next + b * 2 * QB * COLS + l, _MM_HINT_T1);
        _tile_loadd(6, w0 + b * QB * COLS, QB);
        if (nc == 2) _tile_loadd(7, w1 + b * QB * COLS, QB);
        const int32_t *nb0 = n0 + b * COLS, *nb1 = n1 + b * COLS;
        const uint8_t *xb = xq + i0 * k + b * QB;
        const float *sb = sx + i0 * nb + b;
        ISSUE(0, 1, 4, xb, nc);
        for (int64_t j = 1; j < steps; j++) {
            const int64_t r = (j - 1) * AMX_ROWS; /* the step scaled now */
            if (j & 1) {
                STORE(0, 1, c[0], nc);
                ISSUE(2, 3, 5, xb + j * AMX_ROWS * k, nc);
            } else {
                STORE(2, 3, c[1], nc);
                ISSUE(0, 1, 4, xb + j * AMX_ROWS * k, nc);
            }
            const int p = (j - 1) & 1;
            scale_block(c[p][0], sb + r * nb, nb, &acc[r][0], 2 * COLS);
            if (nc == 2) scale_block(c[p][1], sb + r * nb, nb, &acc[r][COLS], 2 * COLS);
        }
        const int64_t r = (steps - 1) * AMX_ROWS;
        const int p = (steps - 1) & 1;
        if (p) STORE(2, 3, c[1], nc);
        else STORE(0, 1, c[0], nc);
        scale_block(c[p][0], sb + r * nb, nb, &acc[r][0], 2 * COLS);
        if (nc == 2) scale_block(c[p][1], sb + r * nb, nb, &acc[r][COLS], 2 * COLS);
    }
    /* store_tile's arithmetic, four rows at a time */
    for (int64_t r = 0; r < rows; r += ROWS) {
        __m512 v[ROWS][GROUPS];
        for (int i = 0; i < ROWS; i++)
            for (int g = 0; g < nc; g++) v[i][g] = _mm512_load_ps(&acc[r + i][g * COLS]);
        store_tile(i0 + r, ROWS, g0, nc, scales, bias, y, n, v);
    }
}
#undef ISSUE
#undef STORE

/* Every span of the tiled rows for groups g0 .. g0 + 1 (or g0 alone at the end); `next`:
 * the groups whose weights the first span fetches into L2 (those a thread takes next). */
static void amx_pair(const Strips *s, int64_t tiled, int64_t g0, int64_t next_g0) {
    for (int64_t i0 = 0; i0 < tiled; i0 += SPAN) {
        const int64_t rows = min64(SPAN, tiled - i0);
        /* The first span fetches the thread's next weights into L2 (1 KB per block and
           group, as these are read): the tile loads would otherwise wait on memory one
           line at a time. */
        const int8_t *next = i0 == 0 && next_g0 < s->groups ? s->w + next_g0 * s->k * COLS : NULL;
        if (s->groups - g0 >= 2)
            amx_span(s->xq, s->sx, i0, rows, s->w, s->neg, g0, 2, s->k, s->scales, s->bias,
                     s->y, s->n, next);
        else
            amx_span(s->xq, s->sx, i0, rows, s->w, s->neg, g0, 1, s->k, s->scales, s->bias,
                     s->y, s->n, next);
    }
}

typedef struct {
    Strips s;
    int64_t tiled, pairs;
} AmxCall;

/* A pool item: a pair of groups over the tiled rows (items 0 .. pairs - 1), else a strip of
 * GROUPS groups over the rows past the last multiple of 16 (VNNI): no two write the same
 * outputs. Each item loads its thread's tile configuration and releases it. On the pool a
 * call no longer waits for a sleeping OpenMP thread to wake and check in (two barriers a
 * call): on a 2-core Sapphire Rapids Xeon a 64-row SmolLM2-135M decode step
 * (`bench.p1_step --quantize int8 --kv-cache-dtypes bfloat16`, alternated, two pairs) took
 * 68.4 and 68.6 ms against 74.8 and 80.5, its 576 x 576 products 4.4 ms against 6.4-7.0. */
static void amx_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const AmxCall *a = ctx;
    const Strips *s = &a->s;
    if (item < a->pairs) {
        load_tile_config();
        /* the pair two items on: the next one a thread takes where two share the items */
        amx_pair(s, a->tiled, 2 * item, 2 * item + 4);
        _tile_release();
        return;
    }
    const int64_t g0 = (item - a->pairs) * GROUPS;
    rows_vnni(s->xq, s->sx, a->tiled, s->m, s->w, s->neg, s->scales, s->n, s->bias, s->y, g0,
              (int)min64(GROUPS, s->groups - g0), s->k);
}

/* linear_q8_rows on the tile unit; -3 where the tile state was not granted
 * (matmul_q8_amx_init). Fewer than 16 rows run linear_q8_rows itself. */
int linear_q8_rows_amx(const float *x, int64_t m, int64_t k, const int8_t *w, const int32_t *neg,
                       const float *scales, int64_t n, const float *bias, float *y,
                       int64_t parallel_min_work) {
    if (amx_state != 1) return -3;
    if (m < AMX_ROWS) return linear_q8_rows(x, m, k, w, neg, scales, n, bias, y, parallel_min_work);
    if (k % QB != 0 || n % COLS != 0) return -2;
    const int64_t groups = n / COLS, tiled = m - m % AMX_ROWS;
    uint8_t *xq;
    float *sx;
    if (quantize_rows(x, m, k, &xq, &sx) != 0) return -1;
    const int parallel = m * n * k >= parallel_min_work;
    const AmxCall call = {{xq, sx, m, k, n, groups, w, neg, scales, bias, y}, tiled,
                          (groups + 1) / 2};
    const int64_t strips = tiled < m ? (groups + GROUPS - 1) / GROUPS : 0;
    if (parallel && pool_took(shared_pool, amx_item, (void *)&call, call.pairs + strips)) {
        free(xq);
        free(sx);
        return 0;
    }
#pragma omp parallel if (parallel)
    {
        load_tile_config();
        /* A pair of groups' weights (32 k bytes) stay in L1 or L2 over all the spans of
           rows; the rows' quantized values (m k bytes) are read again for each pair. */
#pragma omp for schedule(static) nowait
        for (int64_t g0 = 0; g0 < groups; g0 += 2) amx_pair(&call.s, tiled, g0, g0 + 2);
#pragma omp for schedule(static)
        for (int64_t g0 = 0; g0 < groups; g0 += GROUPS)
            rows_vnni(xq, sx, tiled, m, w, neg, scales, n, bias, y, g0,
                      (int)min64(GROUPS, groups - g0), k);
        _tile_release();
    }
    free(xq);
    free(sx);
    return 0;
}
#endif
