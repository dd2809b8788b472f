// The index of each row's largest value, as torch.argmax(dim=-1) gives it: the first
// index of the maximum, and the first NaN where a row holds one (NaN compares above
// everything). Greedy sampling takes it over [S, V] logits every step; torch's CPU argmax
// tracks an index beside each compared value and runs at a sixth of the speed of its max.
//
// Two passes per row, both streaming: the maximum (stopping at the first NaN), then the
// first index holding it. The second pass stops at the maximum, on average halfway, and
// the row (V floats, 192 KiB at V = 49152) is still in L2 from the first.

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

// Below this many values the rows run on the calling thread: a parallel region costs
// more than a few rows' passes.
#define PARALLEL_MIN (1 << 17)

static int64_t first_nan(const float* x, int64_t from, int64_t n) {
    for (int64_t i = from; i < n; i++) {
        if (isnan(x[i])) return i;
    }
    return -1;
}

static int64_t first_equal(const float* x, int64_t n, float m) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++) {
        if (x[i] == m) return i;
    }
    return 0;  // not reached: m is one of the row's values
}

static int64_t row_argmax(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    __m512 a = _mm512_set1_ps(-INFINITY), b = a, c = a, d = a;
    for (; i + 64 <= n; i += 64) {
        __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        __m512 v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
        __mmask16 nan = _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) |
                        _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);
        if (nan) return first_nan(x, i, n);
        a = _mm512_max_ps(a, v0);
        b = _mm512_max_ps(b, v1);
        c = _mm512_max_ps(c, v2);
        d = _mm512_max_ps(d, v3);
    }
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return first_nan(x, i, n);
        a = _mm512_max_ps(a, v);
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
#elif defined(__AVX2__)
    __m256 a = _mm256_set1_ps(-INFINITY), b = a, c = a, d = a;
    for (; i + 32 <= n; i += 32) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        __m256 nan = _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q),
                                  _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q));
        if (_mm256_movemask_ps(nan)) return first_nan(x, i, n);
        a = _mm256_max_ps(a, v0);
        b = _mm256_max_ps(b, v1);
        c = _mm256_max_ps(c, v2);
        d = _mm256_max_ps(d, v3);
    }
    __m256 ab = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
    float lanes[8];
    _mm256_storeu_ps(lanes, ab);
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
#else
    // Portable: blocks that the compiler vectorizes (a max and a NaN flag per block).
    for (; i + 256 <= n; i += 256) {
        float bm = -INFINITY;
        int unordered = 0;
#pragma omp simd reduction(max : bm) reduction(| : unordered)
        for (int64_t j = i; j < i + 256; j++) {
            unordered |= x[j] != x[j];
            bm = x[j] > bm ? x[j] : bm;
        }
        if (unordered) return first_nan(x, i, n);
        m = bm > m ? bm : m;
    }
#endif
    for (; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > m) m = x[i];
    }
    // The first index of the maximum (index 0 where every value is -inf, as in torch).
    return first_equal(x, n, m);
}

// out[r] = argmax of x[r * row_stride .. + cols); cols >= 1.
void argmax_rows_f32(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                     int64_t* out) {
#pragma omp parallel for if (rows > 1 && rows * cols >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = row_argmax(x + r * row_stride, cols);
    }
}
