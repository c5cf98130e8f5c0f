/* What the attention kernels share: scoped flush-to-zero and a 16-float vector type.
 *
 * Flush-to-zero / denormals-are-zero for a kernel's own arithmetic only: softmax weights of
 * far-below-maximum scores underflow into denormals, which cost a microcode assist per
 * operation (measured: decode attention 6-10% slower on SmolLM2 without this). Each thread sets
 * the mode around its work item and restores it, so the process's mode (torch's, numpy's, the
 * user's) is never changed: the libraries are deliberately linked without crtfastmath.o. */
#ifndef PAGEDLLM_KERNEL_COMMON_H
#define PAGEDLLM_KERNEL_COMMON_H
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned ftz_enter(void) {
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return old;
}
static inline void ftz_leave(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned ftz_enter(void) { return 0; }
static inline void ftz_leave(unsigned old) { (void)old; }
#endif

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}
#endif
