/* linear_blocks_q8 for the GGUF block types beyond Q4_1 / Q8_0 that a llama.cpp Q4_K_M file
 * holds (Q5_0, Q4_K, Q6_K), against x quantized per block of 32 as for those (included by
 * matvec.c inside its integer section). Per block of 32 values of x (scale dx, integers
 * qx), with the weights' integers q and their scales:
 *
 *   Q5_0 (w = d (q - 16), q in 0..31):   d dx (sum(q qx) - 16 sum(qx))
 *   Q4_K (sub-block j of 32: w = d sc_j q - dmin mn_j, q in 0..15, sc, mn 6-bit):
 *                                        d sc_j dx sum(q qx) - dmin mn_j (dx sum(qx))
 *   Q6_K (16 values of scale sc_i: w = d sc_i (q - 32), q in 0..63, sc int8):
 *                                        d dx sum over the two halves i of
 *                                        sc_i (sum(q qx) - 32 sum(qx))
 *
 * as llama.cpp's ggml_vec_dot_q5_0_q8_0, _q4_K_q8_K and _q6_K_q8_K do, except that x keeps
 * one scale per 32 values (theirs per 256 for the K-quants), so each sub-block's integer
 * sum is scaled on its own. The q are the unsigned side of the u8 x s8 products as they
 * are (0..63: no pair of maddubs saturates 16 bits, 2 * 63 * 127 < 32767), and the
 * offsets of Q5_0 and Q6_K come out as integers (16 or 32 times x's sums), so a block's
 * products are exact integers until they are scaled. */

/* The integer sums of x's values in each 4-byte lane of 32 (x's share of the offsets). */
static inline __m256i lane_sums(__m256i xv) { return dot_u8s8(_mm256_set1_epi8(1), xv); }

/* Q5_0's fifth bits: 0x10 in byte j where bit j of the block's qh is set. */
static inline __m256i q5_high_bits(const uint8_t *qh_at) {
    uint32_t qh;
    memcpy(&qh, qh_at, sizeof qh);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32)qh, 0x10);
#else /* byte j takes qh's byte j / 8; ORed with all bits but j % 8, it is all ones iff set */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn);

/* dot4_blocks_q8's sums for these types: output rows j..j+3 of all m (1 to 4) quantized
 * rows of x, one weight row at a time in 8 lanes (any CPU with AVX2, and N of no multiple
 * of 16), into c and offset. Row r's blocks start at w + r * row_bytes. */
static inline void more_q8_sums(const int8_t *restrict xq, const float *restrict xd,
                                const float *restrict xs, int64_t k,
                                const uint8_t *restrict w, int64_t row_bytes, int type,
                                const int m, __m256 c[4][4], float offset[4][4]) {
    const int64_t nb = k / 32; /* x's blocks */
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256i xv[4], xl[4];
    if (type == BLOCK_Q5_0) {
        for (int64_t b = 0; b < nb; b++) {
            for (int i = 0; i < m; i++) {
                xv[i] = _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * b));
                xl[i] = _mm256_slli_epi32(lane_sums(xv[i]), 4);
            }
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = w + r * row_bytes + 22 * b;
                _mm_prefetch((const char *)(blk + 4 * row_bytes), _MM_HINT_T0);
                const __m128i packed = _mm_loadu_si128((const __m128i *)(blk + 6));
                const __m256i wv = _mm256_or_si256(
                    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low),
                    q5_high_bits(blk + 2));
                const float d = half_to_float(blk);
                for (int i = 0; i < m; i++) {
                    const __m256i dot = _mm256_sub_epi32(dot_u8s8(wv, xv[i]), xl[i]);
                    c[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[i * nb + b]),
                                              _mm256_cvtepi32_ps(dot), c[r][i]);
                }
            }
        }
    } else if (type == BLOCK_Q4_K) {
        for (int64_t B = 0; B < k / 256; B++) {
            float dsc[4][8], dmn[4][8];
            for (int r = 0; r < 4; r++) {
                const uint8_t *blk = w + r * row_bytes + 144 * B;
                const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
                for (int j = 0; j < 8; j++) {
                    int sc, mn;
                    k_scale_min(blk + 4, j, &sc, &mn);
                    dsc[r][j] = d * (float)sc;
                    dmn[r][j] = dmin * (float)mn;
                }
            }
            for (int j = 0; j < 8; j++) {
                const int64_t b = 8 * B + j;
                for (int i = 0; i < m; i++)
                    xv[i] = _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * b));
                for (int r = 0; r < 4; r++) {
                    const uint8_t *qs = w + r * row_bytes + 144 * B + 16 + 32 * (j / 2);
                    if (j % 2 == 0) _mm_prefetch((const char *)(qs + 4 * row_bytes), _MM_HINT_T0);
                    const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
                    const __m256i wv = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, low);
                    for (int i = 0; i < m; i++) {
                        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wv, xv[i]));
                        c[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dsc[r][j] * xd[i * nb + b]), dot,
                                                  c[r][i]);
                        offset[r][i] -= dmn[r][j] * xs[i * nb + b];
                    }
                }
            }
        }
    } else { /* BLOCK_Q6_K: ql[128], qh[64], scales[16], d (matvec_blocks_more.h's layout) */
        for (int64_t B = 0; B < k / 256; B++) {
            float d[4];
            for (int r = 0; r < 4; r++) d[r] = half_to_float(w + r * row_bytes + 210 * B + 208);
            for (int g = 0; g < 2; g++)
                for (int s = 0; s < 4; s++) {
                    const int64_t b = 8 * B + 4 * g + s;
                    for (int i = 0; i < m; i++) {
                        xv[i] = _mm256_loadu_si256((const __m256i *)(xq + i * k + 32 * b));
                        xl[i] = _mm256_slli_epi32(lane_sums(xv[i]), 5);
                    }
                    for (int r = 0; r < 4; r++) {
                        const uint8_t *blk = w + r * row_bytes + 210 * B;
                        const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * (s % 2)));
                        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * g));
                        if (s % 2 == 0)
                            _mm_prefetch((const char *)(blk + 4 * row_bytes + 64 * (s / 2 + 2 * g)), _MM_HINT_T0);
                        const __m256i hs = s == 0   ? _mm256_slli_epi16(h, 4)
                                           : s == 1 ? _mm256_slli_epi16(h, 2)
                                           : s == 2 ? h
                                                    : _mm256_srli_epi16(h, 2);
                        const __m256i wv = _mm256_or_si256(
                            _mm256_and_si256(s < 2 ? l : _mm256_srli_epi16(l, 4), low),
                            _mm256_and_si256(hs, top));
                        /* lanes 0-3: values 0-15 of this 32 (scale i), lanes 4-7: 16-31 */
                        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * g + 2 * s;
                        const float lo = d[r] * (float)sc[0], hi = d[r] * (float)sc[1];
                        for (int i = 0; i < m; i++) {
                            const float dx = xd[i * nb + b];
                            const __m256 scale =
                                _mm256_set_m128(_mm_set1_ps(hi * dx), _mm_set1_ps(lo * dx));
                            const __m256i dot = _mm256_sub_epi32(dot_u8s8(wv, xv[i]), xl[i]);
                            c[r][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), c[r][i]);
                        }
                    }
                }
        }
    }
}

#ifdef BLOCKS_X16
/* The interleaved forms of these types (`matvec.interleave`): per group of 16 output rows,
 * each of the file's blocks regrouped so that one 512-bit dpbusd sums 4 products for each
 * of the 16 rows, the group's blocks in order, each the file's bytes for its 16 rows:
 *
 *   Q5_0x16 (352 bytes): d f16 x 16; then 8 masks of 64 bits, mask t's bit 4 r + j the
 *            fifth bit of row r's value 4 t + j; then the nibbles as Q4_1x16's (vector v:
 *            byte 4 r + j the file's byte 4 v + j of row r). One masked byte add puts the
 *            fifth bits in.
 *   Q4_Kx16 (2304 bytes): d f16 x 16, dmin f16 x 16, then the 12 bytes of 6-bit scales as
 *            three 64-byte vectors (vector u: row r's bytes 4 u..4 u + 3 at 4 r), unpacked
 *            for 16 rows at once as k_scales unpacks one row's; then per pair of sub-blocks
 *            p (0..3) 8 vectors, vector v's byte 4 r + j the file's qs byte 32 p + 4 v + j
 *            of row r (low nibble: sub-block 2 p's value 4 v + j; high: 2 p + 1's).
 *   Q6_Kx16 (3360 bytes): d f16 x 16; the 16 int8 scales as 16 vectors of 16 bytes (scale
 *            i of rows 0..15); then per half g (0..1) and v (0..7) three vectors: ql bytes
 *            64 g + 4 v + j, ql bytes 64 g + 32 + 4 v + j and qh bytes 32 g + 4 v + j of
 *            row r at 4 r + j, from which the four 6-bit values 128 g + 32 s + 4 v + j
 *            (s = 0..3) come as matvec_blocks_more.h's q6_k_block makes them.
 *
 * Q5_0's and Q6_K's offsets start the integer sums (-16 and -32 times x's sums, per 32
 * and per 16 values); Q4_K's minimums are one float term per sub-block. */
#define Q5_0X16_BYTES 352
#define Q4_KX16_BYTES 2304
#define Q6_KX16_BYTES 3360
/* How far ahead of its reads the 16-row loops fetch the group's stream. */
#define X16_AHEAD 2048

static inline void dot16_q5_0(const QX *x, const uint8_t *restrict w, const int m, int64_t n,
                              float *restrict out) {
    __m512 c[X16_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16);
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *p = w + Q5_0X16_BYTES * b;
        for (int l = 0; l < Q5_0X16_BYTES; l += 64)
            _mm_prefetch((const char *)(p + X16_AHEAD + l), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        uint64_t masks[8];
        memcpy(masks, p + 32, sizeof masks);
        __m512i wv[8];
        for (int v = 0; v < 4; v++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(p + 96 + 64 * v));
            wv[v] = _mm512_and_si512(raw, low);
            wv[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int t = 0; t < 8; t++)
            wv[t] = _mm512_mask_add_epi8(wv[t], (__mmask64)masks[t], wv[t], sixteen);
        for (int i = 0; i < m; i++) {
            const int8_t *xb = x->q + i * x->k + 32 * b;
            __m512i acc = _mm512_set1_epi32(-16 * x->sum32[i * x->nb + b]);
            for (int t = 0; t < 8; t++) acc = _mm512_dpbusd_epi32(acc, wv[t], bcast4(xb + 4 * t));
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x->d[i * x->nb + b]));
            c[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), c[i]);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * n, c[i]);
}

/* Byte `byte` of each 32-bit lane as float32. */
static inline __m512 lane_byte(__m512i v, int byte) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32(0xFF)));
}

static inline void dot16_q4_k(const QX *x, const uint8_t *restrict w, const int m, int64_t n,
                              float *restrict out) {
    __m512 c[X16_MAX_ROWS], o[X16_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = o[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f);
    const __m512i low2 = _mm512_set1_epi32(0x03030303);
    for (int64_t B = 0; B < x->nb / 8; B++) {
        const uint8_t *p = w + Q4_KX16_BYTES * B;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(p + X16_AHEAD + l), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        const __m512i u0 = _mm512_loadu_si512((const void *)(p + 64));
        const __m512i u1 = _mm512_loadu_si512((const void *)(p + 128));
        const __m512i u2 = _mm512_loadu_si512((const void *)(p + 192));
        /* bytes 0..3 of each row's lane: sc 0..3, sc 4..7, mn 0..3, mn 4..7 */
        const __m512i sc[2] = {
            _mm512_and_si512(u0, low6),
            _mm512_or_si512(_mm512_and_si512(u2, low4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), low2), 4))};
        const __m512i mn[2] = {
            _mm512_and_si512(u1, low6),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), low4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), low2), 4))};
        for (int j = 0; j < 8; j++) { /* sub-block j: pair j / 2, nibble j % 2 */
            const uint8_t *q = p + 256 + 512 * (j / 2);
            if (j % 2 == 0)
                for (int l = 0; l < 512; l += 64)
                    _mm_prefetch((const char *)(q + X16_AHEAD + l), _MM_HINT_T0);
            const __m512 dsc = _mm512_mul_ps(d, lane_byte(sc[j / 4], j % 4));
            const __m512 dmn = _mm512_mul_ps(dmin, lane_byte(mn[j / 4], j % 4));
            __m512i wv[8];
            for (int v = 0; v < 8; v++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(q + 64 * v));
                wv[v] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, low);
            }
            const int64_t b = 8 * B + j;
            for (int i = 0; i < m; i++) {
                const int8_t *xb = x->q + i * x->k + 32 * b;
                __m512i acc = _mm512_setzero_si512();
                for (int v = 0; v < 8; v++) acc = _mm512_dpbusd_epi32(acc, wv[v], bcast4(xb + 4 * v));
                const __m512 scale = _mm512_mul_ps(dsc, _mm512_set1_ps(x->d[i * x->nb + b]));
                c[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), c[i]);
                o[i] = _mm512_fmadd_ps(dmn, _mm512_set1_ps(x->s[i * x->nb + b]), o[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * n, _mm512_sub_ps(c[i], o[i]));
}

static inline void dot16_q6_k(const QX *x, const uint8_t *restrict w, const int m, int64_t n,
                              float *restrict out) {
    __m512 c[X16_MAX_ROWS];
    for (int i = 0; i < m; i++) c[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int64_t B = 0; B < x->nb / 8; B++) {
        const uint8_t *p = w + Q6_KX16_BYTES * B;
        for (int l = 0; l < 288; l += 64) _mm_prefetch((const char *)(p + X16_AHEAD + l), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const uint8_t *scales = p + 32, *quants = p + 288;
        for (int g = 0; g < 2; g++) {
            for (int l = 0; l < 1536; l += 64)
                _mm_prefetch((const char *)(quants + 1536 * g + X16_AHEAD + l), _MM_HINT_T0);
            for (int s = 0; s < 4; s++) {
                const int64_t b = 8 * B + 4 * g + s; /* x's block: values 128 g + 32 s.. */
                for (int half = 0; half < 2; half++) {
                    const __m512 dsc = _mm512_mul_ps(
                        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                               (const __m128i *)(scales + 16 * (8 * g + 2 * s + half))))));
                    __m512i wv[4];
                    for (int v = 0; v < 4; v++) {
                        const uint8_t *at = quants + 1536 * g + 192 * (4 * half + v);
                        const __m512i l = _mm512_loadu_si512((const void *)(at + 64 * (s % 2)));
                        const __m512i h = _mm512_loadu_si512((const void *)(at + 128));
                        const __m512i hs = s == 0   ? _mm512_slli_epi16(h, 4)
                                           : s == 1 ? _mm512_slli_epi16(h, 2)
                                           : s == 2 ? h
                                                    : _mm512_srli_epi16(h, 2);
                        wv[v] = _mm512_or_si512(
                            _mm512_and_si512(s < 2 ? l : _mm512_srli_epi16(l, 4), low),
                            _mm512_and_si512(hs, top));
                    }
                    for (int i = 0; i < m; i++) {
                        const int8_t *xb = x->q + i * x->k + 32 * b + 16 * half;
                        __m512i acc = _mm512_set1_epi32(-32 * x->sum16[i * 2 * x->nb + 2 * b + half]);
                        for (int v = 0; v < 4; v++)
                            acc = _mm512_dpbusd_epi32(acc, wv[v], bcast4(xb + 4 * v));
                        const __m512 scale = _mm512_mul_ps(dsc, _mm512_set1_ps(x->d[i * x->nb + b]));
                        c[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), c[i]);
                    }
                }
            }
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + i * n, c[i]);
}
#endif
