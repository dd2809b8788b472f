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
 * A pass holds 2 A x 2 B -> 4 C tiles (32 rows x 32 outputs); its float accumulators (4 KB)
 * live in L1. Rows past the last multiple of 16 go through the VNNI tiles. Linux grants
 * the tile data state per process on request (`matmul_q8_amx_init`, once); each thread
 * loads its own tile configuration.
 */
#if defined(WIDE) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16 /* rows of an A or C tile */

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

/* Outputs of groups g0 .. g0 + nc - 1 for rows i0 .. i0 + 16 nr - 1 (nr, nc 1 or 2, literal
 * at each call so the tile numbers and branches are constants). */
static inline void amx_pass(const uint8_t *restrict xq, const float *restrict sx, int64_t i0,
                            const int nr, const int8_t *restrict w, const int32_t *restrict neg,
                            int64_t g0, const int nc, int64_t k, const float *scales,
                            const float *bias, float *y, int64_t n, const int8_t *next) {
    const int64_t nb = k / QB;
    _Alignas(64) float acc[2 * AMX_ROWS][2 * COLS];
    _Alignas(64) int32_t c[4][AMX_ROWS][COLS];
    memset(acc, 0, sizeof acc);
    const uint8_t *x0 = xq + i0 * k, *x1 = xq + (i0 + AMX_ROWS) * k;
    const int8_t *w0 = w + g0 * k * COLS, *w1 = w + (g0 + 1) * k * COLS;
    const int32_t *n0 = neg + g0 * nb * COLS, *n1 = neg + (g0 + 1) * nb * COLS;
    for (int64_t b = 0; b < nb; b++) {
        if (next)
            for (int l = 0; l < 2 * QB * COLS; l += 64)
                _mm_prefetch((const char *)next + b * 2 * QB * COLS + l, _MM_HINT_T1);
        _tile_loadd(0, n0 + b * COLS, 0);
        _tile_loadd(4, x0 + b * QB, k);
        _tile_loadd(6, w0 + b * QB * COLS, QB);
        if (nc == 2) {
            _tile_loadd(1, n1 + b * COLS, 0);
            _tile_loadd(7, w1 + b * QB * COLS, QB);
        }
        if (nr == 2) {
            _tile_loadd(2, n0 + b * COLS, 0);
            _tile_loadd(5, x1 + b * QB, k);
        }
        if (nr == 2 && nc == 2) _tile_loadd(3, n1 + b * COLS, 0);
        _tile_dpbusd(0, 4, 6);
        if (nc == 2) _tile_dpbusd(1, 4, 7);
        if (nr == 2) _tile_dpbusd(2, 5, 6);
        if (nr == 2 && nc == 2) _tile_dpbusd(3, 5, 7);
        _tile_stored(0, c[0], 64);
        if (nc == 2) _tile_stored(1, c[1], 64);
        if (nr == 2) _tile_stored(2, c[2], 64);
        if (nr == 2 && nc == 2) _tile_stored(3, c[3], 64);
        const float *s0 = sx + i0 * nb + b, *s1 = s0 + AMX_ROWS * nb;
        scale_block(c[0], s0, nb, &acc[0][0], 2 * COLS);
        if (nc == 2) scale_block(c[1], s0, nb, &acc[0][COLS], 2 * COLS);
        if (nr == 2) scale_block(c[2], s1, nb, &acc[AMX_ROWS][0], 2 * COLS);
        if (nr == 2 && nc == 2) scale_block(c[3], s1, nb, &acc[AMX_ROWS][COLS], 2 * COLS);
    }
    /* store_tile's arithmetic, four rows at a time */
    for (int r = 0; r < nr * AMX_ROWS; r += ROWS) {
        __m512 v[ROWS][GROUPS];
        for (int i = 0; i < ROWS; i++)
            for (int g = 0; g < nc; g++) v[i][g] = _mm512_load_ps(&acc[r + i][g * COLS]);
        store_tile(i0 + r, ROWS, g0, nc, scales, bias, y, n, v);
    }
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
#pragma omp parallel if (parallel)
    {
        load_tile_config();
#pragma omp for schedule(static)
        for (int64_t g0 = 0; g0 < groups; g0 += 2) {
            const int nc = (int)min64(2, groups - g0);
            for (int64_t i0 = 0; i0 < tiled; i0 += 2 * AMX_ROWS) {
                const int nr = (int)min64(2, (tiled - i0) / AMX_ROWS);
                /* The first pass over these weights fetches the next pair's into L2
                   (1 KB per block and group, as these are read): the tile loads would
                   otherwise wait on memory one line at a time. */
                const int8_t *next = i0 == 0 && g0 + 2 < groups ? w + (g0 + 2) * k * COLS : NULL;
#define PASS(r, c) amx_pass(xq, sx, i0, r, w, neg, g0, c, k, scales, bias, y, n, next)
                if (nr == 2) {
                    if (nc == 2) PASS(2, 2);
                    else PASS(2, 1);
                } else {
                    if (nc == 2) PASS(1, 2);
                    else PASS(1, 1);
                }
#undef PASS
            }
            rows_vnni(xq, sx, tiled, m, w, neg, scales, n, bias, y, g0, nc, k);
        }
        _tile_release();
    }
    free(xq);
    free(sx);
    return 0;
}
#endif
