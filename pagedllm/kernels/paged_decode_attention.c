/* Paged decode attention for float32 on CPU: one query token per sequence, K/V read in place
 * from the block-paged cache (no gather, no padding to the longest sequence).
 *
 * Layouts (all contiguous, float32 unless noted):
 *   query        [num_seqs, num_heads, head_dim]
 *   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
 *   block_tables [num_seqs, table_width] int64
 *   context_lens [num_seqs] int64: keys 0 .. ctx-1 are visible (window > 0: the last `window`)
 *   out          [num_seqs, num_heads, head_dim]
 *
 * Work items are whole sequences when there are enough of them to keep every thread busy: a
 * cached token's row (all KV heads) is then read once, whole and in order, which runs near the
 * memory bandwidth (25 GB/s of 28 measured, against 9 GB/s when items were (sequence, KV head)
 * pairs that each read a third of every row; benchmarks/NOTES.md). With few sequences the KV
 * heads are split across items too. Query heads sharing a KV head (grouped-query attention) use
 * the same rows. Two passes: scores (K), softmax, the weighted sum (V).
 *
 * Built with -ffast-math so that expf vectorises (glibc's libmvec): twice as fast here. That is
 * safe: the running maximum starts at -FLT_MAX, not -inf, and every sequence has at least one
 * visible key, so the softmax sum is at least 1. Returns nonzero if a context length is 0 or
 * runs past its block table (nothing is read out of bounds then). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* One work item: one sequence, its KV heads [h0, h1) and their query heads. */
static int attend(const float *query, const float *key_cache, const float *value_cache,
                  const int64_t *table, int64_t ctx, float *out, int num_heads, int num_kv_heads,
                  int head_dim, int block_size, int table_width, float scale, int window, int h0, int h1) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
    const int64_t n = ctx - start;
    if (n <= 0 || (ctx + block_size - 1) / block_size > table_width) return 1;
    const int nh = (h1 - h0) * group;  /* query heads handled */
    float *scores = (float *)malloc(sizeof(float) * nh * n);
    if (!scores) return 1;
    const float *q0 = query + (int64_t)h0 * group * head_dim;
    float *o0 = out + (int64_t)h0 * group * head_dim;
    for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const float *k = key_cache + (table[pos / block_size] * block_size + pos % block_size) * row;
        for (int h = 0; h < nh; ++h)
            scores[h * n + t] = dot(q0 + h * head_dim, k + (int64_t)(h0 + h / group) * head_dim, head_dim) * scale;
    }
    for (int h = 0; h < nh; ++h) {
        float *sc = scores + h * n, m = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) m = sc[t] > m ? sc[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) { sc[t] = expf(sc[t] - m); sum += sc[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
    }
    memset(o0, 0, sizeof(float) * nh * head_dim);
    for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = start + t;
        const float *v = value_cache + (table[pos / block_size] * block_size + pos % block_size) * row;
        for (int h = 0; h < nh; ++h) {
            const float p = scores[h * n + t];
            const float *vh = v + (int64_t)(h0 + h / group) * head_dim;
            float *oh = o0 + h * head_dim;
#pragma omp simd
            for (int i = 0; i < head_dim; ++i) oh[i] += p * vh[i];
        }
    }
    free(scores);
    return 0;
}

int paged_decode_attention_f32(const float *query, const float *key_cache, const float *value_cache,
                               const int64_t *block_tables, const int64_t *context_lens, float *out,
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, int table_width, float scale, int window,
                               int num_threads) {
    const int split = num_seqs >= 2 * num_threads ? 1 : num_kv_heads;
    const int per = num_kv_heads / split;
    /* A small step (one short sequence) is cheaper on one thread than a fork and join. */
    int64_t total = 0;
    for (int s = 0; s < num_seqs; ++s) total += context_lens[s];
    const int parallel = total * num_kv_heads >= 4096;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed) if (parallel)
    for (int item = 0; item < num_seqs * split; ++item) {
        const int s = item / split, part = item % split;
        failed |= attend(query + (int64_t)s * num_heads * head_dim, key_cache, value_cache,
                         block_tables + (int64_t)s * table_width, context_lens[s],
                         out + (int64_t)s * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                         block_size, table_width, scale, window, part * per, (part + 1) * per);
    }
    return failed;
}
