/* One row of activations to int8 per block of 64 values, as the int8 products read it
 * (`matvec.c`'s linear_q8 and linear_q8_experts, `matmul_q8.c`): scale amax / 127 per
 * block, each value times 127 / amax rounded to nearest even, stored + 128 (unsigned)
 * where the dot product is VNNI's dpbusd, signed for AVX2's maddubs. AVX2, one block at a
 * time: a MoE layer's decode step quantizes every (token, expert) row, which the scalar
 * loop made a third of its int8 experts' time. */
#ifndef SPILLWAY_QUANTIZE_Q8_H
#define SPILLWAY_QUANTIZE_Q8_H
#include <immintrin.h>
#include <stdint.h>

#define Q8_QB 64

#ifdef __AVX2__
static void quantize_row_q8(const float *restrict x, int64_t k, uint8_t *restrict q,
                            float *restrict sx, int unsigned_offset) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i offset = _mm256_set1_epi8(unsigned_offset ? (char)0x80 : 0);
    for (int64_t b = 0; b < k / Q8_QB; b++) {
        const float *p = x + Q8_QB * b;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < Q8_QB / 8; i++)
            amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(p + 8 * i), abs_mask));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float top = _mm_cvtss_f32(m4);
        const __m256 scale = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        sx[b] = top / 127.0f;
        for (int h = 0; h < Q8_QB / 32; h++) {
            __m256i i32[4];
            for (int i = 0; i < 4; i++)
                i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 32 * h + 8 * i), scale));
            /* packs interleave the 128-bit lanes: the permute puts the values back in order */
            const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
            const __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
            __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b), order);
            i8 = _mm256_xor_si256(i8, offset); /* + 128 as unsigned, where asked */
            _mm256_storeu_si256((__m256i *)(q + Q8_QB * b + 32 * h), i8);
        }
    }
}
#endif /* __AVX2__ */

#endif
