/* Many rows against a weight kept in the model file's blocks (included by matvec.c, whose
 * dequantizer it uses): y [M, N] (row stride ldy) = x [M, K] W^T (+ b), with no float32
 * copy of W bigger than one panel.
 *
 * The tiled product (quantized_weight.TiledProduct) dequantized 4 MiB of W at a time into
 * memory and gave it to BLAS, which copied it once more into its own packed layout before
 * multiplying: on a 2-core EPYC (Zen 3) those two passes were a fifth of an exact-mode
 * P1 step (BLAS's packing 14% of the worker's samples, the dequantization 7%). Here each
 * thread dequantizes NR = 16 rows of W into a buffer, transposes them 8 x 8 at a time
 * into the panel the register tile reads ([K][16], in L2: 36 KiB at K = 576), and runs
 * every row of x against it while it is hot: a register tile of MR = 6 rows x 16 outputs
 * (12 accumulators, two panel loads and six broadcasts per k). Built with AVX-512, the tile
 * is MR = 12 rows x 16 outputs, one 512-bit accumulator a row (one panel load and twelve
 * broadcasts per k): a core with two 512-bit FMA units (a Sapphire Rapids Xeon) runs
 * twice the AVX2 tile's multiply-adds a cycle, where oneDNN's float32 kernels had
 * prefilled 1.26x faster than this file's AVX2 tile. The sums are the same either way.
 *
 * Each output is one float32 sum over k in order, fused multiply-adds, whatever M or the
 * thread count (the blocks' values are gguf-py's to the bit, as dequantize_rows makes
 * them): a float32 product like BLAS's, summed in another order. Threads (OpenMP) split
 * the panels. */
#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_NR 16
#if defined(__AVX512F__)
#define GEMM_MR 12
#else
#define GEMM_MR 6
#endif

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

/* rows [16][k] (row-major) -> panel [k][16]. */
static void panel_of(const float *rows, int64_t k, float *panel) {
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        transpose8(rows + kk, k, panel + kk * GEMM_NR, GEMM_NR);
        transpose8(rows + 8 * k + kk, k, panel + kk * GEMM_NR + 8, GEMM_NR);
    }
    for (; kk < k; kk++)
        for (int j = 0; j < GEMM_NR; j++) panel[kk * GEMM_NR + j] = rows[j * k + kk];
}

#if defined(__AVX512F__)
typedef __m512 GemmAcc[GEMM_MR];

/* acc[r] = x[r, :] . panel for mr (a literal at each call) rows of x: each output one
 * chain of fused multiply-adds over k in order, as in the AVX2 tile below. */
static inline __attribute__((always_inline)) void gemm_tile(const float *restrict x, int64_t k,
                                                            const int mr,
                                                            const float *restrict panel,
                                                            GemmAcc acc) {
    __m512 c[GEMM_MR]; /* local sums, copied out once (see the AVX2 tile) */
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) c[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 b = _mm512_load_ps(panel + kk * GEMM_NR);
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++)
            c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + kk]), b, c[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) acc[r] = c[r];
}

/* The tile's sums (+ bias) into y's rows; only the first `cols` outputs where the panel
 * runs past N. */
static inline void store_gemm(GemmAcc acc, int mr, const float *bias, int cols, float *y,
                              int64_t ldy) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (int r = 0; r < mr; r++) {
        __m512 v = acc[r];
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
        _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    }
}
#else
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
        const __m256 b0 = _mm256_load_ps(panel + kk * GEMM_NR);
        const __m256 b1 = _mm256_load_ps(panel + kk * GEMM_NR + 8);
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
        if (bias && cols == GEMM_NR) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
        }
        float *out = y + r * ldy;
        if (cols == GEMM_NR) {
            _mm256_storeu_ps(out, lo);
            _mm256_storeu_ps(out + 8, hi);
        } else {
            float tmp[GEMM_NR];
            _mm256_storeu_ps(tmp, lo);
            _mm256_storeu_ps(tmp + 8, hi);
            for (int j = 0; j < cols; j++) out[j] = bias ? tmp[j] + bias[j] : tmp[j];
        }
    }
}

#endif

/* One call's arguments (`linear_blocks_rows`), and the pool's per-worker buffers. */
typedef struct {
    const float *x;
    int64_t m, k, n, values, bytes, row_bytes, ldy;
    const uint8_t *w;
    int type;
    const float *bias;
    float *y;
    size_t panel_bytes;
    float *scratch[MOST_WORKERS][2]; /* a worker's dequantized rows and panel */
    _Atomic int failed;
} PanelCall;

/* Outputs j0 .. j0 + 15 of every row: the panel dequantized, then the row tiles. */
static void panel_outputs(const PanelCall *c, int64_t j0, float *rows, float *panel) {
    const int64_t m = c->m, k = c->k, ldy = c->ldy;
    const float *x = c->x;
    const int cols = (int)min64(GEMM_NR, c->n - j0);
    dq_rows(c->w + j0 * c->row_bytes, c->type, c->values, c->bytes, cols, k, rows);
    if (cols < GEMM_NR) memset(rows + cols * k, 0, (size_t)((GEMM_NR - cols) * k) * sizeof(float));
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
#if GEMM_MR > 6
    case 11: gemm_tile(x + i * k, k, 11, panel, acc); break;
    case 10: gemm_tile(x + i * k, k, 10, panel, acc); break;
    case 9: gemm_tile(x + i * k, k, 9, panel, acc); break;
    case 8: gemm_tile(x + i * k, k, 8, panel, acc); break;
    case 7: gemm_tile(x + i * k, k, 7, panel, acc); break;
    case 6: gemm_tile(x + i * k, k, 6, panel, acc); break;
#endif
    case 5: gemm_tile(x + i * k, k, 5, panel, acc); break;
    case 4: gemm_tile(x + i * k, k, 4, panel, acc); break;
    case 3: gemm_tile(x + i * k, k, 3, panel, acc); break;
    case 2: gemm_tile(x + i * k, k, 2, panel, acc); break;
    case 1: gemm_tile(x + i * k, k, 1, panel, acc); break;
    default: break;
    }
    if (left > 0) store_gemm(acc, left, b, cols, y + i * ldy + j0, ldy);
}

/* A pool item: panel `item` (outputs 16 item ..), on the worker's own buffers. */
static void panel_item(void *ctx, int64_t item, int worker) {
    PanelCall *c = ctx;
    float **mine = c->scratch[worker];
    if (mine[0] == NULL) {
        mine[0] = aligned_alloc(64, c->panel_bytes);
        mine[1] = aligned_alloc(64, c->panel_bytes);
    }
    if (mine[0] == NULL || mine[1] == NULL) {
        atomic_store(&c->failed, 1);
        return;
    }
    panel_outputs(c, item * GEMM_NR, mine[0], mine[1]);
}

/* Returns 0, -1 when a buffer cannot be had, -2 when k is not a multiple of the block's
 * values, -3 for an unknown code. */
int linear_blocks_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t ldy) {
    PanelCall c = {.x = x, .m = m, .k = k, .n = n, .w = w, .type = type, .bias = bias,
                   .y = y, .ldy = ldy};
    const int layout = dq_layout(type, k, &c.values, &c.bytes, &c.row_bytes);
    if (layout != 0) return layout;
    c.panel_bytes = ((size_t)(GEMM_NR * k) * sizeof(float) + 63) / 64 * 64;
    atomic_init(&c.failed, 0);
    if (pool_took(shared_pool, panel_item, &c, (n + GEMM_NR - 1) / GEMM_NR)) {
        for (int i = 0; i < MOST_WORKERS; i++) {
            free(c.scratch[i][0]);
            free(c.scratch[i][1]);
        }
        return atomic_load(&c.failed) ? -1 : 0;
    }
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *rows = aligned_alloc(64, c.panel_bytes);
        float *panel = aligned_alloc(64, c.panel_bytes);
        failed |= rows == NULL || panel == NULL;
        /* Panels handed out as threads come free (as matmul_q8.c's strips): a thread that
         * another process preempts holds up only its current panel. Interleaved on a
         * 2-core Zen 5 EPYC, SmolLM2's four Q4_1 shapes: 0.97-1.12x quiet, 1.03-1.11x
         * beside a neighbour busy 2 ms in every 10 (noisy; no loss beyond the noise). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t j0 = 0; j0 < n; j0 += GEMM_NR) {
            if (rows == NULL || panel == NULL) continue;
            panel_outputs(&c, j0, rows, panel);
        }
        free(rows);
        free(panel);
    }
    return failed ? -1 : 0;
}
#else
int linear_blocks_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int type,
                       int64_t n, const float *bias, float *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)w, (void)type, (void)n, (void)bias, (void)y, (void)ldy;
    return -4; /* not built with AVX2 and FMA: matvec_features() says so */
}
#endif
