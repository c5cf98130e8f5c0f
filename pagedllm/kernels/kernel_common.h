/* What the attention kernels share: scoped flush-to-zero, a 16-float vector type, and `vk`, the
 * vector of the build's own register width (KVL floats: 16 with AVX-512, 8 otherwise), for loops
 * whose working set must stay in registers (16 ymm on AVX2: a 16-float vector there is two
 * registers, and a tile written for 32 zmm spills on every step).
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

#if defined(__AVX512F__)
#define KVL 16
#else
#define KVL 8
#endif
typedef float vk __attribute__((vector_size(KVL * 4)));

static inline vk loadk(const float *p) {
    vk v;
    memcpy(&v, p, sizeof(v));
    return v;
}
#endif
