/* y[M, N] = x[M, K] @ w[N, K]^T for a few rows (decode), float32 arithmetic, with w stored as
 * blocks of 32 weights along K in one of two compact formats:
 *   Q4A: w = d * q + m,  q in 0..15   (d, m per block; GGUF's Q4_1 is this)
 *   Q8S: w = d * q,      q in -127..127 (d per block; GGUF's Q8_0 is this)
 *
 * Why: a decode step at batch 1-8 reads every weight once and is bound by memory bandwidth;
 * float32 weights cost 4 bytes each, these formats 0.75 and 1.125. The caller (layers/linear.py)
 * uses them only for weights that it has checked these formats reproduce bit for bit (d and m
 * are float16 values, so d * q is exact in float32 and d * q + m rounds once, as GGUF's own
 * dequantization does): the products are float32 products with the model's exact weights.
 *
 * Layout, per panel of 32 output columns (columns past N have d = m = 0), per block of 32 k:
 *   Q4A: float d[32], float m[32], uint8 q[32 k][16]  (byte j: column j low nibble, j+16 high)
 *   Q8S: float d[32], int8 q[32 k][32]
 * so the inner loop dequantizes two 16-float weight vectors per k in registers and broadcasts
 * up to MRQ activation rows against them. Threads split the panels. Requires K % 32 == 0. */
#include <stdlib.h>

#include "packed_gemm.c" /* the float32 panel kernel: v16, NR, MR, M_CHUNK, pack_rows, ... */

#define KB 32
#define MRQ 8
#define PANEL_MIN_ROWS 17 /* from here on: dequantize each panel once, then the float32 kernel */

typedef int32_t i32x16 __attribute__((vector_size(64)));

enum { FORMAT_Q4A = 0, FORMAT_Q8S = 1 };

/* 16 bytes widened to 16 int32 lanes (GCC's generic __builtin_convertvector does this with
 * scalar inserts: 3x slower, measured). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline i32x16 widen_u8(const uint8_t *p) {
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline i32x16 widen_s8(const uint8_t *p) {
    return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline i32x16 widen_u8(const uint8_t *p) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    i32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
static inline i32x16 widen_s8(const uint8_t *p) {
    const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    i32x16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#else
static inline i32x16 widen_u8(const uint8_t *p) {
    i32x16 r;
    for (int i = 0; i < 16; ++i) r[i] = p[i];
    return r;
}
static inline i32x16 widen_s8(const uint8_t *p) {
    i32x16 r;
    for (int i = 0; i < 16; ++i) r[i] = (int8_t)p[i];
    return r;
}
#endif

static int64_t block_bytes(int format) {
    return format == FORMAT_Q4A ? 2 * NR * 4 + KB * NR / 2 : NR * 4 + KB * NR;
}

/* Bytes of the packed form of an [N, K] weight in `format`. */
int64_t block_packed_size(int format, int64_t N, int64_t K) {
    return ((N + NR - 1) / NR) * (K / KB) * block_bytes(format);
}

/* Pack codes q [N, K] (uint8 0..15 for Q4A, int8 for Q8S), scales d [N, K/32] and, for Q4A,
 * offsets m [N, K/32] into the panel layout above. */
void block_pack(int format, const uint8_t *q, const float *d, const float *m, uint8_t *out,
                int64_t N, int64_t K) {
    const int64_t panels = (N + NR - 1) / NR, kblocks = K / KB, bb = block_bytes(format);
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < kblocks; ++b) {
            uint8_t *dst = out + (p * kblocks + b) * bb;
            float *dd = (float *)dst;
            float *mm = dd + NR;
            uint8_t *qq = dst + (format == FORMAT_Q4A ? 2 * NR * 4 : NR * 4);
            for (int64_t j = 0; j < NR; ++j) {
                const int64_t n = p * NR + j;
                dd[j] = n < N ? d[n * kblocks + b] : 0.0f;
                if (format == FORMAT_Q4A) mm[j] = n < N ? m[n * kblocks + b] : 0.0f;
            }
            for (int64_t kk = 0; kk < KB; ++kk)
                for (int64_t j = 0; j < NR; ++j) {
                    const int64_t n = p * NR + j;
                    const uint8_t code = n < N ? q[n * K + b * KB + kk] : 0;
                    if (format == FORMAT_Q8S)
                        qq[kk * NR + j] = code;
                    else if (j < 16)
                        qq[kk * 16 + j] = code & 0x0F;
                    else
                        qq[kk * 16 + j - 16] |= (uint8_t)(code << 4);
                }
        }
}

/* The 32 weights of row k (0..31) of a block: exactly d * q (+ m). */
static inline __attribute__((always_inline)) void dequant_k(const int format, const uint8_t *qq,
                                                            int kk, v16 d0, v16 d1, v16 m0,
                                                            v16 m1, v16 *w0, v16 *w1) {
    if (format == FORMAT_Q4A) {
        const i32x16 v = widen_u8(qq + kk * 16);
        *w0 = __builtin_convertvector(v & 15, v16) * d0 + m0;
        *w1 = __builtin_convertvector(v >> 4, v16) * d1 + m1;
    } else {
        *w0 = __builtin_convertvector(widen_s8(qq + kk * NR), v16) * d0;
        *w1 = __builtin_convertvector(widen_s8(qq + kk * NR + 16), v16) * d1;
    }
}

/* The block's scales (and offsets) and where its codes start. */
static inline __attribute__((always_inline)) const uint8_t *block_header(
    const int format, const uint8_t *blk, v16 *d0, v16 *d1, v16 *m0, v16 *m1) {
    *d0 = load16((const float *)blk);
    *d1 = load16((const float *)blk + 16);
    if (format == FORMAT_Q4A) {
        *m0 = load16((const float *)blk + 32);
        *m1 = load16((const float *)blk + 48);
        return blk + 2 * NR * 4;
    }
    *m0 = *m1 = (v16){0};
    return blk + NR * 4;
}

/* mr activation rows x one panel over all of K; for mr <= 4 two accumulator sets (even and odd
 * k) hide the FMA latency. */
static inline __attribute__((always_inline)) void micro_q(const float *x, int64_t ldx,
                                                        const uint8_t *panel, float *y,
                                                        int64_t ldy, int64_t K, int64_t ncols,
                                                        const int format, const int mr) {
    v16 acc[2][MRQ][2];
    for (int s = 0; s < 2; ++s)
        for (int i = 0; i < mr; ++i) acc[s][i][0] = acc[s][i][1] = (v16){0};
    const int64_t bb = block_bytes(format);
    for (int64_t b = 0; b < K / KB; ++b) {
        const uint8_t *blk = panel + b * bb;
        v16 d0, d1, m0, m1;
        const uint8_t *qq = block_header(format, blk, &d0, &d1, &m0, &m1);
        const float *xb = x + b * KB;
#pragma GCC unroll 2
        for (int kk = 0; kk < KB; ++kk) {
            v16 w0, w1;
            dequant_k(format, qq, kk, d0, d1, m0, m1, &w0, &w1);
            const int s = mr <= 4 ? (kk & 1) : 0; /* two sets would not fit the registers */
#pragma GCC unroll 8
            for (int i = 0; i < mr; ++i) {
                const v16 xi = (v16){0} + xb[i * ldx + kk];
                acc[s][i][0] += xi * w0;
                acc[s][i][1] += xi * w1;
            }
        }
    }
    for (int i = 0; i < mr; ++i) {
        float tmp[NR];
        const v16 a0 = acc[0][i][0] + acc[1][i][0], a1 = acc[0][i][1] + acc[1][i][1];
        memcpy(tmp, &a0, 64);
        memcpy(tmp + 16, &a1, 64);
        memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));
    }
}

#define DISPATCH_MR(FMT)                                                     \
    switch (mr) {                                                            \
        case 8: micro_q(x, K, panel, y, N, K, ncols, FMT, 8); break;           \
        case 7: micro_q(x, K, panel, y, N, K, ncols, FMT, 7); break;           \
        case 6: micro_q(x, K, panel, y, N, K, ncols, FMT, 6); break;           \
        case 5: micro_q(x, K, panel, y, N, K, ncols, FMT, 5); break;           \
        case 4: micro_q(x, K, panel, y, N, K, ncols, FMT, 4); break;           \
        case 3: micro_q(x, K, panel, y, N, K, ncols, FMT, 3); break;           \
        case 2: micro_q(x, K, panel, y, N, K, ncols, FMT, 2); break;           \
        default: micro_q(x, K, panel, y, N, K, ncols, FMT, 1); break;          \
    }

static void run_rows(int format, const float *x, const uint8_t *panel, float *y, int64_t N,
                     int64_t K, int64_t ncols, int mr) {
    if (format == FORMAT_Q4A) {
        DISPATCH_MR(FORMAT_Q4A)
    } else {
        DISPATCH_MR(FORMAT_Q8S)
    }
}

/* The first row block of a chunk against a block-format panel: dequantizes each k's weights in
 * registers for its own FMAs and stores them into the float32 panel `fp` for the later row
 * blocks (one dequantization per weight per chunk, no reload for the first block). */
static inline __attribute__((always_inline)) void micro_dq(const int format, const float *xp,
                                                           const uint8_t *panel, float *fp,
                                                           float *y, int64_t K, int64_t ldy,
                                                           int64_t ncols, const int mr) {
    v16 acc[MR][2];
    for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = (v16){0};
    const int64_t bb = block_bytes(format);
    for (int64_t b = 0; b < K / KB; ++b) {
        v16 d0, d1, m0, m1;
        const uint8_t *qq = block_header(format, panel + b * bb, &d0, &d1, &m0, &m1);
        for (int kk = 0; kk < KB; ++kk) {
            const int64_t k = b * KB + kk;
            v16 w0, w1;
            dequant_k(format, qq, kk, d0, d1, m0, m1, &w0, &w1);
            store16(fp + k * NR, w0);
            store16(fp + k * NR + 16, w1);
            fma_rows(acc, xp + k * mr, w0, w1, mr);
        }
    }
    store_rows(y, ldy, acc, mr, ncols);
}

/* The float32 panel [K][32] of one block-format panel. */
static void dequant_panel(const int format, const uint8_t *panel, float *out, int64_t K) {
    const int64_t bb = block_bytes(format);
    for (int64_t b = 0; b < K / KB; ++b) {
        v16 d0, d1, m0, m1, w0, w1;
        const uint8_t *qq = block_header(format, panel + b * bb, &d0, &d1, &m0, &m1);
        for (int kk = 0; kk < KB; ++kk) {
            dequant_k(format, qq, kk, d0, d1, m0, m1, &w0, &w1);
            store16(out + (b * KB + kk) * NR, w0);
            store16(out + (b * KB + kk) * NR + 16, w1);
        }
    }
}

/* y = x @ w^T with w packed by block_pack; xp_buf as for packed_gemm_f32 (used from
 * PANEL_MIN_ROWS rows on).
 * - Up to 16 rows: rows in balanced groups of up to 8, each group over every panel,
 *   dequantizing in registers (the panel is re-read from cache, not memory, for later groups).
 * - More rows: each panel is dequantized once per chunk of rows into a per-thread float32 panel
 *   and the float32 kernel runs every row block against it: float32 speed, with the weights
 *   read from memory at 0.75-1.1 bytes each instead of 4. */
int block_gemm_f32(int format, const float *x, const uint8_t *wp, float *y, float *xp_buf,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < KB || K % KB != 0) return 1;
    const int64_t panels = (N + NR - 1) / NR, panel_bytes = (K / KB) * block_bytes(format);
    if (M < PANEL_MIN_ROWS) {
        const int64_t groups = (M + MRQ - 1) / MRQ, group = (M + groups - 1) / groups;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 32768)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t *panel = wp + p * panel_bytes;
            const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
            for (int64_t r = 0; r < M; r += group) {
                const int mr = (int)(M - r < group ? M - r : group);
                run_rows(format, x + r * K, panel, y + r * N + p * NR, N, K, ncols, mr);
            }
        }
        return 0;
    }
    int failed = 0;
    for (int64_t m0 = 0; m0 < M && !failed; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        pack_rows(x, xp_buf, m0, mc, K, num_threads);
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            float *fp = (float *)malloc(sizeof(float) * K * NR);
            if (fp == NULL) {
                failed = 1;
            } else {
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; ++p) {
                    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
                    float *yp = y + m0 * N + p * NR;
                    const uint8_t *panel = wp + p * panel_bytes;
                    if (mc >= MR) { /* the first full row block dequantizes as it goes */
                        if (format == FORMAT_Q4A)
                            micro_dq(FORMAT_Q4A, xp_buf, panel, fp, yp, K, N, ncols, MR);
                        else
                            micro_dq(FORMAT_Q8S, xp_buf, panel, fp, yp, K, N, ncols, MR);
                        chunk_times_panel(xp_buf + MR * K, fp, yp + MR * N, mc - MR, N, K, ncols);
                    } else {
                        dequant_panel(format, panel, fp, K);
                        chunk_times_panel(xp_buf, fp, yp, mc, N, K, ncols);
                    }
                }
                free(fp);
            }
        }
    }
    return failed;
}
