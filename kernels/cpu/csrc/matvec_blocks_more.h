/* One-row projections of the GGUF block types beyond Q4_1 / Q8_0 (Q4_0, Q5_0, Q5_1, Q4_K,
 * Q5_K, Q6_K), for linear_blocks_f32 (included by matvec.c, inside its AVX2 + FMA + F16C section).
 *
 * Each weight is made in registers exactly as gguf-py's dequantize makes it: an f16 scale
 * times a 6- or 8-bit sub-block scale, times a quantized value of at most 6 bits, is exact
 * in float32 (at most 23 bits of mantissa), so each weight rounds once, in the fused
 * subtraction of the minimum (fma(ds, q, -dm) = ds q - dm, rounded once, as numpy's
 * d * q - dm). They are then summed in linear_f32's order (dot4_f32: lane l of 16, or 8
 * without AVX-512, takes k = l mod lanes, k in order; the lanes' sum at the end; K is a
 * multiple of the lanes, so there is no tail): the outputs are linear_f32's on the
 * dequantized weight to the bit, at the blocks' 0.56 (Q4_K) to 0.82 (Q6_K) bytes a weight.
 *
 * With AVX-512 the 4-bit types pick their weights from a 16-entry table per sub-block
 * (vpermps reads the low 4 bits of each index lane, as Q4_1's dot4_blocks does) and Q5_1
 * and Q5_K from a 32-entry one (vpermt2ps, 5 bits); Q5_0 runs dot4_blocks (matvec.c: a
 * 16-entry table and its fifth bit as a masked add); Q6_K's 16 weights of one scale are
 * the scale times the converted values. Without AVX-512, Q5_0 runs dot4_blocks too (its
 * weights made in registers by block_weights, the fifth bits by a variable shift); the
 * others' blocks are dequantized by dq_block_values into a buffer on the stack and summed
 * from there (the same values and order). */

static void dq_block_values(const uint8_t *blk, int type, float *out);
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn);

/* Whether dot4_more reads this type, and its block's values and bytes. */
static inline int more_block(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case BLOCK_Q4_0: *values = 32, *bytes = 18; return 1;
    case BLOCK_Q5_0: *values = 32, *bytes = 22; return 1;
    case BLOCK_Q5_1: *values = 32, *bytes = 24; return 1;
    case BLOCK_Q4_K: *values = 256, *bytes = 144; return 1;
    case BLOCK_Q5_K: *values = 256, *bytes = 176; return 1;
    case BLOCK_Q6_K: *values = 256, *bytes = 210; return 1;
    default: return 0;
    }
}

#ifndef PREFETCH_ROWS /* the AVX-512 section's; without it, the next group of four */
#define PREFETCH_ROWS 4
#endif

/* The same block of the row PREFETCH_ROWS on, every cache line of it. */
static inline void prefetch_block(const uint8_t *blk, int64_t row_bytes, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)(blk + PREFETCH_ROWS * row_bytes + o), _MM_HINT_T0);
}

#ifdef __AVX512F__
#define ACC __m512
#define ACC_ZERO _mm512_setzero_ps
#define ACC_LANES 16
#define ACC_FMA(a, w, c) _mm512_fmadd_ps(_mm512_loadu_ps(a), w, c)
#define ACC_SUM _mm512_reduce_add_ps

/* Q4_K / Q5_K's 8 sub-block scales d sc and minimums dmin mn (exact products) into
 * sm[0..7], the minimums negated into sm[8..15] (-(dmin mn) = (-dmin) mn exactly), all 16
 * at once: the 6-bit fields unpacked as llama.cpp's get_scale_min_k4 does for a whole
 * block (gguf-py's get_scale_min gives the same numbers), widened and scaled in one
 * vector. The dot loops then broadcast each from memory (load ports) rather than from a
 * register (the shuffle port their table lookups need). Measured on the 2-core Xeon, CPU
 * time of a 150M-weight Q4_K llama's decode step: 14.2 ms with the scales made one by
 * one in scalar code, each broadcast from a register, 12.3 with this. */
static inline void k_scales(const uint8_t *blk, float sm[16]) {
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4); /* mn 4..7 */
    const uint32_t mn03 = u[1] & low6;                          /* mn 0..3 */
    u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);         /* sc 4..7 */
    u[2] = mn03;
    u[0] &= low6; /* sc 0..3 */
    uint32_t dm;
    memcpy(&dm, blk, sizeof dm);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)); /* d, dmin */
    const __m128 sign = _mm_castsi128_ps(_mm_setr_epi32(0, (int)0x80000000u, 0, 0));
    const __m512 scale = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_castps128_ps512(_mm_xor_ps(dmf, sign)));
    /* from registers: a 16-byte load of four 4-byte stores would miss store forwarding */
    const __m512i q = _mm512_cvtepu8_epi32(_mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]));
    _mm512_store_ps(sm, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)));
}

/* Q4_K: per pair of sub-blocks, 32 bytes of qs hold sub-block 2j in the low nibbles and
 * 2j + 1 in the high ones; values 64 j + 0..15, 16..31 (low), 32..47, 48..63 (high). */
static inline __m512 q4_k_block(const float *a, const uint8_t *blk, __m512 c) {
    float sm[16] __attribute__((aligned(64)));
    k_scales(blk, sm);
    const __m512 iota = iota16(0.0f);
    const uint8_t *qs = blk + 16;
    for (int j = 0; j < 4; j++) {
        const __m512 lo = _mm512_fmadd_ps(_mm512_set1_ps(sm[2 * j]), iota, _mm512_set1_ps(sm[8 + 2 * j]));
        const __m512 hi =
            _mm512_fmadd_ps(_mm512_set1_ps(sm[2 * j + 1]), iota, _mm512_set1_ps(sm[9 + 2 * j]));
        const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * j)));
        const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * j + 16)));
        const float *aj = a + 64 * j;
        c = ACC_FMA(aj, _mm512_permutexvar_ps(q0, lo), c);
        c = ACC_FMA(aj + 16, _mm512_permutexvar_ps(q1, lo), c);
        c = ACC_FMA(aj + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), hi), c);
        c = ACC_FMA(aj + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), hi), c);
    }
    return c;
}

/* Q4_K's four output rows at once, the rows interleaved per 64 values (each row's
 * products still in k order into its one accumulator, as q4_k_block sums them): four
 * independent FMA chains where a whole block per row made one chain of 16, and the
 * inputs loaded once for the four rows. Measured on the 2-core Xeon, one thread, CPU
 * time of nine projections of a 150M-weight llama's shapes at one row: 2.65 -> 1.80 ms
 * (Q4_1's loop: 1.78). The same for Q6_K measured no gain. */
static inline void dot4_q4_k(const float *restrict a, const uint8_t *restrict w,
                             int64_t row_bytes, int64_t nb, float *restrict out) {
    __m512 c[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    float sm[4][16] __attribute__((aligned(64)));
    const __m512 iota = iota16(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * row_bytes + b * 144;
            prefetch_block(blk, row_bytes, 144);
            k_scales(blk, sm[r]);
        }
        const float *ab = a + 256 * b;
        for (int j = 0; j < 4; j++) {
            const float *aj = ab + 64 * j;
            const __m512 a0 = _mm512_loadu_ps(aj), a1 = _mm512_loadu_ps(aj + 16);
            const __m512 a2 = _mm512_loadu_ps(aj + 32), a3 = _mm512_loadu_ps(aj + 48);
            for (int r = 0; r < 4; r++) {
                const uint8_t *qs = w + r * row_bytes + b * 144 + 16 + 32 * j;
                const __m512 lo = _mm512_fmadd_ps(_mm512_set1_ps(sm[r][2 * j]), iota,
                                                  _mm512_set1_ps(sm[r][8 + 2 * j]));
                const __m512 hi = _mm512_fmadd_ps(_mm512_set1_ps(sm[r][2 * j + 1]), iota,
                                                  _mm512_set1_ps(sm[r][9 + 2 * j]));
                const __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
                const __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
                c[r] = _mm512_fmadd_ps(a0, _mm512_permutexvar_ps(q0, lo), c[r]);
                c[r] = _mm512_fmadd_ps(a1, _mm512_permutexvar_ps(q1, lo), c[r]);
                c[r] = _mm512_fmadd_ps(a2, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), hi), c[r]);
                c[r] = _mm512_fmadd_ps(a3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), hi), c[r]);
            }
        }
    }
    for (int r = 0; r < 4; r++) out[r] = _mm512_reduce_add_ps(c[r]);
}

/* Q5_K: as Q4_K with a fifth bit per value from qh (bit 2 j of qh[l] for value 64 j + l,
 * bit 2 j + 1 for 64 j + 32 + l): 5-bit indices into the 32 weights of a sub-block. */
static inline __m512 q5_k_block(const float *a, const uint8_t *blk, __m512 c) {
    float sm[16] __attribute__((aligned(64)));
    k_scales(blk, sm);
    const __m512 iota0 = iota16(0.0f), iota1 = iota16(16.0f);
    const __m256i nib = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
    const uint8_t *qs = blk + 48;
    for (int j = 0; j < 4; j++) {
        const __m512 s0 = _mm512_set1_ps(sm[2 * j]), m0 = _mm512_set1_ps(sm[8 + 2 * j]);
        const __m512 s1 = _mm512_set1_ps(sm[2 * j + 1]), m1 = _mm512_set1_ps(sm[9 + 2 * j]);
        const __m512 lo0 = _mm512_fmadd_ps(s0, iota0, m0), lo1 = _mm512_fmadd_ps(s0, iota1, m0);
        const __m512 hi0 = _mm512_fmadd_ps(s1, iota0, m1), hi1 = _mm512_fmadd_ps(s1, iota1, m1);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        /* 16-bit shifts: a byte's low bits never take its neighbour's, after the masks */
        const __m256i lo = _mm256_or_si256(
            _mm256_and_si256(q, nib), _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
        const __m256i hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(q, 4), nib),
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
        h = _mm256_srli_epi16(h, 2);
        const float *aj = a + 64 * j;
        const __m512i i0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo));
        const __m512i i1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1));
        const __m512i i2 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi));
        const __m512i i3 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1));
        c = ACC_FMA(aj, _mm512_permutex2var_ps(lo0, i0, lo1), c);
        c = ACC_FMA(aj + 16, _mm512_permutex2var_ps(lo0, i1, lo1), c);
        c = ACC_FMA(aj + 32, _mm512_permutex2var_ps(hi0, i2, hi1), c);
        c = ACC_FMA(aj + 48, _mm512_permutex2var_ps(hi0, i3, hi1), c);
    }
    return c;
}

/* Q6_K: values 128 g + 32 s + l take the low (s < 2) or high (s >= 2) nibble
 * of ql[64 g + 32 (s % 2) + l] and bits 2 s, 2 s + 1 of qh[32 g + l]; one int8 scale per
 * 16 values, so each 16-lane vector is its scale times the values less 32. */
static inline __m512 q6_k_block(const float *a, const uint8_t *blk, __m512 c) {
    float ds[16] __attribute__((aligned(64)));
    const __m512 d = _mm512_set1_ps(half_to_float(blk + 208));
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
    _mm512_store_ps(ds, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
    const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i bias = _mm256_set1_epi8(32);
    for (int g = 0; g < 2; g++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * g));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * g));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, nib), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib), _mm256_and_si256(h, top));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                               _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
        for (int s = 0; s < 4; s++) {
            const float *as = a + 128 * g + 32 * s;
            const __m256i qs = _mm256_sub_epi8(q[s], bias); /* -32..31 */
            for (int half = 0; half < 2; half++) {
                const __m128i b = half ? _mm256_extracti128_si256(qs, 1) : _mm256_castsi256_si128(qs);
                const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
                const __m512 w = _mm512_mul_ps(_mm512_set1_ps(ds[8 * g + 2 * s + half]), v);
                c = ACC_FMA(as + 16 * half, w, c);
            }
        }
    }
    return c;
}

/* Q4_0: w = d (q - 8), a table of 16 per block as Q4_1's (values 0..15 low nibbles, 16..31
 * high). */
static inline __m512 q4_0_block(const float *a, const uint8_t *blk, __m512 c) {
    const __m512 lut = _mm512_mul_ps(_mm512_set1_ps(half_to_float(blk)), iota16(-8.0f));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
    c = ACC_FMA(a, _mm512_permutexvar_ps(q, lut), c);
    return ACC_FMA(a + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut), c);
}

/* The 32 weights of a 5-bit block (Q5_0, Q5_1) from its 32-entry table lo (q 0..15), hi
 * (q 16..31): q the low nibble plus bit j of qh as its fifth bit (llama.cpp's layout:
 * weights 0..15 the low nibbles, 16..31 the high ones), picked with vpermt2ps (bit 4 of
 * the index chooses hi). */
static inline __m512 q5_block(const float *a, const uint8_t *qh_at, const uint8_t *qs,
                              __m512 lo, __m512 hi, __m512 c) {
    uint32_t qh;
    memcpy(&qh, qh_at, sizeof qh);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    const __m512i i0 = _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(15)),
                                       _mm512_maskz_set1_epi32((__mmask16)(qh & 0xFFFF), 16));
    const __m512i i1 = _mm512_or_si512(_mm512_srli_epi32(q, 4),
                                       _mm512_maskz_set1_epi32((__mmask16)(qh >> 16), 16));
    c = ACC_FMA(a, _mm512_permutex2var_ps(lo, i0, hi), c);
    return ACC_FMA(a + 16, _mm512_permutex2var_ps(lo, i1, hi), c);
}

/* Q5_1: f16 d, f16 m, qh, 16 bytes of nibbles; w = d q + m, the table made as Q4_1's
 * (fma(d, q, m): d q is exact, so each weight rounds once, as gguf-py's d * q + m). */
static inline __m512 q5_1_block(const float *a, const uint8_t *blk, __m512 c) {
    uint32_t dm; /* d and m converted together */
    memcpy(&dm, blk, sizeof dm);
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    const __m512 d = _mm512_broadcastss_ps(dmf), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dmf));
    const __m512 lo = _mm512_fmadd_ps(d, iota16(0.0f), m);
    const __m512 hi = _mm512_fmadd_ps(d, iota16(16.0f), m);
    return q5_block(a, blk + 4, blk + 8, lo, hi, c);
}

/* One block of one output row into its accumulator. */
static inline __m512 more_block_dot(const float *a, const uint8_t *blk, int type, __m512 c) {
    switch (type) {
    case BLOCK_Q5_1: return q5_1_block(a, blk, c);
    case BLOCK_Q4_K: return q4_k_block(a, blk, c);
    case BLOCK_Q5_K: return q5_k_block(a, blk, c);
    case BLOCK_Q6_K: return q6_k_block(a, blk, c);
    default: return q4_0_block(a, blk, c);
    }
}
#else
#define ACC __m256
#define ACC_ZERO _mm256_setzero_ps
#define ACC_LANES 8
#define ACC_FMA(a, w, c) _mm256_fmadd_ps(_mm256_loadu_ps(a), w, c)
#define ACC_SUM hsum256

/* Q4_K: sub-block s's weights fma(d sc_s, q, -(dmin m_s)), rounded once as gguf-py's
 * d * q - dm; sub-blocks 2j and 2j + 1 are the low and high nibbles of the same 32 bytes. */
static inline __m256 q4_k_block_dot(const float *a, const uint8_t *blk, __m256 c) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        k_scale_min(blk + 4, s, &sc, &mn);
        const __m256 ds = _mm256_set1_ps(d * (float)sc), dm = _mm256_set1_ps(-(dmin * (float)mn));
        const uint8_t *q = blk + 16 + 32 * (s / 2);
        for (int l = 0; l < 32; l += 8) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + l)));
            const __m256i v = s % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, nibble);
            const __m256 w = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(v), dm);
            c = _mm256_fmadd_ps(_mm256_loadu_ps(a + 32 * s + l), w, c);
        }
    }
    return c;
}

/* Q6_K: (d sc) q with q = 6 bits - 32, exact in float32 (no rounding). Each half of 128
 * values: quarter g takes the low (g < 2) or high nibbles of ql's first (g even) or second
 * 32 bytes, and bits 2g, 2g + 1 of qh's 32 bytes; 16 values a scale. */
static inline __m256 q6_k_block_dot(const float *a, const uint8_t *blk, __m256 c) {
    const float d = half_to_float(blk + 208);
    const int8_t *scales = (const int8_t *)(blk + 192);
    const __m256i nibble = _mm256_set1_epi32(0x0F), two = _mm256_set1_epi32(3);
    const __m256i offset = _mm256_set1_epi32(32);
    for (int n = 0; n < 2; n++) {
        const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l += 8) {
                const __m256i lo = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(ql + 32 * (g % 2) + l)));
                const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                const __m256i low4 = g < 2 ? _mm256_and_si256(lo, nibble) : _mm256_srli_epi32(lo, 4);
                const __m256i top2 = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * g), two);
                const __m256i q = _mm256_sub_epi32(
                    _mm256_or_si256(low4, _mm256_slli_epi32(top2, 4)), offset);
                const __m256 ds = _mm256_set1_ps(d * (float)scales[8 * n + l / 16 + 2 * g]);
                const __m256 w = _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q));
                c = _mm256_fmadd_ps(_mm256_loadu_ps(a + 128 * n + 32 * g + l), w, c);
            }
    }
    return c;
}

static inline __m256 more_block_dot(const float *a, const uint8_t *blk, int type, __m256 c) {
    if (type == BLOCK_Q4_K) return q4_k_block_dot(a, blk, c);
    if (type == BLOCK_Q6_K) return q6_k_block_dot(a, blk, c);
    float v[256] __attribute__((aligned(32)));
    dq_block_values(blk, type, v);
    const int values = type == BLOCK_Q4_0 || type == BLOCK_Q5_0 || type == BLOCK_Q5_1 ? 32 : 256;
    for (int i = 0; i < values; i += 8) c = ACC_FMA(a + i, _mm256_load_ps(v + i), c);
    return c;
}
#endif

/* Output rows j..j+3 of one input row a; row r's blocks start at w + r * row_bytes. Each
 * type gets its own copy of the loop (the switch on a literal type folds away). */
static inline void dot4_more_typed(const float *restrict a, const uint8_t *restrict w,
                                   int64_t row_bytes, int64_t nb, int64_t values,
                                   int64_t bytes, const int type, float *restrict out) {
    ACC c[4] = {ACC_ZERO(), ACC_ZERO(), ACC_ZERO(), ACC_ZERO()};
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < 4; r++) {
            const uint8_t *blk = w + r * row_bytes + b * bytes;
            prefetch_block(blk, row_bytes, bytes);
            c[r] = more_block_dot(a + b * values, blk, type, c[r]);
        }
    for (int r = 0; r < 4; r++) out[r] = ACC_SUM(c[r]);
}

static void dot4_more(const float *restrict a, const uint8_t *restrict w, int64_t row_bytes,
                      int64_t nb, int64_t values, int64_t bytes, int type,
                      float *restrict out) {
    switch (type) {
#ifdef __AVX512F__
    case BLOCK_Q4_K: dot4_q4_k(a, w, row_bytes, nb, out); break;
#else
    case BLOCK_Q4_K: dot4_more_typed(a, w, row_bytes, nb, values, bytes, BLOCK_Q4_K, out); break;
#endif
    case BLOCK_Q5_K: dot4_more_typed(a, w, row_bytes, nb, values, bytes, BLOCK_Q5_K, out); break;
    case BLOCK_Q6_K: dot4_more_typed(a, w, row_bytes, nb, values, bytes, BLOCK_Q6_K, out); break;
    case BLOCK_Q5_0: dot4_blocks(a, w, row_bytes, nb, 22, BLOCK_Q5_0, out); break;
    case BLOCK_Q5_1: dot4_more_typed(a, w, row_bytes, nb, values, bytes, BLOCK_Q5_1, out); break;
    default: dot4_more_typed(a, w, row_bytes, nb, values, bytes, BLOCK_Q4_0, out); break;
    }
}

#undef ACC
#undef ACC_ZERO
#undef ACC_LANES
#undef ACC_FMA
#undef ACC_SUM
