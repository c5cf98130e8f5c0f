/* Paged decode attention on CPU: one query token per sequence (float32), K/V read in place
 * from the block-paged cache (no gather, no padding to the longest sequence), whose elements are
 * float32, bfloat16 or int8 with a scale per (block, KV head) (`kind`, kv_cache_types.h):
 * converted to float32 in registers as they are loaded; int8 scales are applied once per block
 * (to the scores for K, to the softmax weights for V), not per element.
 *
 * Layouts (all contiguous, float32 unless noted):
 *   query        [num_seqs, num_heads, head_dim]
 *   key_cache    num_blocks blocks of [block_size, num_kv_heads, head_dim] (+ int8's header of
 *                scales; kv_cache_types.h)   (value_cache alike)
 *   block_tables [num_seqs, table_width] int64
 *   context_lens [num_seqs] int64: keys 0 .. ctx-1 are visible (window > 0: the last `window`)
 *   out          [num_seqs, num_heads, head_dim]
 *
 * Work items are whole sequences when there are enough of them to keep every thread busy: a
 * cached token's row (all KV heads) is then read whole and in order (against 9 GB/s when items
 * were (sequence, KV head) pairs that each read a third of every row; benchmarks/NOTES.md). With
 * few sequences the KV heads are split across items too. Query heads sharing a KV head
 * (grouped-query attention) use the same rows.
 *
 * One pass over the blocks with an online softmax (running maximum and sum per head, the
 * partial output rescaled when the maximum grows): each block's K rows, then its V rows, while
 * both are hot, and no score buffer the size of the context. Positions are walked block by
 * block, so there is no division per token (an earlier per-token version spent most of its time
 * on index arithmetic and horizontal sums: 12 GB/s against 35 that the machine reads).
 *
 * Built with -ffast-math so that expf vectorises (glibc's libmvec). That is safe: the running
 * maximum starts at -FLT_MAX, not -inf, and every sequence has at least one visible key, so the
 * softmax sum is at least 1.
 *
 * Logit soft-capping (Gemma 2's `attn_logit_softcapping`; `paged_decode_attention_softcap`):
 * `softcap * tanh(score / softcap)` on every scaled score before the softmax, transformers'
 * order. 0 leaves the scores alone: one compare per (query head, chunk), so the uncapped
 * kernel keeps its speed.
 *
 * Returns 0, or a bit set (nothing is read or written out of bounds then): 1 a context length
 * is 0 or runs past its block table, 2 a slot outside the cache, 4 a block id outside
 * [0, num_blocks) in a table entry the context uses (entries past it are padding, never read),
 * 8 no memory for a work buffer, 16 an unknown element kind. The caller (layers/backends/decode_op.py) names the offending
 * value. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef PF_DIST
#define PF_DIST 4 /* blocks ahead: measured best of 1-8 */
#endif
#ifndef PF_LOC
#define PF_LOC 1 /* into the outer caches: the L1 is busy with this block */
#endif
#ifndef PARALLEL_MIN
#define PARALLEL_MIN 256 /* cached rows x KV heads: below this one thread beats a fork and join */
#endif
#include "kernel_common.h"
#include "kv_cache_types.h"

#define MAX_BLOCK 64   /* block sizes above this take the portable path below in 64-token steps */
#define STACK_FLOATS 8192

/* a . b for a float32 query row and a cache row `b` of element kind `kind`. */
static inline __attribute__((always_inline)) float dot(const float *restrict a, const char *restrict b, int n,
                                                       int kind) {
    if (n % 16 == 0) {
        v16 acc = {0};
        for (int i = 0; i < n; i += 16) acc += load16(a + i) * kv_load16(b + i * kv_elem_bytes(kind), kind);
        float s = 0.0f;
        for (int i = 0; i < 16; ++i) s += acc[i];
        return s;
    }
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * kv_load1(b, i, kind);
    return s;
}

/* s[0..n) = cap * tanh(s / cap): Gemma's attention logit soft-capping. */
static inline void soft_cap(float *restrict s, int n, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int t = 0; t < n; ++t) s[t] = cap * tanhf(s[t] * inv);
}

#if defined(__GNUC__) && !defined(__clang__)
/* The fast path for head_dim 64 (GCC's __builtin_shuffle): scores of 16 positions at a time,
 * their 16 horizontal sums done together by a transposing reduction (15 adds and 30 two-source
 * permutes instead of 16 separate 8-step sums), and the output accumulators of a KV head's
 * query heads kept in registers across a block's positions (not loaded and stored per
 * position). Measured: benchmarks/NOTES.md (issue 10, part 4). */
#define FAST_DIM 64
#define GMAX 4 /* query heads per KV head the fast path takes */
typedef int v16i __attribute__((vector_size(64)));

#if KVL == 16
/* R[i] = sum of the 16 lanes of P[i]. */
static inline v16 hsum16x16(const v16 *P) {
    const v16i m1lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i m1hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i m2lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i m2hi = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i m3lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i m3hi = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i m4lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i m4hi = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 X[8], Y[4], Z[2];
    for (int j = 0; j < 8; ++j)
        X[j] = __builtin_shuffle(P[2 * j], P[2 * j + 1], m1lo) + __builtin_shuffle(P[2 * j], P[2 * j + 1], m1hi);
    for (int j = 0; j < 4; ++j)
        Y[j] = __builtin_shuffle(X[2 * j], X[2 * j + 1], m2lo) + __builtin_shuffle(X[2 * j], X[2 * j + 1], m2hi);
    for (int j = 0; j < 2; ++j)
        Z[j] = __builtin_shuffle(Y[2 * j], Y[2 * j + 1], m3lo) + __builtin_shuffle(Y[2 * j], Y[2 * j + 1], m3hi);
    return __builtin_shuffle(Z[0], Z[1], m4lo) + __builtin_shuffle(Z[0], Z[1], m4hi);
}

/* Scores p[h][0..n) of one chunk, head_dim 64: query heads of KV heads [h0, h1). `kb` is the
 * chunk's first row (bytes), `row` elements apart; `ks` int8's K scales of the block. */
static inline __attribute__((always_inline)) void scores64(const float *q0, const char *kb, int64_t row,
                                                           int n, int h0, int h1, int group, float scale,
                                                           float *p, const char *next, int kind,
                                                           const float *ks) {
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    for (int kh = h0; kh < h1; ++kh) {
        const int hb = (kh - h0) * group;
        const float sc = kind == KV_I8 ? scale * ks[kh] : scale;
        v16 qv[GMAX][4];
        for (int g = 0; g < group; ++g)
            for (int i = 0; i < 4; ++i) qv[g][i] = load16(q0 + (int64_t)(hb + g) * FAST_DIM + 16 * i);
        for (int t16 = 0; t16 < n; t16 += 16) {
            v16 P[GMAX][16];
            for (int t = 0; t < 16; ++t) {
                if (t16 + t < n) {
                    if (next != NULL && kh == h0) /* the next block's row, spread over the loop */
                        for (int64_t off = (int64_t)h0 * FAST_DIM * esz; off < (int64_t)h1 * FAST_DIM * esz; off += 64)
                            __builtin_prefetch(next + (int64_t)(t16 + t) * rowb + off, 0, PF_LOC);
                    const char *k = kb + (int64_t)(t16 + t) * rowb + (int64_t)kh * FAST_DIM * esz;
                    const v16 k0 = kv_load16(k, kind), k1 = kv_load16(k + 16 * esz, kind);
                    const v16 k2 = kv_load16(k + 32 * esz, kind), k3 = kv_load16(k + 48 * esz, kind);
                    for (int g = 0; g < group; ++g)
                        P[g][t] = (qv[g][0] * k0 + qv[g][1] * k1) + (qv[g][2] * k2 + qv[g][3] * k3);
                } else {
                    for (int g = 0; g < group; ++g) P[g][t] = (v16){0};
                }
            }
            for (int g = 0; g < group; ++g) {
                const v16 r = hsum16x16(P[g]) * sc;
                memcpy(p + (int64_t)(hb + g) * MAX_BLOCK + t16, &r, sizeof(r));
            }
        }
    }
}

/* acc[h] += sum_t p[h][t] * V[t] for one chunk, head_dim 64, accumulators in registers; `vs`
 * int8's V scales of the block (folded into the weights). */
static inline __attribute__((always_inline)) void accumulate64(const char *vb, int64_t row, int n, int h0,
                                                               int h1, int group, const float *p, float *acc,
                                                               const char *next, int kind, const float *vs) {
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    for (int kh = h0; kh < h1; ++kh) {
        const int hb = (kh - h0) * group;
        const float sv = kind == KV_I8 ? vs[kh] : 1.0f;
        v16 a[GMAX][4];
        for (int g = 0; g < group; ++g)
            for (int i = 0; i < 4; ++i) a[g][i] = load16(acc + (int64_t)(hb + g) * FAST_DIM + 16 * i);
        for (int t = 0; t < n; ++t) {
            if (next != NULL && kh == h0)
                for (int64_t off = (int64_t)h0 * FAST_DIM * esz; off < (int64_t)h1 * FAST_DIM * esz; off += 64)
                    __builtin_prefetch(next + (int64_t)t * rowb + off, 0, PF_LOC);
            const char *v = vb + (int64_t)t * rowb + (int64_t)kh * FAST_DIM * esz;
            const v16 v0 = kv_load16(v, kind), v1 = kv_load16(v + 16 * esz, kind);
            const v16 v2 = kv_load16(v + 32 * esz, kind), v3 = kv_load16(v + 48 * esz, kind);
            for (int g = 0; g < group; ++g) {
                const float w = kind == KV_I8 ? p[(int64_t)(hb + g) * MAX_BLOCK + t] * sv : p[(int64_t)(hb + g) * MAX_BLOCK + t];
                a[g][0] += w * v0;
                a[g][1] += w * v1;
                a[g][2] += w * v2;
                a[g][3] += w * v3;
            }
        }
        for (int g = 0; g < group; ++g)
            for (int i = 0; i < 4; ++i) memcpy(acc + (int64_t)(hb + g) * FAST_DIM + 16 * i, &a[g][i], sizeof(v16));
    }
}

#else
/* The same two loops for 16-register builds (AVX2: 8-float vectors). A 64-float row is 8 vectors
 * there, so the AVX-512 shape (the query heads' rows and 16 positions' partial sums held in
 * registers: 4 x 12 + 16 x 3 vectors) spilled on every position (decode 2-6x slower than
 * AVX-512's on the same machine). Here the scores loop holds one key row (8 vectors, converted
 * once) and reads each query head's row as FMA memory operands (L1), one horizontal sum per
 * (position, head); the sum loop runs query head by query head, its 8 output vectors in
 * registers, re-reading the block's V rows from L1. */
static inline float hsum8(vk v) {
    float s[KVL];
    memcpy(s, &v, sizeof(s));
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static inline __attribute__((always_inline)) void scores64(const float *q0, const char *kb, int64_t row,
                                                           int n, int h0, int h1, int group, float scale,
                                                           float *p, const char *next, int kind,
                                                           const float *ks) {
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    for (int kh = h0; kh < h1; ++kh) {
        const int hb = (kh - h0) * group;
        const float sc = kind == KV_I8 ? scale * ks[kh] : scale;
        for (int t = 0; t < n; ++t) {
            if (next != NULL && kh == h0)
                for (int64_t off = (int64_t)h0 * FAST_DIM * esz; off < (int64_t)h1 * FAST_DIM * esz; off += 64)
                    __builtin_prefetch(next + (int64_t)t * rowb + off, 0, PF_LOC);
            const char *k = kb + (int64_t)t * rowb + (int64_t)kh * FAST_DIM * esz;
            vk kr[FAST_DIM / KVL];
#pragma GCC unroll 8
            for (int i = 0; i < FAST_DIM / KVL; ++i) kr[i] = kv_loadk(k + KVL * i * esz, kind);
#pragma GCC unroll 4
            for (int g = 0; g < group; ++g) {
                const float *qg = q0 + (int64_t)(hb + g) * FAST_DIM;
                vk a0 = kr[0] * loadk(qg), a1 = kr[1] * loadk(qg + KVL);
#pragma GCC unroll 4
                for (int i = 2; i < FAST_DIM / KVL; i += 2) {
                    a0 += kr[i] * loadk(qg + KVL * i);
                    a1 += kr[i + 1] * loadk(qg + KVL * (i + 1));
                }
                p[(int64_t)(hb + g) * MAX_BLOCK + t] = hsum8(a0 + a1) * sc;
            }
        }
    }
}

static inline __attribute__((always_inline)) void accumulate64(const char *vb, int64_t row, int n, int h0,
                                                               int h1, int group, const float *p, float *acc,
                                                               const char *next, int kind, const float *vs) {
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    for (int kh = h0; kh < h1; ++kh) {
        const int hb = (kh - h0) * group;
        const float sv = kind == KV_I8 ? vs[kh] : 1.0f;
        for (int g = 0; g < group; ++g) {
            float *ag = acc + (int64_t)(hb + g) * FAST_DIM;
            const float *pg = p + (int64_t)(hb + g) * MAX_BLOCK;
            vk a[FAST_DIM / KVL];
#pragma GCC unroll 8
            for (int i = 0; i < FAST_DIM / KVL; ++i) a[i] = loadk(ag + KVL * i);
            for (int t = 0; t < n; ++t) {
                if (next != NULL && kh == h0 && g == 0)
                    for (int64_t off = (int64_t)h0 * FAST_DIM * esz; off < (int64_t)h1 * FAST_DIM * esz; off += 64)
                        __builtin_prefetch(next + (int64_t)t * rowb + off, 0, PF_LOC);
                const char *v = vb + (int64_t)t * rowb + (int64_t)kh * FAST_DIM * esz;
                const float w = kind == KV_I8 ? pg[t] * sv : pg[t];
#pragma GCC unroll 8
                for (int i = 0; i < FAST_DIM / KVL; ++i) a[i] += w * kv_loadk(v + KVL * i * esz, kind);
            }
#pragma GCC unroll 8
            for (int i = 0; i < FAST_DIM / KVL; ++i) memcpy(ag + KVL * i, &a[i], sizeof(a[i]));
        }
    }
}
#endif

/* Specialised per query-head count, so that the loops over g unroll and stay in registers. */
static inline __attribute__((always_inline)) void scores64_any(const float *q0, const char *kb, int64_t row,
                                                               int n, int h0, int h1, int group, float scale,
                                                               float *p, const char *next, int kind,
                                                               const float *ks) {
    switch (group) {
    case 1: scores64(q0, kb, row, n, h0, h1, 1, scale, p, next, kind, ks); break;
    case 2: scores64(q0, kb, row, n, h0, h1, 2, scale, p, next, kind, ks); break;
    case 3: scores64(q0, kb, row, n, h0, h1, 3, scale, p, next, kind, ks); break;
    default: scores64(q0, kb, row, n, h0, h1, 4, scale, p, next, kind, ks); break;
    }
}

static inline __attribute__((always_inline)) void accumulate64_any(const char *vb, int64_t row, int n, int h0,
                                                                   int h1, int group, const float *p, float *acc,
                                                                   const char *next, int kind, const float *vs) {
    switch (group) {
    case 1: accumulate64(vb, row, n, h0, h1, 1, p, acc, next, kind, vs); break;
    case 2: accumulate64(vb, row, n, h0, h1, 2, p, acc, next, kind, vs); break;
    case 3: accumulate64(vb, row, n, h0, h1, 3, p, acc, next, kind, vs); break;
    default: accumulate64(vb, row, n, h0, h1, 4, p, acc, next, kind, vs); break;
    }
}
#define HAVE_FAST64 1
#else
#define HAVE_FAST64 0
#endif

/* One work item: one sequence, its KV heads [h0, h1) and their query heads. Inlined into one
 * copy per element kind (attend_kind), so that `kind` is a constant in every loop. */
static inline __attribute__((always_inline)) int attend(const float *query, const char *key_cache,
                                                        const char *value_cache, const int64_t *table,
                                                        int64_t ctx, float *out, int num_heads,
                                                        int num_kv_heads, int head_dim, int block_size,
                                                        int table_width, int64_t num_blocks, float scale,
                                                        int window, float softcap, int h0, int h1, int kind) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    const int64_t bb = kv_block_bytes(kind, block_size, num_kv_heads, head_dim);
    const int64_t hdr = kv_header_bytes(kind, num_kv_heads);
    const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
    if (ctx - start <= 0 || (ctx + block_size - 1) / block_size > table_width) return 1;
    for (int64_t b = start / block_size; b <= (ctx - 1) / block_size; ++b) /* a compare per block */
        if ((uint64_t)table[b] >= (uint64_t)num_blocks) return 4;
    const int nh = (h1 - h0) * group; /* query heads handled */
    /* One work buffer: acc [nh][head_dim], then mx, sum [nh] and p [nh][MAX_BLOCK]; on the
     * stack unless the heads are many (no allocation per item in the usual case). */
    const int64_t acc_floats = (int64_t)nh * head_dim, floats = acc_floats + (int64_t)nh * (2 + MAX_BLOCK);
    float stack_buf[STACK_FLOATS];
    float *acc = floats <= STACK_FLOATS ? stack_buf : (float *)malloc(sizeof(float) * floats);
    if (!acc) return 8;
    float *mx = acc + acc_floats;
    float *sum = mx + nh, *p = mx + 2 * nh; /* p: [nh][MAX_BLOCK] this chunk's weights */
    memset(acc, 0, sizeof(float) * acc_floats);
    for (int h = 0; h < nh; ++h) { mx[h] = -FLT_MAX; sum[h] = 0.0f; }
    const float *q0 = query + (int64_t)h0 * group * head_dim;
    const int fast = HAVE_FAST64 && head_dim == 64 && group <= 4;

    for (int64_t t0 = start; t0 < ctx;) {
        /* A chunk: the visible positions of one block, at most MAX_BLOCK of them. */
        const int64_t b = t0 / block_size, in_block = t0 - b * block_size;
        int64_t t1 = (b + 1) * block_size < ctx ? (b + 1) * block_size : ctx;
        if (t1 - t0 > MAX_BLOCK) t1 = t0 + MAX_BLOCK;
        const int n = (int)(t1 - t0);
        const char *kblk = key_cache + table[b] * bb, *vblk = value_cache + table[b] * bb;
        const float *ks = (const float *)kblk, *vs = (const float *)vblk; /* int8 only */
        const char *kb = kblk + hdr + in_block * rowb, *vb = vblk + hdr + in_block * rowb;
        /* Blocks lie at random places: fetch the rows of the block PF_DIST ahead while this one
         * computes (the hardware prefetcher alone left the loop at 12-14 GB/s against 40 with
         * the cache warm; 17-20 with this, benchmarks/NOTES.md). */
        const char *next_k = NULL, *next_v = NULL;
        const int64_t ahead = t1 + (PF_DIST - 1) * block_size;
        if (t1 % block_size == 0 && ahead < ctx && ahead / block_size < table_width) {
            const int64_t nbase = table[ahead / block_size] * bb;
            next_k = key_cache + nbase + hdr;
            next_v = value_cache + nbase + hdr;
            if (kind == KV_I8) {
                __builtin_prefetch(key_cache + nbase, 0, PF_LOC);
                __builtin_prefetch(value_cache + nbase, 0, PF_LOC);
            }
        }
        if (fast) {
#if HAVE_FAST64
            /* The next K block's rows prefetched during the scores, its V rows during the sum. */
            scores64_any(q0, kb, row, n, h0, h1, group, scale, p, next_k, kind, ks);
#endif
        } else {
            for (int t = 0; t < n; ++t) {
                if (next_k != NULL && t < block_size) {
                    for (int64_t off = (int64_t)h0 * head_dim * esz; off < (int64_t)h1 * head_dim * esz; off += 64) {
                        __builtin_prefetch(next_k + t * rowb + off, 0, PF_LOC);
                        __builtin_prefetch(next_v + t * rowb + off, 0, PF_LOC);
                    }
                }
                const char *k = kb + t * rowb + (int64_t)h0 * head_dim * esz;
                for (int h = 0; h < nh; ++h) {
                    const int kh = h / group;
                    const float sc = kind == KV_I8 ? scale * ks[h0 + kh] : scale;
                    p[h * MAX_BLOCK + t] = dot(q0 + (int64_t)h * head_dim, k + (int64_t)kh * head_dim * esz, head_dim, kind) * sc;
                }
            }
        }
        for (int h = 0; h < nh; ++h) {
            float *ph = p + h * MAX_BLOCK, m = mx[h];
            if (softcap > 0.0f) soft_cap(ph, n, softcap);
            for (int t = 0; t < n; ++t) m = ph[t] > m ? ph[t] : m;
            const float corr = expf(mx[h] - m);
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int t = 0; t < n; ++t) { ph[t] = expf(ph[t] - m); s += ph[t]; }
            sum[h] = sum[h] * corr + s;
            mx[h] = m;
            if (corr != 1.0f) {
                float *ah = acc + (int64_t)h * head_dim;
#pragma omp simd
                for (int i = 0; i < head_dim; ++i) ah[i] *= corr;
            }
        }
#if HAVE_FAST64
        if (fast) {
            accumulate64_any(vb, row, n, h0, h1, group, p, acc, next_v, kind, vs);
            t0 = t1;
            continue;
        }
#endif
        for (int t = 0; t < n; ++t) {
            const char *v = vb + t * rowb + (int64_t)h0 * head_dim * esz;
            for (int h = 0; h < nh; ++h) {
                const int kh = h / group;
                const float w = kind == KV_I8 ? p[h * MAX_BLOCK + t] * vs[h0 + kh] : p[h * MAX_BLOCK + t];
                const char *vh = v + (int64_t)kh * head_dim * esz;
                float *ah = acc + (int64_t)h * head_dim;
#pragma omp simd
                for (int i = 0; i < head_dim; ++i) ah[i] += w * kv_load1(vh, i, kind);
            }
        }
        t0 = t1;
    }
    float *o0 = out + (int64_t)h0 * group * head_dim;
    for (int h = 0; h < nh; ++h) {
        const float inv = 1.0f / sum[h];
        for (int i = 0; i < head_dim; ++i) o0[(int64_t)h * head_dim + i] = acc[(int64_t)h * head_dim + i] * inv;
    }
    if (acc != stack_buf) free(acc);
    return 0;
}

#define ATTEND_ARGS query, key_cache, value_cache, table, ctx, out, num_heads, num_kv_heads, head_dim, \
                    block_size, table_width, num_blocks, scale, window, softcap, h0, h1
static int attend_kind(int kind, const float *query, const char *key_cache, const char *value_cache,
                       const int64_t *table, int64_t ctx, float *out, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int table_width, int64_t num_blocks, float scale,
                       int window, float softcap, int h0, int h1) {
    switch (kind) {
    case KV_BF16: return attend(ATTEND_ARGS, KV_BF16);
    case KV_I8: return attend(ATTEND_ARGS, KV_I8);
    default: return attend(ATTEND_ARGS, KV_F32);
    }
}

/* `kind`: the cache's element type (KV_F32, KV_BF16, KV_I8). Rows of query/key/value are
 * `q_stride` / `kv_stride` floats apart (views into the fused qkv projection need no copy).
 * When `key` is not NULL, each sequence's new K/V row is first stored at its flat cache slot
 * `slots[s]` (converted or quantized): one call instead of two scatter operators a layer.
 * `softcap` > 0: the scores are soft-capped (0: not). Returns 16 for an unknown kind. */
int paged_decode_attention_softcap(int kind, const float *query, int64_t q_stride, const float *key,
                                   const float *value, int64_t kv_stride, const int64_t *slots,
                                   void *key_cache, void *value_cache, const int64_t *block_tables,
                                   const int64_t *context_lens, float *out, int num_seqs,
                                   int num_heads, int num_kv_heads, int head_dim, int block_size,
                                   int table_width, int64_t num_blocks, float scale, int window,
                                   int num_threads, float softcap) {
    if (kind != KV_F32 && kind != KV_BF16 && kind != KV_I8) return 16;
    const int split = num_seqs >= 2 * num_threads ? 1 : num_kv_heads;
    const int per = num_kv_heads / split;
    if (key != NULL) { /* all writes before any read: another sequence may see a written slot */
        for (int s = 0; s < num_seqs; ++s)
            if (slots[s] < 0 || slots[s] >= num_blocks * block_size) return 2;
        for (int s = 0; s < num_seqs; ++s) {
            kv_store_rows(kind, (char *)key_cache, key + s * kv_stride, kv_stride, slots + s, 1, block_size,
                          num_kv_heads, head_dim);
            kv_store_rows(kind, (char *)value_cache, value + s * kv_stride, kv_stride, slots + s, 1, block_size,
                          num_kv_heads, head_dim);
        }
    }
    /* A small step (one short sequence) is cheaper on one thread than a fork and join. */
    int64_t total = 0;
    for (int s = 0; s < num_seqs; ++s) total += context_lens[s];
    const int parallel = total * num_kv_heads >= PARALLEL_MIN;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed) if (parallel)
    for (int item = 0; item < num_seqs * split; ++item) {
        const int s = item / split, part = item % split;
        const int h0 = part * per, h1 = (part + 1) * per;
        const unsigned csr = ftz_enter();
        failed |= attend_kind(kind, query + s * q_stride, (const char *)key_cache, (const char *)value_cache,
                              block_tables + (int64_t)s * table_width, context_lens[s],
                              out + (int64_t)s * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                              block_size, table_width, num_blocks, scale, window, softcap, h0, h1);
        ftz_leave(csr);
    }
    return failed;
}

/* The same without soft-capping (the signature kernels/build.py binds). */
int paged_decode_attention(int kind, const float *query, int64_t q_stride, const float *key,
                           const float *value, int64_t kv_stride, const int64_t *slots,
                           void *key_cache, void *value_cache, const int64_t *block_tables,
                           const int64_t *context_lens, float *out, int num_seqs,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int table_width, int64_t num_blocks, float scale, int window,
                           int num_threads) {
    return paged_decode_attention_softcap(kind, query, q_stride, key, value, kv_stride, slots, key_cache,
                                          value_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                          num_kv_heads, head_dim, block_size, table_width, num_blocks, scale,
                                          window, num_threads, 0.0f);
}
