/* Batched multi-LoRA products (punica's BGMV / SGMV idea), float32, on CPU: one call serves a
 * batch whose tokens use different adapters, or none, by a per-token slot index.
 *
 *   shrink: out[t, :Rt] = A[idx[t]] @ x[t, :K]               (A: [S, Rt, K]; zeros if idx = -1)
 *   expand: y[t, slice i] += B[idx[t], slice i rows, :R] @ buf[t, i*R : (i+1)*R]
 *                                                           (B: [S, N, R]; untouched if idx = -1)
 *
 * Both are the same operation, `lora_sgmv`: for each token, dot products of one row of X (x, or
 * one slice's R columns of buf) with rows of its slot's weight (A's Rt rows, or a slice's rows
 * of B), with the weight's row-major layout as given (the reduction axis, K or R, contiguous):
 * no packing per call. Tokens come with their indices as they are; the kernel groups runs of
 * consecutive equal indices into tiles of up to MR tokens (a prompt's tokens are one run; a
 * decode batch ordered by adapter is a few), so a weight row loaded into registers serves every
 * token of the tile: the SGMV form without sorting (sorting would cost a gather of x and a
 * scatter of y, each a pass over the batch, at every layer).
 *
 * A tile is MR tokens x NB weight rows (NB1 rows for a one-token tile, so that it still has
 * enough independent FMA chains); its MR * NB accumulators are vectors along the reduction axis,
 * and their lane sums are taken together by a shuffle tree (reduce_lanes: VL - 1 two-source
 * shuffles and adds for VL sums, not VL horizontal sums), which is what keeps expand's short
 * rows (R = 8..64) cheap. Reduction lengths that are not a multiple of the vector are finished
 * with masked loads (never reading past a row). Sizes per build (kernels/isa.py):
 * - AVX-512 (32 zmm): VL 16, tile 4 x 4 (16 accumulators + 4 weight + 4 token vectors), 1 x 8;
 * - AVX2 (16 ymm): VL 8, tile 2 x 4 (8 + 4 + 2), 1 x 8;
 * - portable (SSE2, 16 xmm): VL 4, tile 2 x 4, 1 x 8.
 * Threads split (token tile, block of RB weight rows) pairs, with torch's thread count. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MR 4
#elif defined(__AVX__)
#define VL 8
#define MR 2
#else
#define VL 4
#define MR 2
#endif
#define NB 4 /* weight rows of a tile of 2..MR tokens */
#define NB1 8 /* weight rows of a one-token tile */
#define RB 64 /* weight rows of one work item (a multiple of NB and NB1) */
#define ACC (MR * NB > NB1 ? MR * NB : NB1)
#define PAR_MIN_MACS 65536 /* below this many multiply-adds one thread is faster than a fork */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

/* The first n (< VL) floats at p, zeros after: never reads past p[n - 1]. */
static inline vf load_tail(const float *p, int n) {
#if VL == 16
    return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
#elif VL == 8 && defined(__AVX2__)
    const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    return (vf)_mm256_maskload_ps(p, (__m256i)(lanes < n));
#else
    vf v = {0};
    for (int i = 0; i < n; ++i) v[i] = p[i];
    return v;
#endif
}

/* One level of the shuffle tree: lanes in even blocks of h get a's halves folded (a[l] +
 * a[l + h]), lanes in odd blocks b's (b[l - h] + b[l]). */
static inline __attribute__((always_inline)) vf fold(vf a, vf b, const int h) {
#if VL == 16
    const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif VL == 8
    const vi lanes = {0, 1, 2, 3, 4, 5, 6, 7};
#else
    const vi lanes = {0, 1, 2, 3};
#endif
    const vi odd = (lanes & h) != 0;
    const vi m1 = lanes + (odd & (VL - h)); /* even: a[l]; odd: b[l - h] */
    return __builtin_shuffle(a, b, m1) + __builtin_shuffle(a, b, m1 + h); /* a[l + h]; b[l] */
}

/* Lane j of the result is the sum of v[j]'s lanes, for VL vectors v (overwritten). */
static inline __attribute__((always_inline)) vf reduce_lanes(vf *v) {
#pragma GCC unroll 4
    for (int n = VL; n > 1; n /= 2)
#pragma GCC unroll 8
        for (int k = 0; k < n / 2; ++k) v[k] = fold(v[k], v[k + n / 2], n / 2);
    return v[0];
}

/* mr tokens (rows of x, stride ldx) x nb weight rows (stride ldw; rows past `rows` repeat the
 * last one, their results dropped), over L: y[i][j] (+)= dot(x_i, w_j). */
static inline __attribute__((always_inline)) void dot_tile(
    const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t L, float *y, int64_t ldy,
    int64_t rows, int accumulate, const int mr, const int nb) {
    vf acc[ACC];
#pragma GCC unroll 16
    for (int a = 0; a < mr * nb; ++a) acc[a] = (vf){0};
    const float *wr[NB1];
#pragma GCC unroll 8
    for (int j = 0; j < nb; ++j) wr[j] = w + (j < rows ? j : rows - 1) * ldw;
    int64_t k = 0;
    for (; k + VL <= L; k += VL) {
        vf wv[NB1];
#pragma GCC unroll 8
        for (int j = 0; j < nb; ++j) wv[j] = loadv(wr[j] + k);
#pragma GCC unroll 4
        for (int i = 0; i < mr; ++i) {
            const vf xv = loadv(x + i * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < nb; ++j) acc[i * nb + j] += xv * wv[j];
        }
    }
    if (k < L) {
        const int n = (int)(L - k);
        vf wv[NB1];
#pragma GCC unroll 8
        for (int j = 0; j < nb; ++j) wv[j] = load_tail(wr[j] + k, n);
#pragma GCC unroll 4
        for (int i = 0; i < mr; ++i) {
            const vf xv = load_tail(x + i * ldx + k, n);
#pragma GCC unroll 8
            for (int j = 0; j < nb; ++j) acc[i * nb + j] += xv * wv[j];
        }
    }
    enum { GROUPS = (ACC + VL - 1) / VL };
    float sums[GROUPS * VL];
#pragma GCC unroll 4
    for (int g = 0; g * VL < mr * nb; ++g) {
        vf grp[VL];
#pragma GCC unroll 16
        for (int a = 0; a < VL; ++a) grp[a] = g * VL + a < mr * nb ? acc[g * VL + a] : (vf){0};
        storev(sums + g * VL, reduce_lanes(grp));
    }
    const int64_t cols = rows < nb ? rows : nb;
    for (int i = 0; i < mr; ++i)
        for (int64_t j = 0; j < cols; ++j)
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + sums[i * nb + j] : sums[i * nb + j];
}

/* mr tokens x `rows` weight rows, in tiles (mr is a compile-time constant in each case). */
static void token_tile(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t L,
                       float *y, int64_t ldy, int64_t rows, int accumulate, int mr) {
    switch (mr) {
#if MR == 4
        case 4:
            for (int64_t j = 0; j < rows; j += NB)
                dot_tile(x, ldx, w + j * ldw, ldw, L, y + j, ldy, rows - j, accumulate, 4, NB);
            break;
        case 3:
            for (int64_t j = 0; j < rows; j += NB)
                dot_tile(x, ldx, w + j * ldw, ldw, L, y + j, ldy, rows - j, accumulate, 3, NB);
            break;
#endif
        case 2:
            for (int64_t j = 0; j < rows; j += NB)
                dot_tile(x, ldx, w + j * ldw, ldw, L, y + j, ldy, rows - j, accumulate, 2, NB);
            break;
        default:
            for (int64_t j = 0; j < rows; j += NB1)
                dot_tile(x, ldx, w + j * ldw, ldw, L, y + j, ldy, rows - j, accumulate, 1, NB1);
            break;
    }
}

typedef struct {
    int64_t t0; /* first token */
    int32_t mr; /* tokens (consecutive, one slot) */
    int32_t slot; /* -1: base-model tokens */
} Tile;

/* Tiles of up to MR consecutive tokens with one index; -1 if an index is outside -1..S-1. */
static int64_t make_tiles(const int32_t *idx, int64_t T, int64_t S, Tile *tiles) {
    int64_t n = 0;
    for (int64_t t = 0; t < T;) {
        const int32_t s = idx[t];
        if (s < -1 || s >= S) return -1;
        int64_t end = t + 1;
        while (end < T && end - t < MR && idx[end] == s) ++end;
        tiles[n++] = (Tile){t, (int32_t)(end - t), s};
        t = end;
    }
    return n;
}

/* Weight rows are grouped in n_slices slices of `sizes[i]` rows; slice i's rows read columns
 * [i * L, (i + 1) * L) of x. Shrink: one slice of Rt rows, L = K, y = out, accumulate 0 (rows
 * of -1 tokens zeroed). Expand: the fused layer's slices, L = R, x = buf, y = y, accumulate 1
 * (rows of -1 tokens untouched). w: [S][sum(sizes)][L] contiguous; x and y rows at strides
 * ldx / ldy, unit column stride. Returns 0, 1 (bad sizes), 2 (out of memory), 3 (an index
 * outside -1..S-1: nothing written). */
int lora_sgmv(const float *x, int64_t ldx, const float *w, int64_t S, int64_t L, float *y,
              int64_t ldy, int64_t T, const int32_t *idx, int32_t n_slices, const int64_t *sizes,
              int accumulate, int num_threads) {
    if (T < 0 || S < 1 || L < 1 || n_slices < 1) return 1;
    if (T == 0) return 0;
    int64_t N = 0, blocks = 0;
    for (int32_t i = 0; i < n_slices; ++i) {
        if (sizes[i] < 1) return 1;
        N += sizes[i];
        blocks += (sizes[i] + RB - 1) / RB;
    }
    Tile *tiles = (Tile *)malloc(sizeof(Tile) * T);
    int64_t *block_row = (int64_t *)malloc(sizeof(int64_t) * 3 * blocks);
    if (tiles == NULL || block_row == NULL) {
        free(tiles);
        free(block_row);
        return 2;
    }
    const int64_t n_tiles = make_tiles(idx, T, S, tiles);
    if (n_tiles < 0) {
        free(tiles);
        free(block_row);
        return 3;
    }
    int64_t *block_rows = block_row + blocks, *block_col = block_rows + blocks;
    int64_t b = 0, row0 = 0;
    for (int32_t i = 0; i < n_slices; ++i) {
        for (int64_t r = 0; r < sizes[i]; r += RB) {
            block_row[b] = row0 + r;
            block_rows[b] = sizes[i] - r < RB ? sizes[i] - r : RB;
            block_col[b++] = (int64_t)i * L;
        }
        row0 += sizes[i];
    }
    const int64_t items = n_tiles * blocks;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * N * L >= PAR_MIN_MACS)
    for (int64_t it = 0; it < items; ++it) {
        const Tile tile = tiles[it / blocks];
        const int64_t bb = it % blocks, r0 = block_row[bb], rows = block_rows[bb];
        float *yt = y + tile.t0 * ldy + r0;
        if (tile.slot < 0) {
            if (!accumulate)
                for (int i = 0; i < tile.mr; ++i) memset(yt + i * ldy, 0, sizeof(float) * rows);
            continue;
        }
        token_tile(x + tile.t0 * ldx + block_col[bb], ldx, w + (tile.slot * N + r0) * L, L, L, yt,
                   ldy, rows, accumulate, tile.mr);
    }
    free(tiles);
    free(block_row);
    return 0;
}

/* The vector width of this build, in floats (tests and the benchmark report it). */
int lora_vector_width(void) { return VL; }
