/* Many rows against a weight kept in the model file's blocks (included by matvec.c, whose
 * dequantizer it uses): y [M, N] (row stride ldy) = x [M, K] W^T (+ b), with no float32
 * copy of W bigger than one panel.
 *
 * The tiled product (quantized_weight.TiledProduct) dequantized 4 MiB of W at a time into
 * memory and gave it to BLAS, which copied it once more into its own packed layout before
 * multiplying: on a 2-core EPYC (Zen 3) those two passes were a fifth of an exact-mode
 * P1 step (BLAS's packing 14% of the worker's samples, the dequantization 7%). Here each
 * thread dequantizes a panel of GEMM_NP rows of W into a buffer and runs every row of x
 * against it while it is hot. Two register tiles:
 *
 *   AVX2: the panel transposed 8 x 8 at a time to [K][16] (36 KiB at K = 576), a tile of
 *     6 rows of x x 16 outputs (12 accumulators, two panel loads and six broadcasts per k).
 *   AVX-512: x transposed once per call to [K][rows] (groups of 64 rows, four vectors of
 *     16), W's panel of 24 rows left as the dequantizer writes them (in chunks of 32 values
 *     of k, so that the tile reads every row at a fixed offset), and a tile of up to 4
 *     vectors of rows x 6 outputs: 24 accumulators, four loads of x and six broadcasts of
 *     W per k, over k in blocks of GEMM_KC whose x stays in L1 for the panel's four tiles.
 *     On a 2-core Sapphire Rapids Xeon the AVX2-shaped tile widened to 512 bits (12 rows x
 *     16 outputs, W's panel transposed) ran at 89-99 GFLOP/s a thread at 64 rows: the
 *     transposition took a quarter of its time (0.27 of 2.45 ms for a 3072 x 576 Q4_1
 *     weight) and its thirteen loads per twelve multiply-adds held the tile itself to 140
 *     of the core's 165. This one transposes M x 24 sums per panel, not K x 24 weights:
 *     117-121 GFLOP/s a thread, 204-213 on two (167-177 before); at 512 rows against a
 *     576 x 1536 weight, where x (3 MiB) leaves L2, level with the old tile (195-200
 *     against 202-213).
 *
 * Each output is one float32 sum over k in order, fused multiply-adds, whatever M or the
 * thread count (the blocks' values are gguf-py's to the bit, as dequantize_rows makes
 * them): a float32 product like BLAS's, summed in another order. Both tiles give the same
 * sums. Threads (the pool, or OpenMP) split the panels. */
#if defined(__AVX2__) && defined(__FMA__)
/* 8 x 8 floats: src rows (stride ld) -> dst rows (stride ldd), transposed. */
static inline void transpose8(const float *src, int64_t ld, float *dst, int64_t ldd) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {
        const int a = 4 * h;
        s[a] = _mm256_shuffle_ps(t[a], t[a + 2], 0x44);
        s[a + 1] = _mm256_shuffle_ps(t[a], t[a + 2], 0xEE);
        s[a + 2] = _mm256_shuffle_ps(t[a + 1], t[a + 3], 0x44);
        s[a + 3] = _mm256_shuffle_ps(t[a + 1], t[a + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    }
}

/* One call's arguments (`linear_blocks_rows`), and the pool's per-worker buffers. */
typedef struct {
    const float *x;
    int64_t m, k, n, values, bytes, row_bytes, ldy;
    const uint8_t *w;
    int type;
    const float *bias;
    float *y;
    float *xt; /* x transposed (pack_x), where the tile reads it so */
    size_t panel_bytes, sums_bytes;
    float *scratch[MOST_WORKERS][2]; /* a worker's two buffers */
    _Atomic int failed;
} PanelCall;

#if defined(__AVX512F__)
#define GEMM_NP 24 /* outputs (rows of W) per panel */
#define GEMM_CW 32 /* values of k per chunk of the panel */
#define GEMM_RG 64 /* rows of x per group: four vectors of 16 */
#define GEMM_AHEAD 2 /* panels whose blocks are prefetched while one is computed */
#define GEMM_KC 128 /* values of k per block of the tiles (a multiple of GEMM_CW) */

/* Rows g0 .. g0 + rows - 1 of x [., k], values k0 .. k1 - 1, into their group's block of
 * xt: each group's [k][ld] block at xt + g0 k (g0 a multiple of 64; ld its rows rounded up
 * to 16, the extra rows zeros). */
static void pack_x(const float *x, int64_t m, int64_t k, int64_t g0, int64_t k0, int64_t k1,
                   float *xt) {
    const int64_t rows = min64(GEMM_RG, m - g0), ld = (rows + 15) / 16 * 16;
    const float *src = x + g0 * k;
    float *dst = xt + g0 * k;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
        int64_t kk = k0;
        for (; kk + 8 <= k1; kk += 8) transpose8(src + r * k + kk, k, dst + kk * ld + r, ld);
        for (; kk < k1; kk++)
            for (int i = 0; i < 8; i++) dst[kk * ld + r + i] = src[(r + i) * k + kk];
    }
    for (; r < ld; r++)
        for (int64_t kk = k0; kk < k1; kk++) dst[kk * ld + r] = r < rows ? src[r * k + kk] : 0.0f;
}

/* n (<= 32) floats from src to dst, the rest of dst's 32 zeros. */
static inline void chunk_copy(const float *src, int64_t n, float *dst) {
    const __mmask16 lo = (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u);
    const __mmask16 hi = (__mmask16)(n >= 32 ? 0xFFFFu : n <= 16 ? 0u : (1u << (n - 16)) - 1u);
    _mm512_store_ps(dst, _mm512_maskz_loadu_ps(lo, src));
    _mm512_store_ps(dst + 16, _mm512_maskz_loadu_ps(hi, src + 16));
}

/* Rows j0 .. j0 + cols - 1 of W -> wb: chunk ch of row j (values 32 ch ..) at
 * wb + (ch GEMM_NP + j) 32; rows from cols on are zeros. Blocks of 32 values are
 * dequantized in place; others (K-quants, 16-bit floats) a row at a time into `row` (k
 * floats of scratch) and copied. */
static void dq_panel(const PanelCall *c, int64_t j0, int cols, float *row, float *wb) {
    const int64_t k = c->k, stride = GEMM_NP * GEMM_CW;
    const int in_place = c->values == GEMM_CW;
    for (int j = 0; j < GEMM_NP; j++) {
        float *dst = wb + j * GEMM_CW;
        const uint8_t *src = c->w + (j0 + j) * c->row_bytes;
        if (j < cols && in_place) {
            for (int64_t ch = 0; ch * GEMM_CW < k; ch++)
                dq_block_values(src + ch * c->bytes, c->type, dst + ch * stride);
            continue;
        }
        if (j < cols) dq_rows(src, c->type, c->values, c->bytes, 1, k, row);
        for (int64_t ch = 0, k0 = 0; k0 < k; ch++, k0 += GEMM_CW)
            chunk_copy(row + k0, j < cols ? min64(GEMM_CW, k - k0) : 0, dst + ch * stride);
    }
}

/* out [nj][16 mv] = outputs j .. j + nj - 1 of the group's rows over values k0 .. k1 - 1
 * (a multiple of 32 apart but at the end), added to the sums in `out` from earlier values
 * unless k0 is 0 (mv, nj literals at each call: each its own unrolled loop). Each output is
 * one chain of fused multiply-adds over k in order (w x + s, the AVX2 tile's x w + s): its
 * float32 sum stored between blocks of k and loaded back unchanged. */
static inline __attribute__((always_inline)) void gemm_tile(const float *restrict xt, int64_t k0,
                                                            int64_t k1, const int mv, const int nj,
                                                            const float *restrict wb, int j,
                                                            float *restrict out) {
    __m512 c[24]; /* nj mv of them */
    const int64_t ld = 16 * mv;
#pragma GCC unroll 24
    for (int i = 0; i < nj; i++)
#pragma GCC unroll 4
        for (int v = 0; v < mv; v++)
            c[i * mv + v] = k0 ? _mm512_load_ps(out + i * ld + 16 * v) : _mm512_setzero_ps();
    for (int64_t k = k0, ch = k0 / GEMM_CW; k < k1; k += GEMM_CW, ch++) {
        const float *w = wb + (ch * GEMM_NP + j) * GEMM_CW;
        const float *a = xt + k * ld;
        const int64_t n = min64(GEMM_CW, k1 - k);
        for (int64_t t = 0; t < n; t++) {
            __m512 av[4];
#pragma GCC unroll 4
            for (int v = 0; v < mv; v++) av[v] = _mm512_load_ps(a + t * ld + 16 * v);
#pragma GCC unroll 24
            for (int i = 0; i < nj; i++) {
                const __m512 b = _mm512_set1_ps(w[i * GEMM_CW + t]);
#pragma GCC unroll 4
                for (int v = 0; v < mv; v++) c[i * mv + v] = _mm512_fmadd_ps(b, av[v], c[i * mv + v]);
            }
        }
    }
#pragma GCC unroll 24
    for (int i = 0; i < nj; i++)
#pragma GCC unroll 4
        for (int v = 0; v < mv; v++) _mm512_store_ps(out + i * ld + 16 * v, c[i * mv + v]);
}

/* Outputs j0 .. j0 + 23 of every row: W's panel dequantized, then each group of rows'
 * tiles, their [24][rows] sums written into y's columns (+ bias). */
static void panel_outputs(const PanelCall *c, int64_t j0, float *wb, float *out) {
    const int64_t m = c->m, k = c->k;
    const int cols = (int)min64(GEMM_NP, c->n - j0);
    dq_panel(c, j0, cols, out, wb);
    /* The next panels' blocks (two threads' next items) on their way to L2 while this
     * one's tiles run: a panel's rows are a few KiB, too short a run for the hardware
     * prefetcher, and a step streams every layer's weights from memory. Interleaved on the
     * 2-core Xeon, 64 rows against 30 weights of 3072 x 576 Q4_1 in turn, medians of six
     * runs: 143 -> 153 GFLOP/s (noisy: each side's runs spread 135-180). */
    const int64_t next = min64(j0 + GEMM_NP, c->n);
    const int64_t after = min64(j0 + (1 + GEMM_AHEAD) * GEMM_NP, c->n);
    const char *from = (const char *)(c->w + next * c->row_bytes);
    for (int64_t at = 0; at < (after - next) * c->row_bytes; at += 64)
        _mm_prefetch(from + at, _MM_HINT_T1);
    for (int64_t g0 = 0; g0 < m; g0 += GEMM_RG) {
        const int64_t rows = min64(GEMM_RG, m - g0);
        const int mv = (int)((rows + 15) / 16);
        const int64_t ld = 16 * mv;
        const float *xt = c->xt + g0 * k;
        /* k in blocks whose x (GEMM_KC x 64 floats) stays in L1 for all the panel's tiles */
        for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
            const int64_t k1 = min64(k0 + GEMM_KC, k);
            switch (mv) {
            case 4:
                for (int j = 0; j < GEMM_NP; j += 6) gemm_tile(xt, k0, k1, 4, 6, wb, j, out + j * ld);
                break;
            case 3:
                for (int j = 0; j < GEMM_NP; j += 8) gemm_tile(xt, k0, k1, 3, 8, wb, j, out + j * ld);
                break;
            case 2:
                for (int j = 0; j < GEMM_NP; j += 12) gemm_tile(xt, k0, k1, 2, 12, wb, j, out + j * ld);
                break;
            default: gemm_tile(xt, k0, k1, 1, 24, wb, 0, out); break;
            }
        }
        const float *b = c->bias ? c->bias + j0 : NULL;
        float *y = c->y + g0 * c->ldy + j0;
        int64_t r = 0;
        if (cols == GEMM_NP) /* whole panels: eight rows at a time, transposed 8 x 8 */
            for (; r + 8 <= rows; r += 8) {
                for (int j = 0; j < GEMM_NP; j += 8)
                    transpose8(out + j * ld + r, ld, y + r * c->ldy + j, c->ldy);
                if (b)
                    for (int i = 0; i < 8; i++)
                        for (int j = 0; j < GEMM_NP; j++) y[(r + i) * c->ldy + j] += b[j];
            }
        for (; r < rows; r++)
            for (int j = 0; j < cols; j++)
                y[r * c->ldy + j] = b ? out[j * ld + r] + b[j] : out[j * ld + r];
    }
}

/* The two scratch buffers' floats: W's panel, and the tile's sums (also one row of W as
 * it is dequantized). */
static int64_t panel_floats(int64_t k) { return GEMM_NP * ((k + GEMM_CW - 1) / GEMM_CW) * GEMM_CW; }
static int64_t sums_floats(int64_t k) { return k > GEMM_NP * GEMM_RG ? k : GEMM_NP * GEMM_RG; }
#define GEMM_PACKS_X 1
#else
#define GEMM_NP 16 /* outputs (rows of W) per panel */
#define GEMM_MR 6

/* rows [16][k] (row-major) -> panel [k][16]. */
static void panel_of(const float *rows, int64_t k, float *panel) {
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        transpose8(rows + kk, k, panel + kk * GEMM_NP, GEMM_NP);
        transpose8(rows + 8 * k + kk, k, panel + kk * GEMM_NP + 8, GEMM_NP);
    }
    for (; kk < k; kk++)
        for (int j = 0; j < GEMM_NP; j++) panel[kk * GEMM_NP + j] = rows[j * k + kk];
}

typedef __m256 GemmAcc[GEMM_MR][2];

/* acc[r] = x[r, :] . panel for mr (a literal at each call) rows of x. */
static inline __attribute__((always_inline)) void gemm_tile(const float *restrict x, int64_t k,
                                                            const int mr,
                                                            const float *restrict panel,
                                                            GemmAcc acc) {
    /* Local sums, copied out once: summed into `acc` itself, GCC stored all twelve to the
     * stack on every k (store-bound at a third of the FMA rate). */
    __m256 c[GEMM_MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 b0 = _mm256_load_ps(panel + kk * GEMM_NP);
        const __m256 b1 = _mm256_load_ps(panel + kk * GEMM_NP + 8);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * k + kk);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        acc[r][0] = c[r][0];
        acc[r][1] = c[r][1];
    }
}

/* The tile's sums (+ bias) into y's rows; only the first `cols` outputs where the panel
 * runs past N. */
static inline void store_gemm(GemmAcc acc, int mr, const float *bias, int cols,
                              float *y, int64_t ldy) {
    for (int r = 0; r < mr; r++) {
        __m256 lo = acc[r][0], hi = acc[r][1];
        if (bias && cols == GEMM_NP) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
        }
        float *out = y + r * ldy;
        if (cols == GEMM_NP) {
            _mm256_storeu_ps(out, lo);
            _mm256_storeu_ps(out + 8, hi);
        } else {
            float tmp[GEMM_NP];
            _mm256_storeu_ps(tmp, lo);
            _mm256_storeu_ps(tmp + 8, hi);
            for (int j = 0; j < cols; j++) out[j] = bias ? tmp[j] + bias[j] : tmp[j];
        }
    }
}

/* Outputs j0 .. j0 + 15 of every row: the panel dequantized, then the row tiles. */
static void panel_outputs(const PanelCall *c, int64_t j0, float *rows, float *panel) {
    const int64_t m = c->m, k = c->k, ldy = c->ldy;
    const float *x = c->x;
    const int cols = (int)min64(GEMM_NP, c->n - j0);
    dq_rows(c->w + j0 * c->row_bytes, c->type, c->values, c->bytes, cols, k, rows);
    if (cols < GEMM_NP) memset(rows + cols * k, 0, (size_t)((GEMM_NP - cols) * k) * sizeof(float));
    panel_of(rows, k, panel);
    const float *b = c->bias ? c->bias + j0 : NULL;
    float *y = c->y;
    GemmAcc acc;
    int64_t i = 0;
    for (; i + GEMM_MR <= m; i += GEMM_MR) {
        gemm_tile(x + i * k, k, GEMM_MR, panel, acc);
        store_gemm(acc, GEMM_MR, b, cols, y + i * ldy + j0, ldy);
    }
    const int left = (int)(m - i);
    switch (left) { /* literal row counts: each its own unrolled loop */
    case 5: gemm_tile(x + i * k, k, 5, panel, acc); break;
    case 4: gemm_tile(x + i * k, k, 4, panel, acc); break;
    case 3: gemm_tile(x + i * k, k, 3, panel, acc); break;
    case 2: gemm_tile(x + i * k, k, 2, panel, acc); break;
    case 1: gemm_tile(x + i * k, k, 1, panel, acc); break;
    default: break;
    }
    if (left > 0) store_gemm(acc, left, b, cols, y + i * ldy + j0, ldy);
}

/* The two scratch buffers' floats: W's rows, and its panel. */
static int64_t panel_floats(int64_t k) { return GEMM_NP * k; }
static int64_t sums_floats(int64_t k) { return GEMM_NP * k; }
#define GEMM_PACKS_X 0
#endif

/* A pool item: panel `item` (outputs GEMM_NP item ..), on the worker's own buffers. */
static void panel_item(void *ctx, int64_t item, int worker) {
    PanelCall *c = ctx;
    float **mine = c->scratch[worker];
    if (mine[0] == NULL) {
        mine[0] = aligned_alloc(64, c->panel_bytes);
        mine[1] = aligned_alloc(64, c->sums_bytes);
    }
    if (mine[0] == NULL || mine[1] == NULL) {
        atomic_store(&c->failed, 1);
        return;
    }
    panel_outputs(c, item * GEMM_NP, mine[0], mine[1]);
}

#if GEMM_PACKS_X
/* x's values under which one thread transposes it alone (a few us of work): a 64-row
 * step's 576-wide x on the threads together took its 576 x 576 products 12.8 -> 10.9-11.9 ms
 * a step (30 layers) on the 2-core Xeon */
#define PACK_ALONE (16 * 1024)

/* A pool item of x's transposition: group item / spans, values of its span of GEMM_KC. */
static void pack_item(void *ctx, int64_t item, int worker) {
    (void)worker;
    const PanelCall *c = ctx;
    const int64_t spans = (c->k + GEMM_KC - 1) / GEMM_KC, k0 = item % spans * GEMM_KC;
    pack_x(c->x, c->m, c->k, item / spans * GEMM_RG, k0, min64(k0 + GEMM_KC, c->k), c->xt);
}
#endif

static size_t round64(int64_t floats) { return ((size_t)floats * sizeof(float) + 63) / 64 * 64; }

/* Returns 0, -1 when a buffer cannot be had, -2 when k is not a multiple of the block's
 * values, -3 for an unknown code. */
int linear_blocks_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t ldy) {
    PanelCall c = {.x = x, .m = m, .k = k, .n = n, .w = w, .type = type, .bias = bias,
                   .y = y, .ldy = ldy};
    const int layout = dq_layout(type, k, &c.values, &c.bytes, &c.row_bytes);
    if (layout != 0 || m <= 0 || n <= 0) return layout; /* no rows or outputs: nothing to do */
    c.panel_bytes = round64(panel_floats(k));
    c.sums_bytes = round64(sums_floats(k));
#if GEMM_PACKS_X
    /* x is read once per panel: transposed once, first, by the threads together */
    c.xt = aligned_alloc(64, round64((m + 15) / 16 * 16 * k));
    if (c.xt == NULL) return -1;
    const int64_t spans = (k + GEMM_KC - 1) / GEMM_KC, packs = (m + GEMM_RG - 1) / GEMM_RG * spans;
    if (m * k < PACK_ALONE || !pool_took(shared_pool, pack_item, &c, packs)) {
#pragma omp parallel for schedule(dynamic, 1) if (m * k >= PACK_ALONE)
        for (int64_t i = 0; i < packs; i++) pack_item(&c, i, 0);
    }
#endif
    atomic_init(&c.failed, 0);
    int failed = 0;
    if (pool_took(shared_pool, panel_item, &c, (n + GEMM_NP - 1) / GEMM_NP)) {
        for (int i = 0; i < MOST_WORKERS; i++) {
            free(c.scratch[i][0]);
            free(c.scratch[i][1]);
        }
        failed = atomic_load(&c.failed);
    } else {
#pragma omp parallel reduction(| : failed)
        {
            float *panel = aligned_alloc(64, c.panel_bytes);
            float *sums = aligned_alloc(64, c.sums_bytes);
            failed |= panel == NULL || sums == NULL;
            /* Panels handed out as threads come free (as matmul_q8.c's strips): a thread
             * that another process preempts holds up only its current panel. Interleaved
             * on a 2-core Zen 5 EPYC, SmolLM2's four Q4_1 shapes: 0.97-1.12x quiet,
             * 1.03-1.11x beside a neighbour busy 2 ms in every 10 (noisy; no loss beyond
             * the noise). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t j0 = 0; j0 < n; j0 += GEMM_NP) {
                if (panel == NULL || sums == NULL) continue;
                panel_outputs(&c, j0, panel, sums);
            }
            free(panel);
            free(sums);
        }
    }
    free(c.xt);
    return failed ? -1 : 0;
}
#else
int linear_blocks_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)w, (void)type, (void)n, (void)bias, (void)y, (void)ldy;
    return -4; /* not built with AVX2 and FMA: matvec_features() says so */
}
#endif
