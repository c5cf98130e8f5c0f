/* The KV cache element types the attention kernels read in place and write (docs/kv_cache.md).
 *
 * A cache half (keys, or values) is `num_blocks` blocks of `kv_block_bytes` bytes each:
 *   KV_F32   float32 [block_size][num_kv_heads][head_dim]
 *   KV_BF16  bfloat16, same shape: read by a 16-bit shift (exact), written rounded to nearest
 *            even (AVX-512 BF16's VCVTNEPS2BF16 where the compiler targets it, else integer ops)
 *   KV_I8    a header of one float32 scale per KV head (padded to 16 bytes), then int8 codes
 *            [block_size][num_kv_heads][head_dim]; value = code * scale, symmetric absmax:
 *            scale = max |x| / 127 over the block's tokens of that head
 * layers/kv_cache_dtype.py is the same layout in Python (sizes, views, the torch path).
 *
 * Incremental int8 writes (decode appends one token to a partly filled block): a write that
 * starts at offset 0 of a block starts it afresh (scale from the new tokens alone); one at offset
 * k > 0 keeps the block's scale unless the new tokens' absmax exceeds it, and then the k codes
 * already there are requantized to the grown scale (code * old / new, rounded), once per growth,
 * before the new tokens are quantized with the final scale. A full block is never written again,
 * so its scale is settled (shared and prefix-cached blocks are full). Why not another scheme:
 * a fixed scale per layer needs calibration and clips outliers; a scale per token costs 4 bytes
 * per head per token (a quarter more for head_dim 64). Requantizing costs at most block_size - 1
 * rounding steps per value in theory, about 2-3 in practice (the absmax of a block grows at the
 * "record" tokens only); tests/unit/test_kv_cache_dtype.py bounds the error. */
#ifndef PAGEDLLM_KV_CACHE_TYPES_H
#define PAGEDLLM_KV_CACHE_TYPES_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_common.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KV_HAVE_BF16_INSN 1
#else
#define KV_HAVE_BF16_INSN 0
#endif

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };

typedef uint16_t kv_v16u16 __attribute__((vector_size(32)));
typedef uint32_t kv_v16u32 __attribute__((vector_size(64)));
typedef int8_t kv_v16i8 __attribute__((vector_size(16)));

static inline int64_t kv_elem_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

/* Bytes before a block's values: KV_I8's float32 scale per KV head, padded to 16 bytes. */
static inline int64_t kv_header_bytes(int kind, int num_kv_heads) {
    return kind == KV_I8 ? (4 * (int64_t)num_kv_heads + 15) / 16 * 16 : 0;
}

static inline int64_t kv_block_bytes(int kind, int block_size, int num_kv_heads, int head_dim) {
    return kv_header_bytes(kind, num_kv_heads) + (int64_t)block_size * num_kv_heads * head_dim * kv_elem_bytes(kind);
}

/* 16 consecutive elements at `p` as floats (int8: the codes, not yet scaled). With AVX-512 or
 * AVX2 through intrinsics: GCC 12 turns the generic int8 vector conversion into 16 scalar ones. */
static inline __attribute__((always_inline)) v16 kv_load16(const char *p, int kind) {
    if (kind == KV_F32) return load16((const float *)p);
    v16 f;
#if defined(__AVX512F__)
    __m512 r;
    if (kind == KV_BF16)
        r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    else
        r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&f, &r, sizeof(f));
#elif defined(__AVX2__)
    __m256 r[2];
    for (int i = 0; i < 2; ++i) {
        if (kind == KV_BF16)
            r[i] = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i))), 16));
        else
            r[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
    }
    memcpy(&f, r, sizeof(f));
#else
    if (kind == KV_BF16) {
        kv_v16u16 h;
        memcpy(&h, p, sizeof(h));
        const kv_v16u32 w = __builtin_convertvector(h, kv_v16u32) << 16;
        memcpy(&f, &w, sizeof(f));
    } else {
        for (int i = 0; i < 16; ++i) f[i] = (float)((const int8_t *)p)[i];
    }
#endif
    return f;
}

/* Element `i` of the row at `p` as a float (int8: the code). */
static inline __attribute__((always_inline)) float kv_load1(const char *p, int64_t i, int kind) {
    if (kind == KV_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    if (kind == KV_BF16) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        const uint32_t w = (uint32_t)h << 16;
        float f;
        memcpy(&f, &w, 4);
        return f;
    }
    return (float)((const int8_t *)p)[i];
}

/* KVL consecutive elements at `p` as floats (kernel_common.h's register-width vector). */
static inline __attribute__((always_inline)) vk kv_loadk(const char *p, int kind) {
#if KVL == 16
    return kv_load16(p, kind);
#else
    if (kind == KV_F32) return loadk((const float *)p);
    vk f;
#if defined(__AVX2__)
    __m256 r;
    if (kind == KV_BF16)
        r = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    else
        r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&f, &r, sizeof(f));
#else
    for (int i = 0; i < KVL; ++i) f[i] = kv_load1(p, i, kind);
#endif
    return f;
#endif
}

/* float32 -> bfloat16, round to nearest even, as torch's `.to(torch.bfloat16)` (NaN: 0x7FC0). */
static inline uint16_t kv_bf16_round_portable(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A row of `n` floats -> bfloat16. The instruction path equals the portable one except that it
 * flushes denormal inputs (below 1.2e-38) to zero. */
static inline void kv_bf16_round_row(const float *src, uint16_t *dst, int64_t n, int portable) {
    int64_t i = 0;
#if KV_HAVE_BF16_INSN
    if (!portable)
        for (; i + 16 <= n; i += 16) {
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
            memcpy(dst + i, &h, sizeof(h));
        }
#else
    (void)portable;
#endif
    for (; i < n; ++i) dst[i] = kv_bf16_round_portable(src[i]);
}

static const float KV_INV127 = 1.0f / 127.0f;

/* Store `n` token rows of floats (`src` rows `src_stride` floats apart, num_kv_heads * head_dim
 * each) at positions off .. off + n - 1 of the block starting at byte `blk`. */
static void kv_store_run(int kind, char *blk, int64_t off, int64_t n, const float *src, int64_t src_stride,
                         int num_kv_heads, int head_dim) {
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    if (kind == KV_F32) {
        for (int64_t r = 0; r < n; ++r) memcpy(blk + (off + r) * row * 4, src + r * src_stride, sizeof(float) * row);
        return;
    }
    if (kind == KV_BF16) {
        for (int64_t r = 0; r < n; ++r) kv_bf16_round_row(src + r * src_stride, (uint16_t *)blk + (off + r) * row, row, 0);
        return;
    }
    float *scales = (float *)blk;
    int8_t *codes = (int8_t *)(blk + kv_header_bytes(kind, num_kv_heads));
    for (int h = 0; h < num_kv_heads; ++h) {
        float amax = 0.0f;
        for (int64_t r = 0; r < n; ++r) {
            const float *x = src + r * src_stride + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; ++i) amax = fmaxf(amax, fabsf(x[i]));
        }
        const float old = off > 0 ? scales[h] : 0.0f; /* offset 0: the block starts afresh */
        const float s = fmaxf(old, amax * KV_INV127);
        if (old > 0.0f && s > old) { /* the scale grew: requantize the codes already there */
            const float ratio = old / s;
            for (int64_t r = 0; r < off; ++r) {
                int8_t *c = codes + r * row + (int64_t)h * head_dim;
                for (int i = 0; i < head_dim; ++i) c[i] = (int8_t)rintf((float)c[i] * ratio);
            }
        }
        scales[h] = s;
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (int64_t r = 0; r < n; ++r) {
            const float *x = src + r * src_stride + (int64_t)h * head_dim;
            int8_t *c = codes + (off + r) * row + (int64_t)h * head_dim;
            for (int i = 0; i < head_dim; ++i) {
                float q = rintf(x[i] * inv);
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                c[i] = (int8_t)q;
            }
        }
    }
}

/* Store `num_tokens` rows at their flat slots (slot = block * block_size + offset), a run of
 * consecutive slots in one block at a time (a prefill chunk quantizes each block once). */
static void kv_store_rows(int kind, char *cache, const float *src, int64_t src_stride, const int64_t *slots,
                          int64_t num_tokens, int block_size, int num_kv_heads, int head_dim) {
    const int64_t bb = kv_block_bytes(kind, block_size, num_kv_heads, head_dim);
    for (int64_t t = 0; t < num_tokens;) {
        const int64_t b = slots[t] / block_size, off = slots[t] - b * block_size;
        int64_t t2 = t + 1;
        while (t2 < num_tokens && slots[t2] == slots[t2 - 1] + 1 && slots[t2] / block_size == b) ++t2;
        kv_store_run(kind, cache + b * bb, off, t2 - t, src + t * src_stride, src_stride, num_kv_heads, head_dim);
        t = t2;
    }
}

/* Exported for the tests: both bfloat16 rounding paths on every machine. */
void kv_bf16_round(const float *src, uint16_t *dst, int64_t n, int portable) { kv_bf16_round_row(src, dst, n, portable); }
#endif
