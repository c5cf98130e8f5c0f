/* y[M, N] = x[M, K] @ w[N, K]^T for small M (decode batches), float32, on CPU.
 *
 * Why by hand: MKL's float32 GEMM reaches about 59 GFLOP/s at M = 20 and about 5 at M = 1 on
 * this project's 2-core machines (benchmarks/NOTES.md), far from the compute and memory
 * ceilings; a decode step is nearly all such products. This kernel streams each weight row once
 * from memory and keeps the activations (M x K, a few tens of KB) in cache: output tiles of 4
 * weight rows x 6 activation rows, 24 vector accumulators over K (with the 4 weight vectors and
 * one activation vector, 29 of AVX-512's 32 registers; 6 rows measured 4-8% faster than 4),
 * no packing.
 *
 * Vectors are GCC vector extensions of 16 floats: AVX-512 where `-march=native` has it, two
 * AVX2 registers otherwise. Requires K % 16 == 0 and N % 4 == 0 (the caller checks and falls
 * back to torch otherwise); any M >= 1. */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

/* MR activation rows x 4 weight rows; MR is a constant at each call site (1..6). */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y,
                                                       int64_t K, int64_t N, int MR) {
    v16 acc[6][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = (v16){0};
    for (int64_t k = 0; k < K; k += 16) {
        const v16 w0 = load16(w + k), w1 = load16(w + K + k), w2 = load16(w + 2 * K + k),
                  w3 = load16(w + 3 * K + k);
        for (int i = 0; i < MR; ++i) {
            const v16 xi = load16(x + i * K + k);
            acc[i][0] += xi * w0;
            acc[i][1] += xi * w1;
            acc[i][2] += xi * w2;
            acc[i][3] += xi * w3;
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) y[i * N + j] = hsum(acc[i][j]);
}

int small_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    if (K % 16 != 0 || N % 4 != 0 || M < 1) return 1;
    const int64_t tiles = N / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 32768)
    for (int64_t t = 0; t < tiles; ++t) {
        const float *wt = w + t * 4 * K;
        float *yt = y + t * 4;
        int64_t m = 0;
        for (; m + 6 <= M; m += 6) tile(x + m * K, wt, yt + m * N, K, N, 6);
        switch (M - m) {
            case 5: tile(x + m * K, wt, yt + m * N, K, N, 5); break;
            case 4: tile(x + m * K, wt, yt + m * N, K, N, 4); break;
            case 3: tile(x + m * K, wt, yt + m * N, K, N, 3); break;
            case 2: tile(x + m * K, wt, yt + m * N, K, N, 2); break;
            case 1: tile(x + m * K, wt, yt + m * N, K, N, 1); break;
            default: break;
        }
    }
    return 0;
}
