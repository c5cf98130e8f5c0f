/* Batched multi-LoRA products (punica's BGMV / SGMV idea), float32, on CPU: one call serves a
 * batch whose tokens use different adapters, or none, by a per-token slot index.
 *
 *   shrink: out[t, :Rt] = A[idx[t]] @ x[t, :K]               (A: [S, Rt, K]; zeros if idx = -1)
 *   expand: y[t, slice i] += B[idx[t], slice i rows, :R] @ buf[t, i*R : (i+1)*R]
 *                                                           (B: [S, N, R]; untouched if idx = -1)
 *
 * Both are one operation, `lora_sgmv`: per token, dot products of one row of X (x, or one
 * slice's R columns of buf) with rows of its slot's weight (A's Rt rows, or a slice's rows of
 * B), the weights in their row-major layout as given (reduction axis K or R contiguous).
 * Tokens come with their indices in batch order; the kernel cuts runs of consecutive equal
 * indices itself (a prompt's tokens are one run; a decode batch ordered by adapter a few), so
 * that a weight row loaded once serves every token of a tile: the SGMV form without sorting
 * (a sort would cost a gather of x and a scatter of y, each a pass over the batch, per layer).
 *
 * Two paths, per run:
 * - dot tiles (short runs, base-model runs, and every run of shrink): DT tokens x NB weight rows
 *   (NB1 rows for a one-token tile, so that it still has enough independent FMA chains), the
 *   DT * NB accumulators vectors along the reduction axis; their lane sums are taken together by
 *   a shuffle tree (reduce_lanes: VL - 1 two-source shuffles and adds for VL sums, not VL
 *   horizontal sums), which keeps expand's short rows (R = 8..64) cheap. A length that is not
 *   a multiple of the vector ends with masked loads (never reading past a row).
 * - panels (runs of LONG_RUN+ tokens of expand, whose reduction R is short): NR rows of B
 *   are transposed once per (chunk of the run, panel) into packed_gemm.c's k-major layout and
 *   a register tile of packed_gemm.c's shape (MR tokens x NR outputs, x broadcast in place) over the
 *   chunk's tokens: no reductions, the transpose paid once per chunk.
 * Sizes per build (kernels/isa.py):
 * - AVX-512 (32 zmm): VL 16; dot tile 4 x 4 (16 accumulators + 4 weight + 4 token vectors), 1 x 8;
 *   panel tile 12 x 32;
 * - AVX2 (16 ymm): VL 8; dot 2 x 4 (8 + 4 + 2), 1 x 8; panel 6 x 16;
 * - portable (SSE2, 16 xmm): VL 4; dot 2 x 4, 1 x 8; panel 6 x 8.
 * Threads (torch's count) split (dot tile, block of RB weight rows) and (chunk, panel) pairs;
 * below PAR_MIN_MACS multiply-adds one thread runs it all. */
#include <stdlib.h>
#include <string.h>

#include "packed_gemm.c" /* vf, VL (16 / 8 / 4 floats), NR = 2 VL, MR (axpy tile rows), loadv, storev */

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if VL == 16
#define DT 4 /* tokens of a dot tile */
#else
#define DT 2
#endif
#define NB 4 /* weight rows of a dot tile of 2..DT tokens */
#define NB1 8 /* weight rows of a one-token dot tile */
#define RB 64 /* weight rows of one dot work item (a multiple of NB and NB1) */
#define ACC (DT * NB > NB1 ? DT * NB : NB1)
#define LONG_RUN 16 /* runs of at least this many tokens take the panel path ... */
#define PANEL_MAX_L 256 /* ... if the reduction is shorter than this (expand's R, not shrink's K) */
#define PAR_MIN_MACS 65536 /* below this many multiply-adds one thread is faster than a fork */

typedef int32_t vi __attribute__((vector_size(VL * 4)));

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
#if DT == 4
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

/* ---- the panel path (long runs): weight rows transposed once per (chunk, panel) ---------- */

/* Columns [0, ncols) of a panel = weight rows w[j] (stride ldw) as [L][NR], zero past ncols:
 * what packed_gemm.c's layout is, built per call (the stacks are given row-major). */
static void transpose_panel(const float *w, int64_t ldw, int64_t L, int64_t ncols, float *panel) {
    if (ncols < NR) memset(panel, 0, sizeof(float) * L * NR);
    for (int64_t j0 = 0; j0 < ncols; j0 += 8) {
        const int64_t jn = ncols - j0 < 8 ? ncols - j0 : 8;
        for (int64_t k = 0; k < L; ++k)
            for (int64_t j = 0; j < jn; ++j) panel[k * NR + j0 + j] = w[(j0 + j) * ldw + k];
    }
}

/* mr tokens (rows of x, stride ldx) x one panel, over L: broadcast each token's x[k] against
 * the panel's two vectors of k (packed_gemm.c's register tile, x read in place). */
static inline __attribute__((always_inline)) void axpy_tile(
    const float *x, int64_t ldx, const float *panel, int64_t L, float *y, int64_t ldy,
    int64_t ncols, int accumulate, const int mr) {
    vf acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = (vf){0};
    for (int64_t k = 0; k < L; ++k) {
        const vf w0 = loadv(panel + k * NR), w1 = loadv(panel + k * NR + VL);
#pragma GCC unroll 12
        for (int i = 0; i < mr; ++i) {
            const vf xi = (vf){0} + x[i * ldx + k];
            acc[i][0] += xi * w0;
            acc[i][1] += xi * w1;
        }
    }
    for (int i = 0; i < mr; ++i) {
        float *yr = y + i * ldy;
        if (ncols == NR) {
            storev(yr, accumulate ? loadv(yr) + acc[i][0] : acc[i][0]);
            storev(yr + VL, accumulate ? loadv(yr + VL) + acc[i][1] : acc[i][1]);
            continue;
        }
        float tmp[NR];
        storev(tmp, acc[i][0]);
        storev(tmp + VL, acc[i][1]);
        for (int64_t j = 0; j < ncols; ++j) yr[j] = accumulate ? yr[j] + tmp[j] : tmp[j];
    }
}

#define AXPY_CASE(R) \
    case R: axpy_tile(x, ldx, panel, L, y, ldy, ncols, accumulate, R); break;

static void axpy_rows(const float *x, int64_t ldx, const float *panel, int64_t L, float *y,
                      int64_t ldy, int64_t ncols, int accumulate, int mr) {
    switch (mr) {
#if MR == 12
        AXPY_CASE(12) AXPY_CASE(11) AXPY_CASE(10) AXPY_CASE(9) AXPY_CASE(8) AXPY_CASE(7)
#endif
        AXPY_CASE(6) AXPY_CASE(5) AXPY_CASE(4) AXPY_CASE(3) AXPY_CASE(2)
        default: axpy_tile(x, ldx, panel, L, y, ldy, ncols, accumulate, 1); break;
    }
}

/* ---- the driver ------------------------------------------------------------------------------ */

typedef struct {
    int64_t t0; /* first token */
    int32_t n; /* tokens (consecutive, one slot) */
    int32_t slot; /* -1: base-model tokens */
} Group;

/* Weight rows [row, row + rows) reading x's columns [col, col + L). */
typedef struct {
    int64_t row, rows, col;
} Block;

/* Runs of equal consecutive indices: short ones (and base-model ones) cut into dot tiles of up
 * to DT tokens, long ones into `chunks` chunks for the panel path. Returns -1 if an index is
 * outside -1..S-1, else the number of dot tiles (at the front of `groups`); *n_long: chunks
 * (after them, from groups[T]). */
static int64_t make_groups(const int32_t *idx, int64_t T, int64_t S, int64_t chunks_per_long, int long_ok,
                           Group *groups, int64_t *n_long) {
    int64_t n = 0, nl = 0;
    for (int64_t t = 0; t < T;) {
        const int32_t s = idx[t];
        if (s < -1 || s >= S) return -1;
        int64_t end = t + 1;
        while (end < T && idx[end] == s) ++end;
        const int64_t len = end - t;
        if (s >= 0 && long_ok && len >= LONG_RUN) {
            int64_t c = chunks_per_long < len / LONG_RUN ? chunks_per_long : len / LONG_RUN;
            c = c < 1 ? 1 : c;
            const int64_t size = (len + c - 1) / c;
            for (int64_t u = t; u < end; u += size)
                groups[T + nl++] = (Group){u, (int32_t)(end - u < size ? end - u : size), s};
        } else {
            for (int64_t u = t; u < end; u += DT)
                groups[n++] = (Group){u, (int32_t)(end - u < DT ? end - u : DT), s};
        }
        t = end;
    }
    *n_long = nl;
    return n;
}

/* Each slice's rows in blocks of at most `size` rows. */
static int64_t make_blocks(int32_t n_slices, const int64_t *sizes, int64_t L, int64_t size, Block *out) {
    int64_t b = 0, row0 = 0;
    for (int32_t i = 0; i < n_slices; ++i) {
        for (int64_t r = 0; r < sizes[i]; r += size)
            out[b++] = (Block){row0 + r, sizes[i] - r < size ? sizes[i] - r : size, (int64_t)i * L};
        row0 += sizes[i];
    }
    return b;
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
    if (T < 0 || S < 1 || L < 1 || n_slices < 1 || num_threads < 1) return 1;
    if (T == 0) return 0;
    int64_t N = 0, n_blocks = 0, n_panels = 0;
    for (int32_t i = 0; i < n_slices; ++i) {
        if (sizes[i] < 1) return 1;
        N += sizes[i];
        n_blocks += (sizes[i] + RB - 1) / RB;
        n_panels += (sizes[i] + NR - 1) / NR;
    }
    Group *groups = (Group *)malloc(sizeof(Group) * 2 * T);
    Block *blocks = (Block *)malloc(sizeof(Block) * (n_blocks + n_panels));
    if (groups == NULL || blocks == NULL) {
        free(groups);
        free(blocks);
        return 2;
    }
    /* enough chunks of a long run that the threads have about two (chunk, panel) items each */
    const int64_t chunks = (2 * num_threads + n_panels - 1) / n_panels;
    int64_t n_long = 0;
    const int64_t n_tiles = make_groups(idx, T, S, chunks, L < PANEL_MAX_L, groups, &n_long);
    if (n_tiles < 0) {
        free(groups);
        free(blocks);
        return 3;
    }
    Block *panels = blocks + n_blocks;
    make_blocks(n_slices, sizes, L, RB, blocks);
    make_blocks(n_slices, sizes, L, NR, panels);
    const Group *longs = groups + T;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (T * N * L >= PAR_MIN_MACS) reduction(| : failed)
    {
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < n_tiles * n_blocks; ++it) {
            const Group g = groups[it / n_blocks];
            const Block b = blocks[it % n_blocks];
            float *yt = y + g.t0 * ldy + b.row;
            if (g.slot < 0) {
                if (!accumulate)
                    for (int i = 0; i < g.n; ++i) memset(yt + i * ldy, 0, sizeof(float) * b.rows);
                continue;
            }
            token_tile(x + g.t0 * ldx + b.col, ldx, w + (g.slot * N + b.row) * L, L, L, yt, ldy, b.rows,
                       accumulate, g.n);
        }
        float *panel = n_long ? (float *)malloc(sizeof(float) * L * NR) : NULL;
        if (n_long && panel == NULL) failed = 2;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_long * n_panels; ++it) {
            if (panel == NULL) continue;
            const Group g = longs[it / n_panels];
            const Block p = panels[it % n_panels];
            transpose_panel(w + (g.slot * N + p.row) * L, L, L, p.rows, panel);
            for (int64_t t = 0; t < g.n; t += MR) {
                const int mr = (int)(g.n - t < MR ? g.n - t : MR);
                axpy_rows(x + (g.t0 + t) * ldx + p.col, ldx, panel, L, y + (g.t0 + t) * ldy + p.row, ldy,
                          p.rows, accumulate, mr);
            }
        }
        free(panel);
    }
    free(groups);
    free(blocks);
    return failed;
}

/* The vector width of this build, in floats (tests and the benchmark report it). */
int lora_vector_width(void) { return VL; }
