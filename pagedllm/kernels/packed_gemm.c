/* y[M, N] = x[M, K] @ w[N, K]^T, float32, on CPU, with w pre-packed once at load time.
 *
 * Why by hand: MKL's float32 GEMM takes a generic path on AMD CPUs (80 GFLOP/s at 20 rows on a
 * Zen4 whose FMA units give about 227); a decode step and a prefill are nearly all such products.
 *
 * The classic register-blocked scheme: the weight is packed into panels of NR = 2 vectors of
 * output columns, each panel stored k-major (`wp[p][k][0..NR-1]`, columns past N zero), so the
 * inner loop reads two weight vectors per k and broadcasts MR activations against them into
 * 2 * MR vector accumulators: no horizontal sums. The activations are packed per block of MR
 * rows, k-major too (`xp[b][k][0..mr-1]`), so both streams are sequential. Threads split the
 * panels; each panel stays in L2 while every row block of an M-chunk runs over it, and M is cut
 * into chunks so that the packed activations of one chunk stay in cache as well.
 *
 * The tile is sized to the register file the build targets (kernels/isa.py picks the variant):
 * - AVX-512 (32 zmm): vectors of 16 floats, NR 32, MR 12: 24 accumulators + 2 weights + 1;
 * - AVX/AVX2 (16 ymm): vectors of 8, NR 16, MR 6: 12 accumulators + 2 weights + 1 broadcast
 *   (the 12x32 tile of 16-float vectors needed 48 ymm there and spilled on every k: 3 GFLOP/s);
 * - other targets (SSE2's 16 xmm, NEON): vectors of 4, NR 8, MR 6.
 * The packed layout follows NR, so weights are packed by the same library that multiplies them.
 * Any M, N, K >= 1. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16 /* floats per vector register */
#define MR 12
#elif defined(__AVX__)
#define VL 8
#define MR 6
#else
#define VL 4
#define MR 6
#endif
#define NR (2 * VL)
#define M_CHUNK 144 /* a multiple of MR: 144 x K floats of packed activations (<= 0.9 MB at K 1536) */

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

/* The panel width of this build (the Python side sizes nothing by it; tests read it). */
int packed_gemm_panel_width(void) { return NR; }

/* Number of floats in the packed form of an [N, K] weight. */
int64_t packed_weight_size(int64_t N, int64_t K) { return ((N + NR - 1) / NR) * K * NR; }

/* Pack w [N, K] (row-major) into panels wp[N/NR][K][NR], zero-padded past N. */
void pack_weight_f32(const float *w, float *wp, int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; ++p) {
        float *dst = wp + p * K * NR;
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < NR; ++j) {
                const int64_t n = p * NR + j;
                dst[k * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
    }
}

/* acc[i] += x[i] * (w0 | w1) for the mr activations of one k: the tile's 2 * mr FMAs. */
static inline __attribute__((always_inline)) void fma_rows(vf acc[][2], const float *xk, vf w0,
                                                           vf w1, const int mr) {
#pragma GCC unroll 12
    for (int i = 0; i < mr; ++i) {
        const vf xi = (vf){0} + xk[i];
        acc[i][0] += xi * w0;
        acc[i][1] += xi * w1;
    }
}

/* Rows of accumulators into y (only the panel's ncols valid columns). */
static inline void store_rows(float *y, int64_t ldy, vf acc[][2], int mr, int64_t ncols) {
    for (int i = 0; i < mr; ++i) {
        float tmp[NR];
        storev(tmp, acc[i][0]);
        storev(tmp + VL, acc[i][1]);
        memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));
    }
}

/* mr activation rows (packed k-major, stride mr) x one 32-column panel, over all of K. mr is a
 * compile-time constant at each call site, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void micro(const float *xp, const float *wp, float *y,
                                                        int64_t K, int64_t ldy, int64_t ncols,
                                                        const int mr) {
    vf acc[MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = (vf){0};
    for (int64_t k = 0; k < K; ++k) {
        const vf w0 = loadv(wp + k * NR), w1 = loadv(wp + k * NR + VL);
        fma_rows(acc, xp + k * mr, w0, w1, mr);
    }
    if (ncols == NR) {
#pragma GCC unroll 12
        for (int i = 0; i < mr; ++i) {
            storev(y + i * ldy, acc[i][0]);
            storev(y + i * ldy + VL, acc[i][1]);
        }
    } else {
        store_rows(y, ldy, acc, mr, ncols);
    }
}

/* For 1-3 rows the loop above would be bound by FMA latency (each accumulator waits for its
 * previous FMA; 2 FMAs a cycle of latency 4 need 8 chains): split K U ways into independent
 * accumulators instead, U sized so that the 2 * mr * U accumulators fit the register file. */
#if VL == 16
#define NARROW_U(mr) 4 /* 32 zmm: up to 24 accumulators */
#else
#define NARROW_U(mr) ((mr) == 1 ? 4 : 2) /* 16 registers: 8 or 8-12 accumulators */
#endif
static inline __attribute__((always_inline)) void micro_narrow(const float *xp, const float *wp,
                                                               float *y, int64_t K, int64_t ldy,
                                                               int64_t ncols, const int mr) {
    enum { UMAX = 4 };
    const int U = NARROW_U(mr);
    vf acc[UMAX][3][2];
    for (int u = 0; u < U; ++u)
        for (int i = 0; i < mr; ++i) acc[u][i][0] = acc[u][i][1] = (vf){0};
    int64_t k = 0;
    for (; k + U <= K; k += U) {
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
            const vf w0 = loadv(wp + (k + u) * NR), w1 = loadv(wp + (k + u) * NR + VL);
            const float *xk = xp + (k + u) * mr;
            for (int i = 0; i < mr; ++i) {
                const vf xi = (vf){0} + xk[i];
                acc[u][i][0] += xi * w0;
                acc[u][i][1] += xi * w1;
            }
        }
    }
    for (; k < K; ++k) {
        const vf w0 = loadv(wp + k * NR), w1 = loadv(wp + k * NR + VL);
        for (int i = 0; i < mr; ++i) {
            const vf xi = (vf){0} + xp[k * mr + i];
            acc[0][i][0] += xi * w0;
            acc[0][i][1] += xi * w1;
        }
    }
    for (int i = 0; i < mr; ++i) {
        vf s0 = acc[0][i][0], s1 = acc[0][i][1];
        if (U == 4) {
            s0 = (s0 + acc[1][i][0]) + (acc[2][i][0] + acc[3][i][0]);
            s1 = (s1 + acc[1][i][1]) + (acc[2][i][1] + acc[3][i][1]);
        } else {
            s0 += acc[1][i][0];
            s1 += acc[1][i][1];
        }
        float tmp[NR];
        storev(tmp, s0);
        storev(tmp + VL, s1);
        memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));
    }
}

static void run_block(const float *xp, const float *wp, float *y, int64_t K, int64_t ldy,
                      int64_t ncols, int mr) {
    switch (mr) {
#if MR == 12
        case 12: micro(xp, wp, y, K, ldy, ncols, 12); break;
        case 11: micro(xp, wp, y, K, ldy, ncols, 11); break;
        case 10: micro(xp, wp, y, K, ldy, ncols, 10); break;
        case 9: micro(xp, wp, y, K, ldy, ncols, 9); break;
        case 8: micro(xp, wp, y, K, ldy, ncols, 8); break;
        case 7: micro(xp, wp, y, K, ldy, ncols, 7); break;
#endif
        case 6: micro(xp, wp, y, K, ldy, ncols, 6); break;
        case 5: micro(xp, wp, y, K, ldy, ncols, 5); break;
        case 4: micro(xp, wp, y, K, ldy, ncols, 4); break;
        case 3: micro_narrow(xp, wp, y, K, ldy, ncols, 3); break;
        case 2: micro_narrow(xp, wp, y, K, ldy, ncols, 2); break;
        default: micro_narrow(xp, wp, y, K, ldy, ncols, 1); break;
    }
}

/* y = x @ w^T with wp from pack_weight_f32; xp_buf is caller scratch of at least
 * min(M, M_CHUNK) * K floats (the packed activations of one chunk). */
/* Pack rows [m0, m0 + mc) of x into xp_buf: row block b (MR rows, fewer in the last) as [K][mr]. */
static void pack_rows(const float *x, float *xp_buf, int64_t m0, int64_t mc, int64_t K,
                      int num_threads) {
    const int64_t blocks = (mc + MR - 1) / MR;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (mc * K >= 65536)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r0 = b * MR, mr = mc - r0 < MR ? mc - r0 : MR;
        const float *src = x + (m0 + r0) * K;
        float *dst = xp_buf + r0 * K;
        for (int64_t k = 0; k < K; ++k)
            for (int64_t i = 0; i < mr; ++i) dst[k * mr + i] = src[i * K + k];
    }
}

/* Every row block of one packed chunk against one float32 panel. */
static void chunk_times_panel(const float *xp_buf, const float *panel, float *y, int64_t mc,
                              int64_t N, int64_t K, int64_t ncols) {
    for (int64_t r0 = 0; r0 < mc; r0 += MR) {
        const int64_t mr = mc - r0 < MR ? mc - r0 : MR;
        run_block(xp_buf + r0 * K, panel, y + r0 * N, K, N, ncols, (int)mr);
    }
}

int packed_gemm_f32(const float *x, const float *wp, float *y, float *xp_buf, int64_t M,
                    int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1) return 1;
    const int64_t panels = (N + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        pack_rows(x, xp_buf, m0, mc, K, num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (mc * N * K >= 32768)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
            chunk_times_panel(xp_buf, wp + p * K * NR, y + m0 * N + p * NR, mc, N, K, ncols);
        }
    }
    return 0;
}
