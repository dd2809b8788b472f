/* exp(x) for x <= 0, within 1.5 float ulps (Cephes' expf: x = n ln2 + r with ln2 split
 * in two so that r is exact, e^r by a polynomial, 2^n set in the exponent bits); below
 * -87 it gives e^-87. Unlike libm's expf it vectorizes. Shared by the native kernels
 * (native.build hashes this folder's headers with each source). */
#ifndef SPILLWAY_FAST_EXP_H
#define SPILLWAY_FAST_EXP_H
#include <math.h>
#include <stdint.h>

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } power = {.i = ((int32_t)n + 127) << 23};
    return p * power.f;
}

#endif
