/* y[M, N] = x[M, K] @ w[N, K]^T with w kept as unsigned 4-bit or 8-bit integer codes in groups
 * along K, w = d * q + m per (group, output column): GPTQ / AWQ / compressed-tensors weights
 * (m = -d * zero) and GGUF's Q4_0 / Q4_1 / Q8_0 blocks (groups of 32) all have this form.
 *
 * Two arithmetic paths over the same packed weights (quantization/int_kernel.py):
 * - exact: each weight is unpacked to float32 in registers (d * q + m, exact in float32 when d is
 *   a float16 / bfloat16 value and m = -d * zero or a float16 value) and multiplied by float32
 *   activations: the same products as dequantize-then-matmul, only summed in another order.
 *   Up to 16 rows the weights are unpacked in registers per row tile; from 17 rows each panel
 *   is unpacked once per chunk of rows and packed_gemm.c's float32 kernel runs against it.
 * - int8: each row of x is quantized on the fly to int8 per block of 32 k (scale = absmax / 127,
 *   finer than per token, as llama.cpp's Q8 activations), and each block's dot products are
 *   integer: sum_k q * xq in int32 (`vpdpbusd` with AVX-512 VNNI: 64 multiply-adds an
 *   instruction against 16 float32 FMAs; AVX2 `vpmaddubsw` + `vpmaddwd` for 4-bit codes; plain C
 *   otherwise), then y += d * (xs * dot) + m * (xs * sum_k xq) in float32 per block.
 * Each library is built for one instruction-set variant (kernels/isa.py picks the best this CPU
 * runs when it loads) and reports it by int_gemm_isa(). The packed layout below is the same in
 * every variant; the register tiles are sized to the variant's vectors and register count:
 * a tile is always 2 vectors of columns (NR = 2 VL: 32 with AVX-512, 16 with AVX2, 8 with SSE),
 * so a 32-column panel is 1, 2 or 4 tiles wide, and its rows (MRE, MRI) fill what remains.
 *
 * Layout, per panel of 32 output columns (columns past N have d = m = 0, q = 0), per group of gs
 * k (gs a multiple of 32 dividing K):
 *   header: float d[32], then zero points uint8 z[32] (OFFSET_ZERO: m = -d * z, derived in
 *           registers) or float m[32] (OFFSET_MIN);
 *   4-bit codes: per 8 k, two 64-byte vectors (columns 0-15, 16-31); in each, byte 4c + j holds
 *           column c's code of k0 + j in its low nibble and of k0 + 4 + j in its high nibble;
 *   8-bit codes: per 4 k, two 64-byte vectors; byte 4c + j is column c's code of k0 + j.
 * So each 32-bit lane of a vector is one column's codes of 4 (8) consecutive k: the operand
 * `vpdpbusd` multiplies by 4 broadcast activation bytes, and a shift and a mask give the
 * exact path one k's 16 weights. Threads split the panels. */
#include <math.h>
#include <stdlib.h>

#include "packed_gemm.c" /* the float32 panel kernel: vf, VL, NR, MR, M_CHUNK, pack_rows, ... */

#define KB 32 /* activation block of the int8 path; groups are multiples of it */
#define IP 32 /* columns of a packed integer panel (the layout's, in every variant) */
#define TILES (IP / NR) /* register tiles across one panel: 1 (AVX-512), 2 (AVX2), 4 */
#if defined(__AVX512F__)
#define MRE 8 /* rows per register tile, exact path (32 vector registers) */
#define MRI 4 /* rows per register tile, int8 path */
#define ACC_BUDGET 16 /* accumulator registers a tile may hold */
#elif defined(__AVX2__)
#define MRE 4 /* 16 registers: 8 accumulators, 2 code vectors, d and m, the weights, 1 broadcast */
#define MRI 4
#define ACC_BUDGET 8
#else
#define MRE 2 /* portable build: small tiles keep gcc's vector lowering (and build) short */
#define MRI 2
#define ACC_BUDGET 8
#endif
#define PANEL_MIN_ROWS 17 /* exact path: from here on unpack each panel once per row chunk */

typedef int32_t i32v __attribute__((vector_size(VL * 4)));

enum { OFFSET_ZERO = 0, OFFSET_MIN = 1 };

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline i32v load_i32v(const uint8_t *p) {
    i32v v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* VL bytes widened to VL float lanes. */
static inline vf u8_to_f32(const uint8_t *p) {
#if VL == 16
    return __builtin_convertvector((i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), vf);
#elif VL == 8 && defined(__AVX2__)
    return __builtin_convertvector((i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), vf);
#else
    i32v r;
    for (int i = 0; i < VL; ++i) r[i] = p[i];
    return __builtin_convertvector(r, vf);
#endif
}

/* Byte offset, inside one 128-byte code vector pair of a panel, of the lanes of column c0 (a
 * multiple of VL): the pair is 64 bytes for columns 0-15 then 64 for 16-31, 4 bytes a column. */
static inline int64_t lane_offset(int64_t c0) { return (c0 / 16) * 64 + (c0 % 16) * 4; }

/* acc[lane] += sum_j byte_j(w[lane]) * x_j for the 4 signed activation bytes of `xquad`: the
 * code bytes are unsigned (0..15 when `small`, else 0..255). */
static inline __attribute__((always_inline)) i32v dot4(i32v acc, i32v w, int32_t xquad,
                                                        const int small) {
#if VL == 16 && defined(__AVX512VNNI__)
    (void)small;
    return (i32v)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(xquad));
#elif VL == 16
    if (small) { /* 15 * 127 * 2 fits int16: vpmaddubsw cannot saturate */
        const __m512i p = _mm512_maddubs_epi16((__m512i)w, _mm512_set1_epi32(xquad));
        return acc + (i32v)_mm512_madd_epi16(p, _mm512_set1_epi16(1));
    } else { /* 8-bit codes: the even and odd bytes apart, widened to int16 (no saturation) */
        const __m512i xw = _mm512_set1_epi32(xquad), m8 = _mm512_set1_epi16(0xFF);
        const __m512i we = _mm512_and_si512((__m512i)w, m8), wo = _mm512_srli_epi16((__m512i)w, 8);
        const __m512i xe = _mm512_srai_epi16(_mm512_slli_epi16(xw, 8), 8), xo = _mm512_srai_epi16(xw, 8);
        return acc + (i32v)_mm512_add_epi32(_mm512_madd_epi16(we, xe), _mm512_madd_epi16(wo, xo));
    }
#elif VL == 8 && defined(__AVXVNNI__)
    (void)small;
    return (i32v)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(xquad));
#elif VL == 8 && defined(__AVX2__)
    if (small) {
        const __m256i p = _mm256_maddubs_epi16((__m256i)w, _mm256_set1_epi32(xquad));
        return acc + (i32v)_mm256_madd_epi16(p, _mm256_set1_epi16(1));
    } else {
        const __m256i xw = _mm256_set1_epi32(xquad), m8 = _mm256_set1_epi16(0xFF);
        const __m256i we = _mm256_and_si256((__m256i)w, m8), wo = _mm256_srli_epi16((__m256i)w, 8);
        const __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(xw, 8), 8), xo = _mm256_srai_epi16(xw, 8);
        return acc + (i32v)_mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo));
    }
#else
    (void)small;
    int8_t xb[4];
    memcpy(xb, &xquad, 4);
    for (int j = 0; j < 4; ++j) acc += ((w >> (8 * j)) & 0xFF) * (int32_t)xb[j];
    return acc;
#endif
}

/* Without VNNI, 4-bit codes: the int16 pair sums of vpmaddubsw for two 4-k quads (lo nibbles
 * with xa, hi with xb), summed in int16; at most 8 such sums (one 32-k block) stay below
 * 8 * 2 * 2 * 15 * 127 / 2 = 30480 < 32767, so they are widened once per block, not per quad. */
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__) && (VL == 16 || (VL == 8 && defined(__AVX2__)))
#define INT16_PARTIALS 1
typedef int16_t i16v __attribute__((vector_size(VL * 4)));
static inline __attribute__((always_inline)) i16v pairs2(i32v lo, i32v hi, int32_t xa, int32_t xb) {
#if VL == 16
    return (i16v)_mm512_add_epi16(_mm512_maddubs_epi16((__m512i)lo, _mm512_set1_epi32(xa)),
                                  _mm512_maddubs_epi16((__m512i)hi, _mm512_set1_epi32(xb)));
#else
    return (i16v)_mm256_add_epi16(_mm256_maddubs_epi16((__m256i)lo, _mm256_set1_epi32(xa)),
                                  _mm256_maddubs_epi16((__m256i)hi, _mm256_set1_epi32(xb)));
#endif
}
static inline i32v widen_pairs(i16v s) {
#if VL == 16
    return (i32v)_mm512_madd_epi16((__m512i)s, _mm512_set1_epi16(1));
#else
    return (i32v)_mm256_madd_epi16((__m256i)s, _mm256_set1_epi16(1));
#endif
}
#else
#define INT16_PARTIALS 0
#endif

int int_gemm_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return 3; /* AVX-512 VNNI */
#elif defined(__AVX512F__)
    return 4; /* AVX-512 without VNNI */
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return 2; /* AVX-VNNI (256-bit) */
#elif defined(__AVX2__)
    return 1; /* AVX2 */
#else
    return 0; /* portable C */
#endif
}

static int64_t header_bytes(int kind) { return IP * 4 + (kind == OFFSET_ZERO ? IP : IP * 4); }

static int64_t group_bytes(int bits, int kind, int64_t gs) {
    return header_bytes(kind) + gs * IP * bits / 8;
}

static int valid(int bits, int kind, int64_t N, int64_t K, int64_t gs) {
    return (bits == 4 || bits == 8) && (kind == OFFSET_ZERO || kind == OFFSET_MIN) && N >= 1 &&
           K >= KB && gs >= KB && gs % KB == 0 && K % gs == 0;
}

/* Bytes of the packed form of an [N, K] weight (-1: unsupported arguments). */
int64_t int_gemm_packed_size(int bits, int kind, int64_t N, int64_t K, int64_t gs) {
    if (!valid(bits, kind, N, K, gs)) return -1;
    return ((N + IP - 1) / IP) * (K / gs) * group_bytes(bits, kind, gs);
}

/* Pack codes q [N, K] (uint8, < 2^bits), d [N, K/gs] and offsets [N, K/gs] (uint8 zero points
 * for OFFSET_ZERO, float m for OFFSET_MIN) into the layout above. */
int int_gemm_pack(int bits, int kind, const uint8_t *q, const float *d, const void *off,
                  uint8_t *out, int64_t N, int64_t K, int64_t gs) {
    if (!valid(bits, kind, N, K, gs)) return 1;
    const int64_t panels = (N + IP - 1) / IP, G = K / gs, gb = group_bytes(bits, kind, gs);
    const int64_t hb = header_bytes(kind);
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t g = 0; g < G; ++g) {
            uint8_t *dst = out + (p * G + g) * gb;
            for (int64_t j = 0; j < IP; ++j) {
                const int64_t n = p * IP + j;
                const float dv = n < N ? d[n * G + g] : 0.0f;
                memcpy(dst + 4 * j, &dv, 4);
                if (kind == OFFSET_ZERO) {
                    dst[IP * 4 + j] = n < N ? ((const uint8_t *)off)[n * G + g] : 0;
                } else {
                    const float mv = n < N ? ((const float *)off)[n * G + g] : 0.0f;
                    memcpy(dst + IP * 4 + 4 * j, &mv, 4);
                }
            }
            uint8_t *codes = dst + hb;
            const int64_t per_vec = bits == 4 ? 8 : 4; /* k per 64-byte vector */
            for (int64_t o = 0; o < gs / per_vec; ++o)
                for (int h = 0; h < 2; ++h) {
                    uint8_t *vec = codes + (o * 2 + h) * 64;
                    for (int c = 0; c < 16; ++c) {
                        const int64_t n = p * IP + 16 * h + c;
                        const uint8_t *row = q + n * K + g * gs + o * per_vec;
                        for (int j = 0; j < 4; ++j) {
                            if (n >= N) {
                                vec[4 * c + j] = 0;
                            } else if (bits == 4) {
                                vec[4 * c + j] = (uint8_t)((row[j] & 15) | (row[j + 4] & 15) << 4);
                            } else {
                                vec[4 * c + j] = row[j];
                            }
                        }
                    }
                }
        }
    return 0;
}

/* A group's d and m for the VL columns from c0 of a panel. */
static inline __attribute__((always_inline)) void group_header(int kind, const uint8_t *hdr,
                                                               int64_t c0, vf *d, vf *m) {
    *d = loadv((const float *)hdr + c0);
    if (kind == OFFSET_ZERO)
        *m = -(u8_to_f32(hdr + IP * 4 + c0) * *d);
    else
        *m = loadv((const float *)(hdr + IP * 4) + c0);
}

/* The weights of k = k0 + jj (jj < 8 for 4-bit, < 4 for 8-bit) from a vector of codes. */
static inline __attribute__((always_inline)) vf weights_of(const i32v v, const int jj,
                                                           const int bits, vf d, vf m) {
    const int shift = bits == 8 ? 8 * jj : (jj < 4 ? 8 * jj : 8 * (jj - 4) + 4);
    const i32v q = (v >> shift) & (bits == 8 ? 0xFF : 0x0F);
    return __builtin_convertvector(q, vf) * d + m;
}

/* Columns [c0, c0 + NR) of one packed panel as float32 [K][NR] (the exact weights), so that
 * packed_gemm.c's tile runs against them. */
static void unpack_subpanel(const int bits, const int kind, const uint8_t *panel, float *out,
                            int64_t K, int64_t gs, int64_t c0) {
    const int64_t gb = group_bytes(bits, kind, gs), hb = header_bytes(kind);
    const int per_vec = bits == 4 ? 8 : 4;
    const int64_t off0 = lane_offset(c0), off1 = lane_offset(c0 + VL);
    for (int64_t g = 0; g < K / gs; ++g) {
        vf d0, d1, m0, m1;
        group_header(kind, panel + g * gb, c0, &d0, &m0);
        group_header(kind, panel + g * gb, c0 + VL, &d1, &m1);
        const uint8_t *codes = panel + g * gb + hb;
        for (int64_t o = 0; o < gs / per_vec; ++o) {
            const i32v v0 = load_i32v(codes + o * 128 + off0), v1 = load_i32v(codes + o * 128 + off1);
            for (int jj = 0; jj < per_vec; ++jj) {
                float *dst = out + (g * gs + o * per_vec + jj) * NR;
                if (bits == 4) {
                    storev(dst, weights_of(v0, jj, 4, d0, m0));
                    storev(dst + VL, weights_of(v1, jj, 4, d1, m1));
                } else {
                    storev(dst, weights_of(v0, jj, 8, d0, m0));
                    storev(dst + VL, weights_of(v1, jj, 8, d1, m1));
                }
            }
        }
    }
}

/* The float32 weight w [N, K] of a packed weight (tests, and layers that need the values). */
int int_gemm_unpack(int bits, int kind, const uint8_t *packed, float *w, int64_t N, int64_t K,
                    int64_t gs) {
    if (!valid(bits, kind, N, K, gs)) return 1;
    const int64_t panels = (N + IP - 1) / IP, panel_bytes = (K / gs) * group_bytes(bits, kind, gs);
    float *fp = (float *)malloc(sizeof(float) * K * NR);
    if (fp == NULL) return 2;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t t = 0; t < TILES; ++t) {
            unpack_subpanel(bits, kind, packed + p * panel_bytes, fp, K, gs, t * NR);
            for (int64_t j = 0; j < NR && p * IP + t * NR + j < N; ++j)
                for (int64_t k = 0; k < K; ++k) w[(p * IP + t * NR + j) * K + k] = fp[k * NR + j];
        }
    free(fp);
    return 0;
}

/* The NR columns of a tile that exist (ncols of the panel's; 0 past N). */
static inline int64_t tile_cols(int64_t ncols, int64_t t) {
    const int64_t left = ncols - t * NR;
    return left < 0 ? 0 : left < NR ? left : NR;
}

/* Exact path: mr rows of x against the NR columns from c0 of one panel, over all of K,
 * unpacking in registers; where the tile leaves room (ACC_BUDGET), two accumulator sets
 * (alternate k) hide the FMA latency. */
static inline __attribute__((always_inline)) void exact_tile(
    const float *x, int64_t ldx, const uint8_t *panel, int64_t c0, float *y, int64_t ldy,
    int64_t K, int64_t gs, int64_t ncols, const int bits, int kind, const int mr) {
    const int sets = 4 * mr <= ACC_BUDGET ? 2 : 1;
    vf a0[MRE][2], a1[MRE][2]; /* the two accumulator sets (a1 unused when sets == 1) */
    for (int i = 0; i < mr; ++i) a0[i][0] = a0[i][1] = a1[i][0] = a1[i][1] = (vf){0};
    const int64_t gb = group_bytes(bits, kind, gs), hb = header_bytes(kind);
    const int per_vec = bits == 4 ? 8 : 4;
    const int64_t off0 = lane_offset(c0), off1 = lane_offset(c0 + VL);
    for (int64_t g = 0; g < K / gs; ++g) {
        vf d0, d1, m0, m1;
        group_header(kind, panel + g * gb, c0, &d0, &m0);
        group_header(kind, panel + g * gb, c0 + VL, &d1, &m1);
        const uint8_t *codes = panel + g * gb + hb;
        for (int64_t o = 0; o < gs / per_vec; ++o) {
            const i32v v0 = load_i32v(codes + o * 128 + off0), v1 = load_i32v(codes + o * 128 + off1);
            const float *xk = x + g * gs + o * per_vec;
#pragma GCC unroll 4
            for (int jj = 0; jj < per_vec; jj += 2) {
                const vf w0 = weights_of(v0, jj, bits, d0, m0), w1 = weights_of(v1, jj, bits, d1, m1);
#pragma GCC unroll 8
                for (int i = 0; i < mr; ++i) {
                    const vf xi = (vf){0} + xk[i * ldx + jj];
                    a0[i][0] += xi * w0;
                    a0[i][1] += xi * w1;
                }
                const vf u0 = weights_of(v0, jj + 1, bits, d0, m0), u1 = weights_of(v1, jj + 1, bits, d1, m1);
#pragma GCC unroll 8
                for (int i = 0; i < mr; ++i) {
                    const vf xi = (vf){0} + xk[i * ldx + jj + 1];
                    if (sets == 2) {
                        a1[i][0] += xi * u0;
                        a1[i][1] += xi * u1;
                    } else {
                        a0[i][0] += xi * u0;
                        a0[i][1] += xi * u1;
                    }
                }
            }
        }
    }
    for (int i = 0; i < mr; ++i) {
        float tmp[NR];
        storev(tmp, sets == 2 ? a0[i][0] + a1[i][0] : a0[i][0]);
        storev(tmp + VL, sets == 2 ? a0[i][1] + a1[i][1] : a0[i][1]);
        memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));
    }
}

#define EXACT_CASE(B, R) \
    case R: exact_tile(x, K, panel, c0, y, N, K, gs, ncols, B, kind, R); break;
#if MRE == 8
#define EXACT_WIDE(B) EXACT_CASE(B, 8) EXACT_CASE(B, 7) EXACT_CASE(B, 6) EXACT_CASE(B, 5) \
                      EXACT_CASE(B, 4) EXACT_CASE(B, 3)
#elif MRE == 4
#define EXACT_WIDE(B) EXACT_CASE(B, 4) EXACT_CASE(B, 3)
#else
#define EXACT_WIDE(B)
#endif
#define EXACT_ROWS(B)                                                                       \
    switch (mr) {                                                                           \
        EXACT_WIDE(B)                                                                       \
        EXACT_CASE(B, 2)                                                                    \
        default: exact_tile(x, K, panel, c0, y, N, K, gs, ncols, B, kind, 1); break;        \
    }

/* Instances per bit width and tile height; the kind of offset is a branch once per group. */
static void exact_rows(int bits, int kind, const float *x, const uint8_t *panel, int64_t c0,
                       float *y, int64_t N, int64_t K, int64_t gs, int64_t ncols, int mr) {
    if (bits == 4) {
        EXACT_ROWS(4)
    } else {
        EXACT_ROWS(8)
    }
}

/* y = x @ w^T in float32 arithmetic. xp_buf: min(M, M_CHUNK) * K floats of caller scratch
 * (used from PANEL_MIN_ROWS rows on). Returns 0, 1 (bad arguments) or 2 (out of memory). */
int int_gemm_exact(int bits, int kind, const float *x, const uint8_t *wp, float *y, float *xp_buf,
                   int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads) {
    if (M < 1 || !valid(bits, kind, N, K, gs)) return 1;
    const int64_t panels = (N + IP - 1) / IP, panel_bytes = (K / gs) * group_bytes(bits, kind, gs);
    const int64_t units = panels * TILES; /* (panel, tile) pairs: what the threads split */
    if (M < PANEL_MIN_ROWS) {
        const int64_t tiles = (M + MRE - 1) / MRE, tile = (M + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 32768)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t p = u / TILES, c0 = (u % TILES) * NR;
            const int64_t ncols = tile_cols(N - p * IP, u % TILES);
            if (ncols == 0) continue;
            for (int64_t r = 0; r < M; r += tile) {
                const int mr = (int)(M - r < tile ? M - r : tile);
                exact_rows(bits, kind, x + r * K, wp + p * panel_bytes, c0, y + r * N + p * IP + c0,
                           N, K, gs, ncols, mr);
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
                failed = 2;
            } else {
#pragma omp for schedule(static)
                for (int64_t u = 0; u < units; ++u) {
                    const int64_t p = u / TILES, c0 = (u % TILES) * NR;
                    const int64_t ncols = tile_cols(N - p * IP, u % TILES);
                    if (ncols == 0) continue;
                    unpack_subpanel(bits, kind, wp + p * panel_bytes, fp, K, gs, c0);
                    chunk_times_panel(xp_buf, fp, y + m0 * N + p * IP + c0, mc, N, K, ncols);
                }
                free(fp);
            }
        }
    }
    return failed;
}

/* ---- int8 path ------------------------------------------------------------------------- */

/* Rows of x as int8 per block of 32 k: xq [M, K], xs [M, K/32] (scale), xsum [M, K/32]
 * (scale * sum of the block's int8 values). */
static void quantize_rows(const float *x, int8_t *xq, float *xs, float *xsum, int64_t M,
                          int64_t K, int num_threads) {
    const int64_t nb = K / KB;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *src = x + r * K + b * KB;
            float amax = 0.0f;
            for (int i = 0; i < KB; ++i) amax = fmaxf(amax, fabsf(src[i]));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < KB; ++i) {
                const int32_t v = (int32_t)lrintf(src[i] * inv);
                const int32_t c = v > 127 ? 127 : (v < -127 ? -127 : v);
                xq[r * K + b * KB + i] = (int8_t)c;
                sum += c;
            }
            xs[r * nb + b] = scale;
            xsum[r * nb + b] = scale * (float)sum;
        }
}

static inline int32_t load_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* int8 path: mr rows against the NR columns from c0 of one panel, over all of K. */
static inline __attribute__((always_inline)) void int8_tile(
    const int8_t *xq, const float *xs, const float *xsum, int64_t K, const uint8_t *panel,
    int64_t c0, float *y, int64_t ldy, int64_t gs, int64_t ncols, const int bits, int kind,
    const int mr) {
    const int64_t nb = K / KB, gb = group_bytes(bits, kind, gs), hb = header_bytes(kind);
    const int64_t off0 = lane_offset(c0), off1 = lane_offset(c0 + VL);
    vf acc[MRI][2];
    for (int i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = (vf){0};
    for (int64_t g = 0; g < K / gs; ++g) {
        const uint8_t *codes = panel + g * gb + hb;
        for (int64_t bb = 0; bb < gs / KB; ++bb) {
            const int64_t b = g * (gs / KB) + bb, k0 = b * KB;
            i32v dot[MRI][2];
            if (bits == 4) {
                const uint8_t *cb = codes + bb * (KB / 8) * 128;
#if INT16_PARTIALS
                /* Without VNNI: the block's nibbles split once (4 x 4 vectors, in L1 when they
                 * do not fit the registers), then row by row two int16 partial sums (see
                 * pairs2): few live registers, where a row-parallel form spilled its partials. */
                i32v nib[KB / 8][4];
#pragma GCC unroll 4
                for (int o = 0; o < KB / 8; ++o) {
                    const i32v v0 = load_i32v(cb + o * 128 + off0), v1 = load_i32v(cb + o * 128 + off1);
                    nib[o][0] = v0 & 0x0F0F0F0F;
                    nib[o][1] = (v0 >> 4) & 0x0F0F0F0F;
                    nib[o][2] = v1 & 0x0F0F0F0F;
                    nib[o][3] = (v1 >> 4) & 0x0F0F0F0F;
                }
                vf d0, d1, m0, m1;
                group_header(kind, panel + g * gb, c0, &d0, &m0);
                group_header(kind, panel + g * gb, c0 + VL, &d1, &m1);
                for (int i = 0; i < mr; ++i) { /* each row's block, then its float epilogue */
                    i16v p0 = {0}, p1 = {0};
#pragma GCC unroll 4
                    for (int o = 0; o < KB / 8; ++o) {
                        const int32_t xa = load_quad(xq + i * K + k0 + o * 8);
                        const int32_t xb = load_quad(xq + i * K + k0 + o * 8 + 4);
                        p0 += pairs2(nib[o][0], nib[o][1], xa, xb);
                        p1 += pairs2(nib[o][2], nib[o][3], xa, xb);
                    }
                    const vf sd = (vf){0} + xs[i * nb + b], sq = (vf){0} + xsum[i * nb + b];
                    acc[i][0] += __builtin_convertvector(widen_pairs(p0), vf) * sd * d0 + m0 * sq;
                    acc[i][1] += __builtin_convertvector(widen_pairs(p1), vf) * sd * d1 + m1 * sq;
                }
                continue; /* the block is summed */
#else
                for (int i = 0; i < mr; ++i) dot[i][0] = dot[i][1] = (i32v){0};
#pragma GCC unroll 4
                for (int o = 0; o < KB / 8; ++o) {
                    const i32v v0 = load_i32v(cb + o * 128 + off0), v1 = load_i32v(cb + o * 128 + off1);
                    const i32v lo0 = v0 & 0x0F0F0F0F, hi0 = (v0 >> 4) & 0x0F0F0F0F;
                    const i32v lo1 = v1 & 0x0F0F0F0F, hi1 = (v1 >> 4) & 0x0F0F0F0F;
#pragma GCC unroll 4
                    for (int i = 0; i < mr; ++i) {
                        const int32_t xa = load_quad(xq + i * K + k0 + o * 8);
                        const int32_t xb = load_quad(xq + i * K + k0 + o * 8 + 4);
                        dot[i][0] = dot4(dot4(dot[i][0], lo0, xa, 1), hi0, xb, 1);
                        dot[i][1] = dot4(dot4(dot[i][1], lo1, xa, 1), hi1, xb, 1);
                    }
                }
#endif
            } else {
                const uint8_t *cb = codes + bb * (KB / 4) * 128;
                for (int i = 0; i < mr; ++i) dot[i][0] = dot[i][1] = (i32v){0};
#pragma GCC unroll 8
                for (int o = 0; o < KB / 4; ++o) {
                    const i32v v0 = load_i32v(cb + o * 128 + off0), v1 = load_i32v(cb + o * 128 + off1);
#pragma GCC unroll 4
                    for (int i = 0; i < mr; ++i) {
                        const int32_t xa = load_quad(xq + i * K + k0 + o * 4);
                        dot[i][0] = dot4(dot[i][0], v0, xa, 0);
                        dot[i][1] = dot4(dot[i][1], v1, xa, 0);
                    }
                }
            }
            vf d0, d1, m0, m1;
            group_header(kind, panel + g * gb, c0, &d0, &m0);
            group_header(kind, panel + g * gb, c0 + VL, &d1, &m1);
#pragma GCC unroll 4
            for (int i = 0; i < mr; ++i) {
                const vf s = (vf){0} + xs[i * nb + b], sq = (vf){0} + xsum[i * nb + b];
                acc[i][0] += __builtin_convertvector(dot[i][0], vf) * s * d0 + m0 * sq;
                acc[i][1] += __builtin_convertvector(dot[i][1], vf) * s * d1 + m1 * sq;
            }
        }
    }
    store_rows(y, ldy, acc, mr, ncols);
}

#define INT8_CASE(B, R) \
    case R: int8_tile(xq, xs, xsum, K, panel, c0, y, N, gs, ncols, B, kind, R); break;
#if MRI == 4
#define INT8_WIDE(B) INT8_CASE(B, 4) INT8_CASE(B, 3)
#else
#define INT8_WIDE(B)
#endif
#define INT8_ROWS(B)                                                                            \
    switch (mr) {                                                                               \
        INT8_WIDE(B)                                                                            \
        INT8_CASE(B, 2)                                                                         \
        default: int8_tile(xq, xs, xsum, K, panel, c0, y, N, gs, ncols, B, kind, 1); break;     \
    }

static void int8_rows(int bits, int kind, const int8_t *xq, const float *xs, const float *xsum,
                      const uint8_t *panel, int64_t c0, float *y, int64_t N, int64_t K, int64_t gs,
                      int64_t ncols, int mr) {
    if (bits == 4) {
        INT8_ROWS(4)
    } else {
        INT8_ROWS(8)
    }
}

/* Bytes of scratch int_gemm_int8 needs for M rows. */
int64_t int_gemm_int8_scratch(int64_t M, int64_t K) {
    return M * K + 2 * M * (K / KB) * (int64_t)sizeof(float) + 64;
}

/* y = x @ w^T with x quantized to int8 per block of 32 (see the top). scratch: at least
 * int_gemm_int8_scratch(M, K) bytes. Rows go in chunks so that a chunk's int8 activations stay
 * in cache while every panel runs over them. Returns 0 or 1 (bad arguments). */
int int_gemm_int8(int bits, int kind, const float *x, const uint8_t *wp, float *y, uint8_t *scratch,
                  int64_t M, int64_t N, int64_t K, int64_t gs, int num_threads) {
    if (M < 1 || !valid(bits, kind, N, K, gs)) return 1;
    const int64_t nb = K / KB;
    float *xs = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *xsum = xs + M * nb;
    int8_t *xq = (int8_t *)(xsum + M * nb);
    quantize_rows(x, xq, xs, xsum, M, K, num_threads);
    const int64_t panels = (N + IP - 1) / IP, panel_bytes = (K / gs) * group_bytes(bits, kind, gs);
    const int64_t units = panels * TILES, chunk = 256;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        const int64_t tiles = (mc + MRI - 1) / MRI, tile = (mc + tiles - 1) / tiles;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (mc * N * K >= 32768)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t p = u / TILES, c0 = (u % TILES) * NR;
            const int64_t ncols = tile_cols(N - p * IP, u % TILES);
            if (ncols == 0) continue;
            for (int64_t r = m0; r < m0 + mc; r += tile) {
                const int mr = (int)(m0 + mc - r < tile ? m0 + mc - r : tile);
                int8_rows(bits, kind, xq + r * K, xs + r * nb, xsum + r * nb, wp + p * panel_bytes, c0,
                          y + r * N + p * IP + c0, N, K, gs, ncols, mr);
            }
        }
    }
    return 0;
}

/* Rows `ids` of the [N, K] weight, as float32 `out [n_ids, K]`: an embedding lookup straight
 * from the packed form (a tied LM head and its embedding share one packed table). Returns 0,
 * 1 (bad arguments) or 3 (an id outside 0..N-1). */
int int_gemm_rows(int bits, int kind, const uint8_t *packed, const int64_t *ids, int64_t n_ids,
                  float *out, int64_t N, int64_t K, int64_t gs) {
    if (!valid(bits, kind, N, K, gs)) return 1;
    const int64_t G = K / gs, gb = group_bytes(bits, kind, gs), hb = header_bytes(kind);
    const int64_t panel_bytes = G * gb;
    for (int64_t r = 0; r < n_ids; ++r)
        if (ids[r] < 0 || ids[r] >= N) return 3;
    for (int64_t r = 0; r < n_ids; ++r) {
        const int64_t n = ids[r], c = n % IP, h = c / 16, cc = c % 16;
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t *hdr = packed + (n / IP) * panel_bytes + g * gb;
            float d, m;
            memcpy(&d, hdr + 4 * c, 4);
            if (kind == OFFSET_ZERO)
                m = -(d * (float)hdr[IP * 4 + c]);
            else
                memcpy(&m, hdr + IP * 4 + 4 * c, 4);
            const uint8_t *codes = hdr + hb;
            float *dst = out + r * K + g * gs;
            for (int64_t k = 0; k < gs; ++k) {
                int q;
                if (bits == 4) {
                    const int64_t o = k / 8, jj = k % 8;
                    const uint8_t byte = codes[(o * 2 + h) * 64 + 4 * cc + (jj & 3)];
                    q = jj < 4 ? (byte & 15) : (byte >> 4);
                } else {
                    q = codes[((k / 4) * 2 + h) * 64 + 4 * cc + (k % 4)];
                }
                dst[k] = (float)q * d + m;
            }
        }
    }
    return 0;
}
