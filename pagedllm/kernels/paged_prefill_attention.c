/* Paged prefill attention on CPU (float32 queries): every prefill sequence of a step (a whole
 * prompt, a chunk on top of cached context, the uncached tail after a prefix hit) in one call,
 * its keys and values read in place from the block-paged cache, whose elements are float32,
 * bfloat16 or int8 with a scale per (block, KV head) (`kind`, kv_cache_types.h): converted as
 * they are loaded; the queries attend to the cache's values, their own included (the same
 * numbers a later decode step reads). Replaces a Python loop over the
 * sequences in every layer, each gathering its whole cached context again (quadratic copying
 * for a long chunked prompt).
 *
 * Layouts (float32 unless noted):
 *   query        [T, num_heads, head_dim], rows `q_stride` floats apart (a view of fused qkv)
 *   key, value   [T, num_kv_heads, head_dim], rows `kv_stride` apart: this step's new K/V,
 *                stored first at the flat cache slots `slots[T]` (int64), converted to the
 *                cache's kind; NULL: already stored
 *   key_cache    num_blocks blocks of [block_size, num_kv_heads, head_dim] (+ int8's header of
 *                scales; kv_cache_types.h)   (value_cache alike)
 *   block_tables [num_seqs, table_width] int64
 *   query_starts, query_lens, context_lens [num_seqs] int64: sequence s owns query rows
 *                query_starts[s] .. + query_lens[s]; its query i sits at absolute position
 *                context_lens[s] - query_lens[s] + i and sees keys 0 .. that position (window
 *                > 0: only the last `window` of them, the transformers convention)
 *   out          [T, num_heads, head_dim] contiguous
 *
 * Work items are (sequence, tile of QT query rows, KV head): the tile's query heads of that KV
 * head (grouped-query attention) share every key row read. Keys are taken a chunk (at most KC
 * positions of one block) at a time; the chunk's keys are transposed into a small buffer so
 * that the scores of one query head against all of them are KC vector lanes (no horizontal
 * sums; int8 codes are scaled as they are transposed), then an online softmax (running maximum
 * and sum) folds the chunk into the output (int8's V scale folded into the chunk's weights).
 *
 * Compiled with -ffast-math (vectorised expf): masked lanes get weight 0 explicitly (no -inf is
 * ever computed), the running maximum starts at -FLT_MAX, and every query sees its own key.
 *
 * Logit soft-capping (Gemma 2's `attn_logit_softcapping`; `paged_prefill_attention_softcap`):
 * each scaled score becomes `softcap * tanh(score / softcap)` before the mask and the softmax,
 * transformers' order; 0 leaves the scores alone (one compare per row and chunk).
 *
 * Returns 0, or: 1 a sequence's lengths are inconsistent (query_len < 1, query_len >
 * context_len, context past its table, query rows past T), 2 a slot outside the cache, 3 a
 * block id outside [0, num_blocks) in a used table entry, 4 an unknown element kind. Nothing
 * is read or written out of
 * bounds then (the checks run before any work). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_common.h"
#include "kv_cache_types.h"

#define QT 16 /* query rows per work item */
#define KC 16 /* key positions per chunk: one 16-float vector of scores, KH register vectors */
#define KH (KC / KVL) /* 1 on AVX-512, 2 on 8-float builds */
#define DV (64 / KVL) /* vectors of the 64 output floats kept in registers per chunk */
#define STACK_FLOATS 8192

/* x[0..KC) = cap * tanh(x / cap): a chunk's scores soft-capped (Gemma's attention logit
 * soft-capping), vectorised through libmvec's tanhf. */
static inline void soft_cap_chunk(float *x, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int t = 0; t < KC; ++t) x[t] = cap * tanhf(x[t] * inv);
}

/* The scores of up to SCORE_HEADS query heads (rows of `qr`, head_dim apart, pre-scaled) against
 * a chunk's transposed keys `kt [head_dim][KC]`, into `S [nh][KC]`: each key vector is loaded
 * once for all the heads (one load per `nh` FMAs, with the query broadcasts), and each head
 * keeps independent sums against the FMA latency (4 for one head, else 2, per register vector
 * of the chunk: at most 8 accumulators on 16-register builds). */
#define SCORE_HEADS (4 / KH)
static inline __attribute__((always_inline)) void chunk_scores(const float *qr, const float *kt, int head_dim,
                                                               const int nh, float *S) {
    enum { CH = 4 };
    const int ch = nh == 1 ? 4 / KH : 2;
    vk a[SCORE_HEADS][KH][CH];
    for (int h = 0; h < nh; ++h)
        for (int f = 0; f < KH; ++f)
            for (int j = 0; j < ch; ++j) a[h][f][j] = (vk){0};
    int d = 0;
    for (; d + ch <= head_dim; d += ch) {
#pragma GCC unroll 4
        for (int j = 0; j < ch; ++j)
#pragma GCC unroll 2
            for (int f = 0; f < KH; ++f) {
                const vk kv = loadk(kt + (int64_t)(d + j) * KC + f * KVL);
#pragma GCC unroll 4
                for (int h = 0; h < nh; ++h) a[h][f][j] += qr[(int64_t)h * head_dim + d + j] * kv;
            }
    }
    for (; d < head_dim; ++d)
        for (int f = 0; f < KH; ++f) {
            const vk kv = loadk(kt + (int64_t)d * KC + f * KVL);
            for (int h = 0; h < nh; ++h) a[h][f][0] += qr[(int64_t)h * head_dim + d] * kv;
        }
    for (int h = 0; h < nh; ++h)
        for (int f = 0; f < KH; ++f) {
            vk t = a[h][f][0];
            for (int j = 1; j < ch; ++j) t += a[h][f][j];
            memcpy(S + (int64_t)h * KC + f * KVL, &t, sizeof(t));
        }
}

static inline __attribute__((always_inline)) void chunk_scores_any(const float *qr, const float *kt, int head_dim,
                                                                   int nh, float *S) {
    switch (nh) {
    case 1: chunk_scores(qr, kt, head_dim, 1, S); break;
#if SCORE_HEADS >= 2
    case 2: chunk_scores(qr, kt, head_dim, 2, S); break;
#endif
#if SCORE_HEADS >= 4
    case 3: chunk_scores(qr, kt, head_dim, 3, S); break;
    case 4: chunk_scores(qr, kt, head_dim, 4, S); break;
#endif
    default: break;
    }
}

/* Inlined into one copy per element kind (attend_tile_kind): `kind` is a constant inside. */
static inline __attribute__((always_inline)) int attend_tile(
    const float *query, int64_t q_stride, const char *key_cache, const char *value_cache,
    const int64_t *table, int64_t q_len, int64_t ctx, int64_t r0, int64_t r1, int kvh, float *out,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window, float softcap,
    int kind) {
    const int group = num_heads / num_kv_heads;
    const int nr = (int)(r1 - r0), nc = nr * group; /* (row, head) combinations */
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int64_t esz = kv_elem_bytes(kind), rowb = row * esz;
    const int64_t bb = kv_block_bytes(kind, block_size, num_kv_heads, head_dim);
    const int64_t hdr = kv_header_bytes(kind, num_kv_heads);
    const int64_t first_pos = ctx - q_len; /* absolute position of query row 0 */
    /* Work buffer: q [nc][D] pre-scaled, acc [nc][D], kt [D][KC], mx, sum [nc]. */
    const int64_t floats = 2 * (int64_t)nc * head_dim + (int64_t)head_dim * KC + 2 * nc;
    float stack_buf[STACK_FLOATS];
    float *q = floats <= STACK_FLOATS ? stack_buf : (float *)malloc(sizeof(float) * floats);
    if (!q) return 1;
    float *acc = q + (int64_t)nc * head_dim, *kt = acc + (int64_t)nc * head_dim;
    float *mx = kt + (int64_t)head_dim * KC, *sum = mx + nc;
    for (int r = 0; r < nr; ++r)
        for (int g = 0; g < group; ++g) {
            const float *src = query + (r0 + r) * q_stride + ((int64_t)kvh * group + g) * head_dim;
            float *dst = q + ((int64_t)r * group + g) * head_dim;
            for (int d = 0; d < head_dim; ++d) dst[d] = src[d] * scale;
        }
    memset(acc, 0, sizeof(float) * (int64_t)nc * head_dim);
    for (int c = 0; c < nc; ++c) { mx[c] = -FLT_MAX; sum[c] = 0.0f; }

    /* Keys the tile needs: from the first row's window start to the last row's position. */
    const int64_t last = first_pos + r1 - 1;
    int64_t k0 = 0;
    if (window > 0 && first_pos + r0 - window + 1 > 0) k0 = first_pos + r0 - window + 1;
    for (int64_t t0 = k0; t0 <= last;) {
        const int64_t b = t0 / block_size, in_block = t0 - b * block_size;
        int64_t t1 = (b + 1) * block_size;
        if (t1 > last + 1) t1 = last + 1;
        if (t1 - t0 > KC) t1 = t0 + KC;
        const int n = (int)(t1 - t0);
        const char *kblk = key_cache + table[b] * bb, *vblk = value_cache + table[b] * bb;
        const float ks = kind == KV_I8 ? ((const float *)kblk)[kvh] : 1.0f;
        const float vs = kind == KV_I8 ? ((const float *)vblk)[kvh] : 1.0f;
        const int64_t base = hdr + (in_block * row + (int64_t)kvh * head_dim) * esz;
        const char *kb = kblk + base, *vb = vblk + base;
        for (int d = 0; d < head_dim; ++d) {
            float *ktd = kt + (int64_t)d * KC;
            for (int t = 0; t < n; ++t) ktd[t] = kind == KV_I8 ? kv_load1(kb + t * rowb, d, kind) * ks : kv_load1(kb + t * rowb, d, kind);
            for (int t = n; t < KC; ++t) ktd[t] = 0.0f;
        }
        for (int r = 0; r < nr; ++r) {
            const int64_t pos = first_pos + r0 + r;
            /* Visible lanes of this chunk for this row: [lo, hi). */
            int64_t lo = 0, hi = n;
            if (pos < t1 - 1) hi = pos - t0 + 1;
            if (window > 0 && pos - window + 1 > t0) lo = pos - window + 1 - t0;
            if (hi <= 0 || lo >= hi) continue;
            for (int gb = 0; gb < group; gb += SCORE_HEADS) {
              const int nh = group - gb < SCORE_HEADS ? group - gb : SCORE_HEADS;
              float S[SCORE_HEADS * KC];
              chunk_scores_any(q + ((int64_t)r * group + gb) * head_dim, kt, head_dim, nh, S);
              for (int g = gb; g < gb + nh; ++g) {
                const int c = r * group + g;
                float *s = S + (int64_t)(g - gb) * KC;
                if (softcap > 0.0f) soft_cap_chunk(s, softcap);
                float m = mx[c];
                for (int t = (int)lo; t < (int)hi; ++t) m = s[t] > m ? s[t] : m;
                const float corr = expf(mx[c] - m);
                float w[KC], ws = 0.0f;
                for (int t = 0; t < KC; ++t) {
                    w[t] = (t >= lo && t < hi) ? expf(s[t] - m) : 0.0f;
                    ws += w[t];
                }
                float wv[KC]; /* the weights of the values: int8's V scale folded in */
                for (int t = 0; t < KC; ++t) wv[t] = kind == KV_I8 ? w[t] * vs : w[t];
                sum[c] = sum[c] * corr + ws;
                mx[c] = m;
                float *ac = acc + (int64_t)c * head_dim;
                if (corr != 1.0f) {
#pragma omp simd
                    for (int d = 0; d < head_dim; ++d) ac[d] *= corr;
                }
                /* acc += w @ V: 64 output floats in registers across the chunk's keys, as DV
                 * vectors of the build's width (8 ymm on AVX2, 4 zmm on AVX-512). */
                int d0 = 0;
                for (; d0 + 64 <= head_dim; d0 += 64) {
                    vk a[DV];
#pragma GCC unroll 8
                    for (int i = 0; i < DV; ++i) a[i] = loadk(ac + d0 + KVL * i);
                    for (int t = (int)lo; t < (int)hi; ++t) {
                        const float wt = wv[t];
                        const char *vt = vb + t * rowb + d0 * esz;
#pragma GCC unroll 8
                        for (int i = 0; i < DV; ++i) a[i] += wt * kv_loadk(vt + KVL * i * esz, kind);
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < DV; ++i) memcpy(ac + d0 + KVL * i, &a[i], sizeof(a[i]));
                }
                for (int t = (int)lo; t < (int)hi; ++t) {
                    const float wt = wv[t];
                    const char *vt = vb + t * rowb;
#pragma omp simd
                    for (int d = d0; d < head_dim; ++d) ac[d] += wt * kv_load1(vt, d, kind);
                }
              }
            }
        }
        t0 = t1;
    }
    for (int r = 0; r < nr; ++r)
        for (int g = 0; g < group; ++g) {
            const int c = r * group + g;
            const float inv = 1.0f / sum[c];
            float *o = out + (r0 + r) * (int64_t)num_heads * head_dim + ((int64_t)kvh * group + g) * head_dim;
            const float *ac = acc + (int64_t)c * head_dim;
            for (int d = 0; d < head_dim; ++d) o[d] = ac[d] * inv;
        }
    if (q != stack_buf) free(q);
    return 0;
}

#define TILE_ARGS query, q_stride, key_cache, value_cache, table, q_len, ctx, r0, r1, kvh, out, num_heads, \
                  num_kv_heads, head_dim, block_size, scale, window, softcap
static int attend_tile_kind(int kind, const float *query, int64_t q_stride, const char *key_cache,
                            const char *value_cache, const int64_t *table, int64_t q_len, int64_t ctx,
                            int64_t r0, int64_t r1, int kvh, float *out, int num_heads, int num_kv_heads,
                            int head_dim, int block_size, float scale, int window, float softcap) {
    switch (kind) {
    case KV_BF16: return attend_tile(TILE_ARGS, KV_BF16);
    case KV_I8: return attend_tile(TILE_ARGS, KV_I8);
    default: return attend_tile(TILE_ARGS, KV_F32);
    }
}

/* `softcap` > 0: the scores are soft-capped (0: not). */
int paged_prefill_attention_softcap(int kind, const float *query, int64_t q_stride, const float *key,
                                    const float *value, int64_t kv_stride, const int64_t *slots,
                                    int64_t num_tokens, void *key_cache, void *value_cache,
                                    const int64_t *block_tables, int table_width,
                                    const int64_t *query_starts, const int64_t *query_lens,
                                    const int64_t *context_lens, int num_seqs, float *out,
                                    int num_heads, int num_kv_heads, int head_dim, int block_size,
                                    int64_t num_blocks, float scale, int window, int num_threads,
                                    float softcap) {
    if (kind != KV_F32 && kind != KV_BF16 && kind != KV_I8) return 4;
    if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1)
        return 1;
    /* Checks first, then all writes, then the reads: a query may see a key written by itself. */
    int64_t num_items = 0;
    for (int s = 0; s < num_seqs; ++s) {
        const int64_t q_len = query_lens[s], ctx = context_lens[s], start = query_starts[s];
        if (q_len < 1 || q_len > ctx || start < 0 || start + q_len > num_tokens) return 1;
        const int64_t used = (ctx + block_size - 1) / block_size;
        if (used > table_width) return 1;
        for (int64_t i = 0; i < used; ++i) {
            const int64_t id = block_tables[(int64_t)s * table_width + i];
            if (id < 0 || id >= num_blocks) return 3;
        }
        num_items += (q_len + QT - 1) / QT;
    }
    if (key != NULL) {
        for (int64_t t = 0; t < num_tokens; ++t)
            if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return 2;
        kv_store_rows(kind, (char *)key_cache, key, kv_stride, slots, num_tokens, block_size, num_kv_heads, head_dim);
        kv_store_rows(kind, (char *)value_cache, value, kv_stride, slots, num_tokens, block_size, num_kv_heads,
                      head_dim);
    }
    /* Item i -> (sequence, tile): a prefix sum over tiles, searched per item (few sequences). */
    int64_t *tile_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!tile_start) return 1;
    tile_start[0] = 0;
    for (int s = 0; s < num_seqs; ++s) tile_start[s + 1] = tile_start[s] + (query_lens[s] + QT - 1) / QT;
    int failed = 0;
    const int64_t total = num_items * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t item = 0; item < total; ++item) {
        const int64_t tile = item / num_kv_heads;
        const int kvh = (int)(item % num_kv_heads);
        int s = 0;
        while (tile_start[s + 1] <= tile) ++s;
        const int64_t r0 = (tile - tile_start[s]) * QT;
        const int64_t r1 = r0 + QT < query_lens[s] ? r0 + QT : query_lens[s];
        const int64_t start = query_starts[s];
        const unsigned csr = ftz_enter();
        failed |= attend_tile_kind(kind, query + start * q_stride, q_stride, (const char *)key_cache,
                              (const char *)value_cache,
                              block_tables + (int64_t)s * table_width, query_lens[s], context_lens[s],
                              r0, r1, kvh, out + start * (int64_t)num_heads * head_dim, num_heads,
                              num_kv_heads, head_dim, block_size, scale, window, softcap);
        ftz_leave(csr);
    }
    free(tile_start);
    return failed;
}

/* The same without soft-capping (the signature kernels/build.py binds). */
int paged_prefill_attention(int kind, const float *query, int64_t q_stride, const float *key,
                            const float *value, int64_t kv_stride, const int64_t *slots,
                            int64_t num_tokens, void *key_cache, void *value_cache,
                            const int64_t *block_tables, int table_width,
                            const int64_t *query_starts, const int64_t *query_lens,
                            const int64_t *context_lens, int num_seqs, float *out,
                            int num_heads, int num_kv_heads, int head_dim, int block_size,
                            int64_t num_blocks, float scale, int window, int num_threads) {
    return paged_prefill_attention_softcap(kind, query, q_stride, key, value, kv_stride, slots, num_tokens,
                                           key_cache, value_cache, block_tables, table_width, query_starts,
                                           query_lens, context_lens, num_seqs, out, num_heads, num_kv_heads,
                                           head_dim, block_size, num_blocks, scale, window, num_threads, 0.0f);
}
