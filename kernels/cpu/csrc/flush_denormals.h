/* Denormal floats flushed to zero, for the length of one thread's part of a kernel.
 *
 * The recurrent layers' decays (e^{cum_t - cum_s}, a state times e^{dt A}) and the small
 * products they scale fall below float32's smallest normal (1.2e-38) wherever a decay is
 * strong. On Intel cores every operation that reads or writes such a value takes a
 * microcode assist of about a hundred cycles: on a Sapphire Rapids Xeon a 4,096-token
 * Mamba2 prefill's mixers took 14x as long as with denormals flushed (docs/kernels.md).
 * Flushed, a value under 1.2e-38 reads and becomes 0, which changes no sum it enters by
 * more than that (every kernel's outputs are compared at float32 tolerances).
 *
 * `flush_denormals` sets FTZ and DAZ (x86's MXCSR bits 15 and 6; FZ, bit 24 of FPCR, on
 * Arm) and returns the mode it found; `restore_fp_mode` puts it back, so a caller's
 * thread (and torch's own operations on it) keeps its mode. Call both inside the OpenMP
 * parallel region: the mode is per thread. */
#ifndef SPILLWAY_FLUSH_DENORMALS_H
#define SPILLWAY_FLUSH_DENORMALS_H
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fp_mode;
static inline fp_mode flush_denormals(void) {
    const fp_mode old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u);
    return old;
}
static inline void restore_fp_mode(fp_mode old) { _mm_setcsr(old); }
#elif defined(__aarch64__)
typedef uint64_t fp_mode;
static inline fp_mode flush_denormals(void) {
    fp_mode old;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    __asm__ volatile("msr fpcr, %0" : : "r"(old | (UINT64_C(1) << 24)));
    return old;
}
static inline void restore_fp_mode(fp_mode old) { __asm__ volatile("msr fpcr, %0" : : "r"(old)); }
#else
typedef int fp_mode;
static inline fp_mode flush_denormals(void) { return 0; }
static inline void restore_fp_mode(fp_mode old) { (void)old; }
#endif

#endif
