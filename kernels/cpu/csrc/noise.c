// The sampling race's uniforms (services/worker/noise.py defines them), row by row:
//
//     u[r, v] = ((mix32(mix32(v ^ SALT) ^ key[r]) >> 9) + 0.5) / 2^23
//
// mix32 is the "lowbias32" finaliser on unsigned 32-bit integers (multiplication wraps
// modulo 2^32, shifts are logical). torch runs it as a dozen passes over [S, V] int32
// tensors; here each element is hashed in registers (the compiler vectorises the loop) and
// written once. The integers, and the float32 values built from them exactly (k + 0.5 is
// exact below 2^24, the scale a power of two), are the torch path's bit for bit.

#include <stdint.h>

#define CODE_SALT 0x5BD1E995u
#define UNIFORM_BITS 23
// Below this many elements the rows run on the calling thread: a parallel region costs
// more than hashing a row.
#define PARALLEL_MIN (1 << 17)

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0xD35A2D97u;
    return x ^ (x >> 15);
}

// keys: [rows] 32-bit patterns; out: [rows, cols] float32, row stride out_stride.
void uniform_rows_f32(const int32_t* keys, int64_t rows, int64_t cols, int64_t out_stride,
                      float* out) {
    // Split each row in chunks too: one row of a large vocabulary is worth two threads.
    const int64_t chunk = 8192;
    const int64_t per_row = (cols + chunk - 1) / chunk;
    const int64_t tasks = rows * per_row;
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t r = t / per_row, start = (t % per_row) * chunk;
        const int64_t n = cols - start < chunk ? cols - start : chunk;
        const uint32_t key = (uint32_t)keys[r];
        float* row = out + r * out_stride + start;
        const float scale = 1.0f / (float)(1u << UNIFORM_BITS);
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)(start + i);
            uint32_t bits = mix32(mix32(v ^ CODE_SALT) ^ key);
            row[i] = ((float)(int32_t)(bits >> (32 - UNIFORM_BITS)) + 0.5f) * scale;
        }
    }
}
