/* y[M, N] (row stride ldy) = x[M, K] @ w[N, K]^T with w in llama.cpp's own GGUF block formats,
 * read in place: the rows of a memory-mapped file, byte for byte (no repacking, no float copy).
 *
 * One table of type traits (`TRAITS`): per type its block length, block bytes and one decoder
 * that turns a block into int8 codes q and, per 16 weights, a float scale s and offset m with
 * w = s * q + m. That form is exact for every type here: s is a float16 scale times a small
 * integer (at most 11 + 8 significant bits), s * q needs at most 24 bits (float32's mantissa),
 * so s * q + m rounds once, as llama.cpp's and gguf-py's dequantization do. Everything else is
 * shared by all types:
 * - exact path: each block is decoded, widened to float32 in L1 (w = s * q + m) and multiplied
 *   by float32 activations with FMAs: dequantize-then-matmul's products, summed in another order.
 *   Up to 31 rows that runs per chunk of 16 rows; from PANEL_FROM (32) rows on, each panel of NR
 *   weight rows is decoded once per chunk of rows into
 *   packed_gemm.c's panel layout and its register-tiled float kernel runs against it.
 * - int8 path: each activation row is quantized per 32 k (scale absmax / 127, llama.cpp's Q8_0
 *   grain, finer than its Q8_K), and every 16 weights' dot product is an integer one:
 *   y += s * xs * sum(q * xq) + m * sum(x). The integer products use the build's instruction set
 *   (gcc vectorizes the widening multiply-add; VNNI's vpdpwssd where the build has it).
 * Threads split the weight rows (OpenMP, torch's own pool: see build.py). */
#include <math.h>
#include <stdlib.h>

#include "packed_gemm.c" /* vf, VL, NR, MR, M_CHUNK, pack_rows, chunk_times_panel */

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define SUB 16 /* weights per scale / offset in the decoded form */
#define QMAX 256 /* the longest block */
#define XB 32 /* activation block of the int8 path */
#define PANEL_ROWS 17 /* exact path: scratch is passed from here on (gguf_kernel.py) */
#define PANEL_FROM 32 /* exact path: from here on decode panels once per row chunk (measured on Zen4,
                         * Q4_K / Q6_K GFLOP/s, factored vs panels: 20 rows 75 / 58, 32 rows 72 / 82,
                         * 64 rows 73 / 119) */

/* ggml's type numbers (gguf-py's GGMLQuantizationType) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
       T_IQ4_XS = 23, T_BF16 = 30, T_COUNT = 31 };

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as the branches below */
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (e == 0) { /* zero or subnormal: mant * 2^-24, exact in float32 */
        const float v = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* Each decoder: block b -> q[len], s[len / 16], m[len / 16]. */
typedef void (*decode_fn)(const uint8_t *b, int8_t *q, float *s, float *m);

static void set_subs(float *s, float *m, int first, int count, float sv, float mv) {
    for (int i = first; i < first + count; ++i) s[i] = sv, m[i] = mv;
}

static void dec_q4_0(const uint8_t *b, int8_t *q, float *s, float *m) {
    for (int j = 0; j < 16; ++j) q[j] = (int8_t)((b[2 + j] & 0xF) - 8), q[j + 16] = (int8_t)((b[2 + j] >> 4) - 8);
    set_subs(s, m, 0, 2, f16(b), 0.0f);
}

static void dec_q4_1(const uint8_t *b, int8_t *q, float *s, float *m) {
    for (int j = 0; j < 16; ++j) q[j] = (int8_t)(b[4 + j] & 0xF), q[j + 16] = (int8_t)(b[4 + j] >> 4);
    set_subs(s, m, 0, 2, f16(b), f16(b + 2));
}

static void dec_q5(const uint8_t *qs, uint32_t qh, int8_t *q, int bias) {
    for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t)(((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - bias);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
    }
}

static void dec_q5_0(const uint8_t *b, int8_t *q, float *s, float *m) {
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    dec_q5(b + 6, qh, q, 16);
    set_subs(s, m, 0, 2, f16(b), 0.0f);
}

static void dec_q5_1(const uint8_t *b, int8_t *q, float *s, float *m) {
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    dec_q5(b + 8, qh, q, 0);
    set_subs(s, m, 0, 2, f16(b), f16(b + 2));
}

static void dec_q8_0(const uint8_t *b, int8_t *q, float *s, float *m) {
    memcpy(q, b + 2, 32);
    set_subs(s, m, 0, 2, f16(b), 0.0f);
}

static void dec_iq4_nl(const uint8_t *b, int8_t *q, float *s, float *m) {
    for (int j = 0; j < 16; ++j) q[j] = IQ4_VALUES[b[2 + j] & 0xF], q[j + 16] = IQ4_VALUES[b[2 + j] >> 4];
    set_subs(s, m, 0, 2, f16(b), 0.0f);
}

/* Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. */
static void dec_q2_k(const uint8_t *b, int8_t *q, float *s, float *m) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int half = 0; half < 2; ++half)
        for (int shift = 0, j = 0; j < 4; ++j, shift += 2)
            for (int h = 0; h < 2; ++h) {
                const int sub = half * 8 + j * 2 + h;
                for (int l = 0; l < 16; ++l) q[sub * 16 + l] = (int8_t)((qs[half * 32 + h * 16 + l] >> shift) & 3);
                s[sub] = d * (float)(sc[sub] & 0xF);
                m[sub] = -(dmin * (float)(sc[sub] >> 4));
            }
}

/* Q3_K: hmask[32], qs[64], scales[12] (16 six-bit signed scales), d. */
static void dec_q3_k(const uint8_t *b, int8_t *q, float *s, float *m) {
    const uint8_t *hm = b, *qs = b + 32;
    const float d = f16(b + 108);
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    const uint32_t tmp = aux[2], k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    const int8_t *scales = (const int8_t *)aux;
    uint8_t bit = 1;
    for (int half = 0; half < 2; ++half)
        for (int shift = 0, j = 0; j < 4; ++j, shift += 2, bit <<= 1)
            for (int h = 0; h < 2; ++h) {
                const int sub = half * 8 + j * 2 + h;
                for (int l = 0; l < 16; ++l) {
                    const int i = h * 16 + l;
                    q[sub * 16 + l] = (int8_t)(((qs[half * 32 + i] >> shift) & 3) - ((hm[i] & bit) ? 0 : 4));
                }
                s[sub] = d * (float)(scales[sub] - 32);
                m[sub] = 0.0f;
            }
}

/* The six-bit scale and minimum of sub-block j of Q4_K / Q5_K. */
static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The eight six-bit scales then the eight minimums of a Q4_K / Q5_K block, one per byte: the
 * 12 packed bytes unpacked with masks on 32-bit words, as llama.cpp does. */
static inline void k4_unpack(const uint8_t *b, uint32_t u[4]) {
    memcpy(u, b + 4, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
}

#if defined(__AVX2__)
/* The same 16 bytes in a register (built from the words, not stored and reloaded: a 16-byte load
 * of four 4-byte stores cannot be forwarded and stalls). */
static inline __m128i k4_scale_bytes(const uint8_t *b) {
    uint32_t u[4];
    k4_unpack(b, u);
    return _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
}
#endif

/* The eight scales and minimums of a Q4_K / Q5_K block as floats (d * sc, -dmin * mn) per 32. */
static inline void k4_scales8(const uint8_t *b, float *s8, float *m8) {
    const float d = f16(b), dmin = f16(b + 2);
#if defined(__AVX2__) /* one vector conversion each: scalar ones cost more than the block's whole
                       * product at one activation row */
    const __m128i bytes = k4_scale_bytes(b);
    _mm256_storeu_ps(s8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(d)));
    _mm256_storeu_ps(m8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                                       _mm256_set1_ps(-dmin)));
#else
    uint32_t u[4];
    k4_unpack(b, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    for (int j = 0; j < 8; ++j) s8[j] = d * (float)sc[j], m8[j] = -(dmin * (float)mn[j]);
#endif
}

static void k4_scales(const uint8_t *b, float *s, float *m) {
    float s8[8], m8[8];
    k4_scales8(b, s8, m8);
    for (int j = 0; j < 8; ++j) set_subs(s, m, 2 * j, 2, s8[j], m8[j]);
}

/* Q4_K: d, dmin, scales[12], qs[128]. */
static void dec_q4_k(const uint8_t *b, int8_t *q, float *s, float *m) {
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) q[c * 64 + l] = (int8_t)(qs[c * 32 + l] & 0xF), q[c * 64 + 32 + l] = (int8_t)(qs[c * 32 + l] >> 4);
    k4_scales(b, s, m);
}

/* Q5_K: d, dmin, scales[12], qh[32], qs[128]. */
static void dec_q5_k(const uint8_t *b, int8_t *q, float *s, float *m) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            q[c * 64 + l] = (int8_t)((qs[c * 32 + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4));
            q[c * 64 + 32 + l] = (int8_t)((qs[c * 32 + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
        }
    k4_scales(b, s, m);
}

/* Q6_K: ql[128], qh[64], scales int8[16], d. */
static void dec_q6_k(const uint8_t *b, int8_t *q, float *s, float *m) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    for (int half = 0; half < 2; ++half) {
        const uint8_t *l0 = ql + half * 64, *h0 = qh + half * 32;
        int8_t *o = q + half * 128;
        for (int l = 0; l < 32; ++l) {
            o[l] = (int8_t)(((l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = (int8_t)(((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t)(((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t)(((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32);
        }
    }
    for (int i = 0; i < 16; ++i) s[i] = d * (float)sc[i], m[i] = 0.0f;
}

/* IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]. */
static void dec_iq4_xs(const uint8_t *b, int8_t *q, float *s, float *m) {
    const float d = f16(b);
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ++ib) {
        const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        set_subs(s, m, 2 * ib, 2, d * (float)(ls - 32), 0.0f);
        for (int j = 0; j < 16; ++j)
            q[ib * 32 + j] = IQ4_VALUES[qs[ib * 16 + j] & 0xF], q[ib * 32 + 16 + j] = IQ4_VALUES[qs[ib * 16 + j] >> 4];
    }
}

typedef struct {
    int block;      /* weights per block (0: not supported) */
    int bytes;      /* bytes per block */
    decode_fn decode; /* NULL: a float type (F32 / F16 / BF16), widened directly */
} traits_t;

static const traits_t TRAITS[T_COUNT] = {
    [T_F32] = {32, 128, NULL},       [T_F16] = {32, 64, NULL},        [T_BF16] = {32, 64, NULL},
    [T_Q4_0] = {32, 18, dec_q4_0},   [T_Q4_1] = {32, 20, dec_q4_1},   [T_Q5_0] = {32, 22, dec_q5_0},
    [T_Q5_1] = {32, 24, dec_q5_1},   [T_Q8_0] = {32, 34, dec_q8_0},   [T_Q2_K] = {256, 84, dec_q2_k},
    [T_Q3_K] = {256, 110, dec_q3_k}, [T_Q4_K] = {256, 144, dec_q4_k}, [T_Q5_K] = {256, 176, dec_q5_k},
    [T_Q6_K] = {256, 210, dec_q6_k}, [T_IQ4_NL] = {32, 18, dec_iq4_nl}, [T_IQ4_XS] = {256, 136, dec_iq4_xs},
};

static const traits_t *traits_of(int type, int64_t K) {
    if (type < 0 || type >= T_COUNT || TRAITS[type].block == 0) return NULL;
    if (K < 1 || K % TRAITS[type].block) return NULL;
    return &TRAITS[type];
}

/* Block length and bytes of `type` (0 if this kernel does not take it). */
int gguf_block_length(int type) { return type >= 0 && type < T_COUNT ? TRAITS[type].block : 0; }
int gguf_block_bytes(int type) { return type >= 0 && type < T_COUNT ? TRAITS[type].bytes : 0; }

int gguf_gemm_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return 3;
#elif defined(__AVX512F__)
    return 4;
#elif defined(__AVX2__) && defined(__AVXVNNI__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* One block of `t` widened to float32: w = s * q + m (float types: their values). */
static inline void widen_block(const traits_t *t, int type, const uint8_t *b, float *w) {
    const int n = t->block;
    if (t->decode == NULL) {
        if (type == T_F32) memcpy(w, b, (size_t)n * 4);
        else if (type == T_F16) for (int i = 0; i < n; ++i) w[i] = f16(b + 2 * i);
        else for (int i = 0; i < n; ++i) w[i] = bf16(b + 2 * i);
        return;
    }
    int8_t q[QMAX];
    float s[QMAX / SUB], m[QMAX / SUB];
    t->decode(b, q, s, m);
    for (int j = 0; j < n / SUB; ++j) {
        const float sj = s[j], mj = m[j];
#pragma GCC unroll 16
        for (int i = 0; i < SUB; ++i) w[j * SUB + i] = sj * (float)q[j * SUB + i] + mj;
    }
}

/* Row r of w (row_bytes apart) widened into out[K]. */
static void widen_row(const traits_t *t, int type, const uint8_t *row, float *out, int64_t K) {
    for (int64_t b = 0; b < K / t->block; ++b) widen_block(t, type, row + b * t->bytes, out + b * t->block);
}

/* Rows ids[0 .. n_ids) of w [N, K] widened to float32 out[n_ids, K] (an embedding lookup;
 * ids NULL: every row). 3 if an id is out of range, 1 for an unsupported type or shape. */
int gguf_rows(int type, const uint8_t *w, const int64_t *ids, int64_t n_ids, float *out, int64_t N,
              int64_t K, int num_threads) {
    const traits_t *t = traits_of(type, K);
    if (t == NULL) return 1;
    for (int64_t i = 0; i < n_ids; ++i)
        if (ids != NULL && (ids[i] < 0 || ids[i] >= N)) return 3;
    const int64_t row_bytes = K / t->block * t->bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n_ids * K >= 65536)
    for (int64_t i = 0; i < n_ids; ++i) widen_row(t, type, w + (ids ? ids[i] : i) * row_bytes, out + i * K, K);
    return 0;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; ++i) s += v[i];
    return s;
}

/* Weight rows are read once per product: ask for the row PREFETCH_ROWS ahead while this one is
 * computed (the hardware prefetcher alone streamed a third of the memory bandwidth here). Into
 * the outer caches (prefetcht2), not non-temporally: on a 2-core Xeon (AVX-512) prefetchnta left
 * the 1-row products of 28 Qwen2-1.5B layers at 8.9 (Q4_K int8) / 9.3 (Q6_K int8) / 6.3 (Q4_K
 * exact) GB/s, prefetcht2 at 14.2 / 19.2 / 8.6 (benchmarks/gguf_types.py); AMD treats both alike. */
#define PREFETCH_ROWS 2
static inline void prefetch_row(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

/* ---- exact path, few rows: weights widened in registers, 16 at a time ---------------------- */

typedef int32_t i32v __attribute__((vector_size(VL * 4)));

/* VL bytes widened to VL int32 lanes (zero- or sign-extended): one vpmovzxbd / vpmovsxbd where
 * the build has them (gcc lowers __builtin_convertvector of bytes lane by lane). */
static inline i32v u8_to_i32(const uint8_t *p) {
#if VL == 16
    return (i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VL == 8 && defined(__AVX2__)
    return (i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    i32v r;
    for (int i = 0; i < VL; ++i) r[i] = p[i];
    return r;
#endif
}

static inline i32v i8_to_i32(const int8_t *p) {
#if VL == 16
    return (i32v)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VL == 8 && defined(__AVX2__)
    return (i32v)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    i32v r;
    for (int i = 0; i < VL; ++i) r[i] = p[i];
    return r;
#endif
}

/* VL weights (codes q0 .. q0 + VL - 1 of the decoded form) as float32: s * q + m. */
static inline __attribute__((always_inline)) vf widen_codes(const int8_t *q, float s, float m) {
    return __builtin_convertvector(i8_to_i32(q), vf) * s + m;
}

/* The VL weights at position k (a multiple of VL) of one block, straight from its bytes, for
 * the types most files are made of (Q4_K, Q6_K and, where rows are not whole super-blocks,
 * Q5_0 / Q8_0: a Q4_K_M file is nearly all of them; and Q4_0 / Q4_1 / Q5_1);
 * `s` and `m` are the block's decoded scales per 16. Other types go through their decoder. */
static inline __attribute__((always_inline)) vf direct_weights(const int type, const uint8_t *b,
                                                               const int k, const float *s,
                                                               const float *m) {
    const int sub = k / SUB;
    if (type == T_Q4_K) { /* 64 weights per 32 bytes: low nibbles, then high */
        const int c = k / 64, hi = (k / 32) & 1, l = k % 32;
        const i32v code = (u8_to_i32(b + 16 + c * 32 + l) >> (4 * hi)) & 0xF;
        return __builtin_convertvector(code, vf) * s[k / 32] + m[k / 32]; /* scales per 32 */
    }
    if (type == T_Q6_K) { /* per 128: ql low, ql+32 low, ql high, ql+32 high; qh 2 bits each */
        const int half = k / 128, quarter = (k / 32) & 3, l = k % 32;
        const i32v lo = u8_to_i32(b + half * 64 + (quarter & 1) * 32 + l);
        const i32v hb = u8_to_i32(b + 128 + half * 32 + l);
        const i32v code = (((lo >> (4 * (quarter >> 1))) & 0xF) | (((hb >> (2 * quarter)) & 3) << 4)) - 32;
        return __builtin_convertvector(code, vf) * s[sub];
    }
    if (type == T_Q8_0) return __builtin_convertvector(i8_to_i32((const int8_t *)b + 2 + k), vf) * s[0];
    /* Q4_0 / Q4_1 / Q5_0 / Q5_1: weights 0-15 in the low nibbles of 16 bytes, 16-31 in the high;
     * Q5's fifth bits are bit j of a 32-bit word for weight j */
    const int qs = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    i32v code = (u8_to_i32(b + qs + k % 16) >> (4 * (k / 16))) & 0xF;
    if (type == T_Q5_0 || type == T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + (type == T_Q5_0 ? 2 : 4), 4);
        i32v lane;
        for (int i = 0; i < VL; ++i) lane[i] = k + i;
        code |= (((i32v){0} + (int32_t)qh) >> lane & 1) << 4;
    }
    if (type == T_Q4_0) return __builtin_convertvector(code - 8, vf) * s[0];
    if (type == T_Q5_0) return __builtin_convertvector(code - 16, vf) * s[0];
    return __builtin_convertvector(code, vf) * s[0] + m[0]; /* Q4_1, Q5_1 */
}

/* Whether a type has a direct form above. */
#define IS_DIRECT(type) ((type) == T_Q4_K || (type) == T_Q6_K || (type) == T_Q8_0 || (type) == T_Q4_0 || \
                         (type) == T_Q4_1 || (type) == T_Q5_0 || (type) == T_Q5_1)

/* Rows [r0, r1) of W against M activation rows (M <= MSMALL; a constant where the caller
 * specializes it; `type` a constant too: -1 for the types without a direct form, whose real
 * type is `any_type`), 4 accumulators per row so that FMA latency does not bind at one row. */
#define MSMALL (PANEL_ROWS - 1)
static inline __attribute__((always_inline)) void exact_rows(
    const traits_t *t, const int type, const int any_type, const float *x, const uint8_t *w, float *y, const int64_t M,
    int64_t r0, int64_t r1, int64_t K, int64_t ldy) {
    const int64_t row_bytes = K / t->block * t->bytes, nb = K / t->block;
    const int n = t->block;
    const int direct = IS_DIRECT(type);
    for (int64_t r = r0; r < r1; ++r) {
        vf acc[MSMALL][4];
        prefetch_row(w + (r + PREFETCH_ROWS) * row_bytes, r + PREFETCH_ROWS < r1 ? row_bytes : 0);
        for (int64_t i = 0; i < M; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = (vf){0};
        const uint8_t *row = w + r * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * t->bytes;
            const float *xb = x + b * n;
            int8_t q[QMAX] __attribute__((aligned(64)));
            float s[QMAX / SUB], m[QMAX / SUB];
            if (t->decode == NULL) { /* float types: widened values */
                float wb[QMAX] __attribute__((aligned(64)));
                widen_block(t, any_type, blk, wb);
                for (int k = 0; k < n; k += VL)
                    for (int64_t i = 0; i < M; ++i) acc[i][(k / VL) & 3] += loadv(wb + k) * loadv(xb + i * K + k);
                continue;
            }
            if (type == T_Q4_K) k4_scales8(blk, s, m);
            else if (type == T_Q6_K) {
                const float d = f16(blk + 208);
                for (int j = 0; j < 16; ++j) s[j] = d * (float)((const int8_t *)(blk + 192))[j];
            } else if (type == T_Q8_0 || type == T_Q4_0 || type == T_Q5_0) {
                s[0] = f16(blk);
            } else if (type == T_Q4_1 || type == T_Q5_1) {
                s[0] = f16(blk), m[0] = f16(blk + 2);
            } else {
                t->decode(blk, q, s, m);
            }
#define STEP(kk, u)                                                                                   \
    {                                                                                                \
        const vf wv = direct ? direct_weights(type, blk, k + (kk), s, m)                             \
                             : widen_codes(q + k + (kk), s[(k + (kk)) / SUB], m[(k + (kk)) / SUB]); \
        for (int64_t i = 0; i < M; ++i) acc[i][u] += wv * loadv(xb + i * K + k + (kk));            \
    }
            if (type == T_Q4_K || type == T_Q6_K) { /* 256 weights: four chains of FMAs */
#pragma GCC unroll 16
                for (int k = 0; k < 256; k += 4 * VL) { STEP(0, 0) STEP(VL, 1) STEP(2 * VL, 2) STEP(3 * VL, 3) }
            } else { /* blocks of 32 or 256: two chains per block, the other two on odd blocks */
                const int u = (int)(b & 1) * 2;
                for (int k = 0; k < n; k += 2 * VL) {
                    if (u) { STEP(0, 2) STEP(VL, 3) } else { STEP(0, 0) STEP(VL, 1) }
                }
            }
#undef STEP
        }
        for (int64_t i = 0; i < M; ++i) y[i * ldy + r] = hsum((acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]));
    }
}

/* One specialization per (type family, row count up to 4): constants let gcc keep the
 * accumulators in registers and fold the type's branches. */
static void exact_rows_any(const traits_t *t, int type, const float *x, const uint8_t *w, float *y,
                           int64_t M, int64_t r0, int64_t r1, int64_t K, int64_t ldy) {
#define ROWS_FOR(TYPE)                                                              \
    switch (M) {                                                                    \
        case 1: exact_rows(t, TYPE, type, x, w, y, 1, r0, r1, K, ldy); break;     \
        case 2: exact_rows(t, TYPE, type, x, w, y, 2, r0, r1, K, ldy); break;     \
        case 3: exact_rows(t, TYPE, type, x, w, y, 3, r0, r1, K, ldy); break;     \
        case 4: exact_rows(t, TYPE, type, x, w, y, 4, r0, r1, K, ldy); break;     \
        default: exact_rows(t, TYPE, type, x, w, y, M, r0, r1, K, ldy); break;    \
    }
    switch (type) {
        case T_Q4_K: ROWS_FOR(T_Q4_K); break;
        case T_Q6_K: ROWS_FOR(T_Q6_K); break;
        case T_Q8_0: ROWS_FOR(T_Q8_0); break;
        case T_Q4_0: ROWS_FOR(T_Q4_0); break;
        case T_Q4_1: ROWS_FOR(T_Q4_1); break;
        case T_Q5_0: ROWS_FOR(T_Q5_0); break;
        case T_Q5_1: ROWS_FOR(T_Q5_1); break;
        default: ROWS_FOR(-1); break; /* -1: no direct form; the type's decoder */
    }
#undef ROWS_FOR
}

/* ---- exact path, few rows, Q4_K / Q6_K: scales factored out of the inner sum -----------------
 * Most of a K-quant file is Q4_K and Q6_K. Their weights are s * q + m per sub-block, so a row's
 * product is sum_sub s_sub * sum(q * x) + m_sub * sum(x): the codes are widened to float and
 * multiplied by the float32 activations, and the sub-block's scale is applied once to that sum
 * (the minimums and Q6_K's code offset of 32 go through per-sub-block sums of the activations).
 * Each product q * x is exact in float32 (q has at most 6 bits), so only the order of the sums
 * changes against dequantize-then-matmul. The codes come out of the bytes without shuffles:
 * each vector lane holds one 32-bit word of packed codes, and code t of every lane is
 * (word >> 4t) & 0xF (Q6_K: its two high bits, from qh, the same way); the activations are put
 * once in that lane order per call (reorder_*), so 16 weights cost a shift, a mask, a
 * conversion and one FMA, where widening first (s * q + m, then the FMA) cost twice that:
 * Q4_K at one row ran at 11% of the weight-streaming floor that way. Vectors of at least 8
 * floats (AVX2, AVX-512); other builds keep the path above. */
#if VL >= 8 && defined(__AVX2__)
#define FACTORED 1
typedef int32_t fi32v __attribute__((vector_size(VL * 4)));
typedef uint32_t fu32v __attribute__((vector_size(VL * 4))); /* logical shifts: a top code needs no mask */
typedef float v8f __attribute__((vector_size(32)));
#define Q4K_GROUPS (128 / (4 * VL)) /* 4*VL code bytes (VL words, 8 codes each) per group */
#define Q6K_GROUPS (64 / (4 * VL))  /* per half of 128 weights */

static inline fu32v load_words(const uint8_t *p) {
    fu32v v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Weight index (within a block of 256) of code t of lane j of group g: Q4_K's 32-byte chunks hold
 * weights c*64 + l in their low nibbles and c*64 + 32 + l in their high ones. */
static inline int q4k_weight(int g, int t, int j) {
    const int p = g * 4 * VL + 4 * j + t / 2;
    return (p / 32) * 64 + (t & 1) * 32 + p % 32;
}

/* Q6_K: per half of 128, ql byte p = l + 32 * (p / 32) holds weights l + 32 * (p / 32) (low
 * nibble) and + 64 (high); qh byte l holds their high two bits at 2 * (p / 32) + 4 * nibble. */
static inline int q6k_weight(int half, int g, int t, int j) {
    const int p = g * 4 * VL + 4 * j + t / 2;
    return half * 128 + (t & 1) * 64 + 32 * (p / 32) + p % 32;
}

/* Activation rows x[M, K] in the lane order above (xr[M, K]) and their sums per sub-block
 * (xsum[M, K / sub]): Q4_K's minimums and Q6_K's offset of 32 are sub-block scalars. */
static void reorder_activations(int type, const float *x, float *xr, float *xsum, int64_t M, int64_t K) {
    int16_t perm[256];
    for (int t = 0; t < 8; ++t)
        for (int j = 0; j < VL; ++j) {
            if (type == T_Q4_K)
                for (int g = 0; g < Q4K_GROUPS; ++g) perm[g * 8 * VL + t * VL + j] = (int16_t)q4k_weight(g, t, j);
            else
                for (int half = 0; half < 2; ++half)
                    for (int g = 0; g < Q6K_GROUPS; ++g)
                        perm[half * 128 + g * 8 * VL + t * VL + j] = (int16_t)q6k_weight(half, g, t, j);
        }
    const int sub = type == T_Q4_K ? 32 : 16;
    for (int64_t i = 0; i < M; ++i)
        for (int64_t b = 0; b < K / 256; ++b) {
            const float *src = x + i * K + b * 256;
            float *dst = xr + i * K + b * 256;
            for (int k = 0; k < 256; ++k) dst[k] = src[perm[k]];
            for (int s = 0; s < 256 / sub; ++s) {
                float sum = 0.0f;
                for (int k = 0; k < sub; ++k) sum += src[s * sub + k];
                xsum[i * (K / sub) + b * (256 / sub) + s] = sum;
            }
        }
}

/* Lane j's sub-block (index into the block's scales) for Q4_K group g, code parity par, and
 * for Q6_K half, group g, nibble n: the scales are put in lane order by one permute each. */
static inline fi32v q4k_sub_lanes(int g, int par) {
    fi32v v;
    for (int j = 0; j < VL; ++j) v[j] = q4k_weight(g, par, j) / 32;
    return v;
}

static inline fi32v q6k_sub_lanes(int half, int g, int n) {
    fi32v v;
    for (int j = 0; j < VL; ++j) v[j] = q6k_weight(half, g, n, j) / 16;
    return v;
}

/* A block's scales per sub-block in registers: lo holds sub-blocks 0-7, hi 8-15 (Q6_K). */
typedef struct {
    __m256 lo, hi;
#if VL == 16
    __m512 all; /* lo | hi */
#endif
} block_scales;

/* The scales in lane order `lanes` (sub-block per lane; under AVX2 a vector's lanes all lie in one
 * half, `hi`, which the unrolled loops know). */
static inline __attribute__((always_inline)) vf pick_scales(const block_scales *s, fi32v lanes, int hi) {
#if VL == 16
    (void)hi;
    return (vf)_mm512_permutexvar_ps((__m512i)lanes, s->all);
#else
    return (vf)_mm256_permutevar8x32_ps(hi ? s->hi : s->lo, (__m256i)(lanes & 7));
#endif
}

/* Code t (bits 4t .. 4t + 3) of every lane's word as a float. AVX-512: vpermps reads only an
 * index's low four bits, so a table of 0..15 turns the shifted word into the float in one step
 * (no mask, no conversion). */
static inline __attribute__((always_inline)) vf q4_codes(fu32v words, int t) {
#if VL == 16
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return (vf)_mm512_permutexvar_ps((__m512i)(words >> (4 * t)), iota);
#else
    return __builtin_convertvector((fi32v)(t < 7 ? (words >> (4 * t)) & 0xF : words >> 28), vf);
#endif
}

static inline float hsum8(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* Rows [r0, r1) of a Q4_K or Q6_K matrix against M reordered activation rows (M a constant where
 * the caller specializes it). */
static inline __attribute__((always_inline)) void factored_rows(
    const int type, const float *xr, const float *xsum, const uint8_t *w, float *y, const int64_t M,
    int64_t r0, int64_t r1, int64_t K, int64_t ldy) {
    const int64_t nb = K / 256, bytes = type == T_Q4_K ? 144 : 210, row_bytes = nb * bytes;
    const int nsub = type == T_Q4_K ? 8 : 16;
    fi32v lanes[8];
    fu32v qh_shift = (fu32v){0};
    if (type == T_Q4_K) {
        for (int g = 0; g < Q4K_GROUPS; ++g) lanes[2 * g] = q4k_sub_lanes(g, 0), lanes[2 * g + 1] = q4k_sub_lanes(g, 1);
    } else {
        for (int half = 0; half < 2; ++half)
            for (int g = 0; g < Q6K_GROUPS; ++g)
                for (int n = 0; n < 2; ++n) lanes[(half * Q6K_GROUPS + g) * 2 + n] = q6k_sub_lanes(half, g, n);
        for (int j = 0; j < VL; ++j) qh_shift[j] = 2 * (((4 * j) % 64) / 32); /* lanes past 32 ql bytes */
    }
    for (int64_t r = r0; r < r1; ++r) {
        vf acc[MSMALL][2];
        v8f accs[MSMALL];
        prefetch_row(w + (r + PREFETCH_ROWS) * row_bytes, r + PREFETCH_ROWS < r1 ? row_bytes : 0);
        for (int64_t i = 0; i < M; ++i) acc[i][0] = acc[i][1] = (vf){0}, accs[i] = (v8f){0};
        const uint8_t *row = w + r * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bytes;
            const float *xb = xr + b * 256;
            block_scales s;
            __m256 m8; /* Q4_K: -dmin * the minimums */
            if (type == T_Q4_K) {
                const __m128i bytes = k4_scale_bytes(blk);
                s.lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(f16(blk)));
                s.hi = s.lo;
                m8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                                   _mm256_set1_ps(-f16(blk + 2)));
            } else {
                const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
                const __m256 d = _mm256_set1_ps(f16(blk + 208));
                s.lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
                s.hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
                m8 = s.lo;
            }
#if VL == 16
            s.all = _mm512_insertf32x8(_mm512_castps256_ps512(s.lo), s.hi, 1);
#endif
            /* sub-block terms: Q4_K's -dmin * m_j * sum(x); Q6_K's s_j * sum(x) (times -32 at the end) */
            for (int64_t i = 0; i < M; ++i) {
                const float *xs = xsum + i * (K / (256 / nsub)) + b * nsub;
                v8f t = (v8f)m8 * (v8f)_mm256_loadu_ps(xs);
                if (type == T_Q6_K) t += (v8f)s.hi * (v8f)_mm256_loadu_ps(xs + 8);
                accs[i] += t;
            }
            if (type == T_Q4_K) {
#pragma GCC unroll 4
                for (int g = 0; g < Q4K_GROUPS; ++g) {
                    const fu32v words = load_words(blk + 16 + g * 4 * VL);
                    vf c[8];
#pragma GCC unroll 8
                    for (int t = 0; t < 8; ++t) c[t] = q4_codes(words, t);
                    const vf se = pick_scales(&s, lanes[2 * g], 0), so = pick_scales(&s, lanes[2 * g + 1], 0);
                    for (int64_t i = 0; i < M; ++i) {
                        const float *xg = xb + i * K + g * 8 * VL;
                        const vf e = (c[0] * loadv(xg) + c[2] * loadv(xg + 2 * VL)) + (c[4] * loadv(xg + 4 * VL) + c[6] * loadv(xg + 6 * VL));
                        const vf o = (c[1] * loadv(xg + VL) + c[3] * loadv(xg + 3 * VL)) + (c[5] * loadv(xg + 5 * VL) + c[7] * loadv(xg + 7 * VL));
                        acc[i][0] += se * e;
                        acc[i][1] += so * o;
                    }
                }
            } else {
#pragma GCC unroll 4
                for (int half = 0; half < 2; ++half) {
                    fu32v qh = load_words(blk + 128 + 32 * half); /* 32 bytes: VL 16 repeats them */
#if VL == 16
                    qh = __builtin_shuffle(qh, (fu32v){0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
#pragma GCC unroll 2
                    for (int g = 0; g < Q6K_GROUPS; ++g) {
                        const fu32v ql = load_words(blk + 64 * half + g * 4 * VL);
                        const fu32v qhl = qh >> (qh_shift + 2 * (g * 4 * VL / 32));
                        /* whole six-bit codes, one per byte: code 2e in byte e of `even`, 2e + 1 in `odd`
                         * (ql's nibble and qh's two bits meet once per word, not once per code) */
                        const fu32v even = (ql & 0x0F0F0F0Fu) | ((qhl << 4) & 0x30303030u);
                        const fu32v odd = ((ql >> 4) & 0x0F0F0F0Fu) | (qhl & 0x30303030u);
                        vf c[8];
#pragma GCC unroll 4
                        for (int e = 0; e < 4; ++e) {
                            c[2 * e] = __builtin_convertvector((fi32v)(e < 3 ? (even >> (8 * e)) & 0x3F : even >> 24), vf);
                            c[2 * e + 1] = __builtin_convertvector((fi32v)(e < 3 ? (odd >> (8 * e)) & 0x3F : odd >> 24), vf);
                        }
                        const int li = (half * Q6K_GROUPS + g) * 2;
                        const vf s0 = pick_scales(&s, lanes[li], half), s1 = pick_scales(&s, lanes[li + 1], half);
                        for (int64_t i = 0; i < M; ++i) {
                            const float *xg = xb + i * K + half * 128 + g * 8 * VL;
                            const vf lo = (c[0] * loadv(xg) + c[2] * loadv(xg + 2 * VL)) + (c[4] * loadv(xg + 4 * VL) + c[6] * loadv(xg + 6 * VL));
                            const vf hi = (c[1] * loadv(xg + VL) + c[3] * loadv(xg + 3 * VL)) + (c[5] * loadv(xg + 5 * VL) + c[7] * loadv(xg + 7 * VL));
                            acc[i][0] += s0 * lo;
                            acc[i][1] += s1 * hi;
                        }
                    }
                }
            }
        }
        for (int64_t i = 0; i < M; ++i)
            y[i * ldy + r] = hsum(acc[i][0] + acc[i][1]) + (type == T_Q6_K ? -32.0f : 1.0f) * hsum8(accs[i]);
    }
}

/* Q5_0 (d, 32 fifth bits, 16 bytes of nibbles; w = d * (code - 16)): rows [r0, r1) against M rows,
 * per block d * (sum(code * x) - 16 * sum(x)). Weights 0-15 are the bytes' low nibbles, 16-31
 * their high ones; weight j's fifth bit is bit j of the 32-bit word: under AVX-512 a mask
 * register ORs it in (one instruction), elsewhere a variable shift per lane. A Q4_K_M file keeps
 * Q5_0 wherever a row is not whole super-blocks of 256 (Gemma 3 270M's 640-wide q/k/v and
 * gate/up): the widening form ran these at 6-7 GFLOP/s. */
static inline __attribute__((always_inline)) void q5_0_rows(const float *xr, const float *xsum, const uint8_t *w,
                                                            float *y, const int64_t M, int64_t r0, int64_t r1,
                                                            int64_t K, int64_t ldy) {
    const int64_t nb = K / 32, row_bytes = nb * 22;
    fu32v iota;
    for (int j = 0; j < VL; ++j) iota[j] = (uint32_t)j;
    for (int64_t r = r0; r < r1; ++r) {
        vf acc[MSMALL];
        float off[MSMALL];
        prefetch_row(w + (r + PREFETCH_ROWS) * row_bytes, r + PREFETCH_ROWS < r1 ? row_bytes : 0);
        for (int64_t i = 0; i < M; ++i) acc[i] = (vf){0}, off[i] = 0.0f;
        const uint8_t *row = w + r * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * 22;
            const float d = f16(blk);
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            vf c[32 / VL];
#pragma GCC unroll 4
            for (int v = 0; v < 32 / VL; ++v) { /* lanes: weights v * VL .. v * VL + VL - 1 */
                const int first = v * VL, hi = first / 16;
                fu32v code = ((fu32v)u8_to_i32(blk + 6 + first % 16) >> (4 * hi)) & 0xF;
#if VL == 16
                code = (fu32v)_mm512_mask_or_epi32((__m512i)code, (__mmask16)(qh >> first), (__m512i)code,
                                                   _mm512_set1_epi32(16));
#else
                code |= ((((fu32v){0} + qh) >> (iota + (uint32_t)first)) & 1) << 4;
#endif
                c[v] = __builtin_convertvector((fi32v)code, vf);
            }
            for (int64_t i = 0; i < M; ++i) {
                const float *xb = xr + i * K + b * 32;
                vf s = c[0] * loadv(xb);
#pragma GCC unroll 4
                for (int v = 1; v < 32 / VL; ++v) s += c[v] * loadv(xb + v * VL);
                acc[i] += s * d;
                off[i] += d * xsum[i * nb + b];
            }
        }
        for (int64_t i = 0; i < M; ++i) y[i * ldy + r] = hsum(acc[i]) - 16.0f * off[i];
    }
}

/* Q8_0 (d, 32 int8 codes; w = d * code): per block d * sum(code * x), the scale once per 32
 * weights instead of once per 16-weight vector (Gemma 3 270M's 262,144-row tied head is Q8_0 in
 * a Q4_K_M file: most of its decode step). */
static inline __attribute__((always_inline)) void q8_0_rows(const float *xr, const uint8_t *w, float *y,
                                                            const int64_t M, int64_t r0, int64_t r1, int64_t K,
                                                            int64_t ldy) {
    const int64_t nb = K / 32, row_bytes = nb * 34;
    for (int64_t r = r0; r < r1; ++r) {
        vf acc[MSMALL][2];
        prefetch_row(w + (r + PREFETCH_ROWS) * row_bytes, r + PREFETCH_ROWS < r1 ? row_bytes : 0);
        for (int64_t i = 0; i < M; ++i) acc[i][0] = acc[i][1] = (vf){0};
        const uint8_t *row = w + r * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * 34;
            const float d = f16(blk);
            vf c[32 / VL];
#pragma GCC unroll 4
            for (int v = 0; v < 32 / VL; ++v) c[v] = __builtin_convertvector(i8_to_i32((const int8_t *)blk + 2 + v * VL), vf);
            for (int64_t i = 0; i < M; ++i) {
                const float *xb = xr + i * K + b * 32;
                vf s = c[0] * loadv(xb);
#pragma GCC unroll 4
                for (int v = 1; v < 32 / VL; ++v) s += c[v] * loadv(xb + v * VL);
                acc[i][b & 1] += s * d; /* two chains: the FMA's latency does not bind at one row */
            }
        }
        for (int64_t i = 0; i < M; ++i) y[i * ldy + r] = hsum(acc[i][0] + acc[i][1]);
    }
}

/* One type's rows (`type` and M constants where the caller specializes them). */
static inline __attribute__((always_inline)) void factored_type_rows(
    const int type, const float *xr, const float *xsum, const uint8_t *w, float *y, const int64_t M, int64_t r0,
    int64_t r1, int64_t K, int64_t ldy) {
    if (type == T_Q4_K) factored_rows(T_Q4_K, xr, xsum, w, y, M, r0, r1, K, ldy);
    else if (type == T_Q6_K) factored_rows(T_Q6_K, xr, xsum, w, y, M, r0, r1, K, ldy);
    else if (type == T_Q5_0) q5_0_rows(xr, xsum, w, y, M, r0, r1, K, ldy);
    else q8_0_rows(xr, w, y, M, r0, r1, K, ldy);
}

/* Specialized for 1-4 rows (accumulators in registers), the rest with M at run time. */
static void factored_rows_any(int type, const float *xr, const float *xsum, const uint8_t *w, float *y, int64_t M,
                              int64_t r0, int64_t r1, int64_t K, int64_t ldy) {
    switch (M) {
        case 1: factored_type_rows(type, xr, xsum, w, y, 1, r0, r1, K, ldy); break;
        case 2: factored_type_rows(type, xr, xsum, w, y, 2, r0, r1, K, ldy); break;
        case 3: factored_type_rows(type, xr, xsum, w, y, 3, r0, r1, K, ldy); break;
        case 4: factored_type_rows(type, xr, xsum, w, y, 4, r0, r1, K, ldy); break;
        default: factored_type_rows(type, xr, xsum, w, y, M, r0, r1, K, ldy); break;
    }
}
#else
#define FACTORED 0
#endif

#if FACTORED
/* Q4_K / Q6_K / Q5_0 / Q8_0 below PANEL_FROM rows: threads split the weight rows in tasks of 8,
 * and every chunk of up to MSMALL activation rows passes over a task's rows while they are in
 * cache. The K-quants read the activations in their lanes' order (a copy); Q5_0 and Q8_0 read
 * them as they are, Q5_0 with their sums per block. */
static int exact_factored(int type, const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K,
                          int64_t ldy, int num_threads) {
    const int lane_order = type == T_Q4_K || type == T_Q6_K;
    const int64_t sums = K / (type == T_Q6_K ? 16 : 32), copied = lane_order ? M * K : 0;
    float *buf = malloc((size_t)(copied + M * sums) * sizeof(float));
    if (buf == NULL) return 2;
    float *xsum = buf + copied;
    const float *xr = lane_order ? buf : x;
    if (lane_order) {
        reorder_activations(type, x, buf, xsum, M, K);
    } else if (type == T_Q5_0) {
        for (int64_t i = 0; i < M * sums; ++i) {
            float sum = 0.0f;
            for (int k = 0; k < 32; ++k) sum += x[i * 32 + k];
            xsum[i] = sum;
        }
    }
    enum { ROWS_PER_TASK = 8 };
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 65536)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < N ? r0 + ROWS_PER_TASK : N;
        for (int64_t m0 = 0; m0 < M; m0 += MSMALL) {
            const int64_t mc = M - m0 < MSMALL ? M - m0 : MSMALL;
            factored_rows_any(type, xr + m0 * K, xsum + m0 * sums, w, y + m0 * ldy, mc, r0, r1, K, ldy);
        }
    }
    free(buf);
    return 0;
}
#endif

static void exact_small(const traits_t *t, int type, const float *x, const uint8_t *w, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t ldy, int num_threads) {
    enum { ROWS_PER_TASK = 8 };
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 65536)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < N ? r0 + ROWS_PER_TASK : N;
        exact_rows_any(t, type, x, w, y, M, r0, r1, K, ldy);
    }
}

/* From PANEL_FROM rows: per chunk of rows, per panel of NR weight rows, widen the panel into
 * packed_gemm.c's layout ([K][NR]) and run its register-tiled kernel over the chunk. */
static int exact_panels(const traits_t *t, int type, const float *x, const uint8_t *w, float *y,
                        float *xp_buf, int64_t M, int64_t N, int64_t K, int64_t ldy, int num_threads) {
    const int64_t row_bytes = K / t->block * t->bytes, panels = (N + NR - 1) / NR;
    int failed = 0;
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        pack_rows(x, xp_buf, m0, mc, K, num_threads);
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            float *panel = malloc((size_t)(K * NR + K) * sizeof(float));
            if (panel == NULL) {
                failed = 1;
            } else {
                float *row = panel + K * NR;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; ++p) {
                    const int64_t ncols = N - p * NR < NR ? N - p * NR : NR;
                    for (int64_t j = 0; j < NR; ++j) {
                        if (j < ncols) widen_row(t, type, w + (p * NR + j) * row_bytes, row, K);
                        for (int64_t k = 0; k < K; ++k) panel[k * NR + j] = j < ncols ? row[k] : 0.0f;
                    }
                    /* chunk_times_panel writes with row stride N: run it per row block here */
                    for (int64_t r0 = 0; r0 < mc; r0 += MR) {
                        const int64_t mr = mc - r0 < MR ? mc - r0 : MR;
                        run_block(xp_buf + r0 * K, panel, y + (m0 + r0) * ldy + p * NR, K, ldy, ncols, (int)mr);
                    }
                }
                free(panel);
            }
        }
        if (failed) return 2;
    }
    return 0;
}

/* Exact path. xp_buf: min(M, M_CHUNK) * K floats of scratch when M >= PANEL_ROWS (else unused).
 * Returns 1 for unsupported arguments, 2 if a buffer could not be allocated. */
int gguf_gemm_exact(int type, const float *x, const uint8_t *w, float *y, float *xp_buf, int64_t M,
                    int64_t N, int64_t K, int64_t ldy, int num_threads) {
    const traits_t *t = traits_of(type, K);
    if (t == NULL || M < 1 || N < 1 || ldy < N) return 1;
#if FACTORED
    if ((type == T_Q4_K || type == T_Q6_K || type == T_Q5_0 || type == T_Q8_0) && M < PANEL_FROM)
        return exact_factored(type, x, w, y, M, N, K, ldy, num_threads);
#endif
    if (M < PANEL_FROM) { /* chunks of up to 16 rows: each chunk widens the weights again, which
                           * still costs less than widening them into panels (measured: 20 rows
                           * through panels ran 4x slower than two chunks) */
        for (int64_t m0 = 0; m0 < M; m0 += MSMALL) {
            const int64_t mc = M - m0 < MSMALL ? M - m0 : MSMALL;
            exact_small(t, type, x + m0 * K, w, y + m0 * ldy, mc, N, K, ldy, num_threads);
        }
        return 0;
    }
    return exact_panels(t, type, x, w, y, xp_buf, M, N, K, ldy, num_threads);
}

/* ---- int8 path ---------------------------------------------------------------------------- */

/* Bytes of scratch the int8 path needs for M rows of K (quantized rows, scales, sums). */
int64_t gguf_int8_scratch(int64_t M, int64_t K) {
    return M * K + M * (K / XB) * 4 + M * (K / SUB) * 4 + M * K + 128;
}

static void quantize_rows(const float *x, int8_t *xq, float *xs, float *xsum, int64_t M, int64_t K,
                          int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t i = 0; i < M; ++i)
        for (int64_t b = 0; b < K / XB; ++b) {
            const float *src = x + i * K + b * XB;
            float amax = 0.0f;
            for (int k = 0; k < XB; ++k) amax = fmaxf(amax, fabsf(src[k]));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            xs[i * (K / XB) + b] = scale;
            for (int k = 0; k < XB; ++k) xq[i * K + b * XB + k] = (int8_t)lrintf(src[k] * inv);
            for (int h = 0; h < XB / SUB; ++h) {
                float sum = 0.0f;
                for (int k = 0; k < SUB; ++k) sum += src[h * SUB + k];
                xsum[i * (K / SUB) + b * (XB / SUB) + h] = sum;
            }
        }
}

/* sum of q[i] * x[i] over one sub-block of 16: int16 products, int32 sums (gcc vectorizes). */
static inline int32_t dot16(const int8_t *q, const int8_t *x) {
    int32_t acc = 0;
#pragma GCC unroll 16
    for (int i = 0; i < SUB; ++i) acc += (int16_t)q[i] * (int16_t)x[i];
    return acc;
}

/* ---- int8 path for Q4_K / Q6_K, AVX-512 BW: llama.cpp's K-quant arithmetic -----------------------
 * Activations are quantized per 256 (Q8_K's grain: one scale per super-block), so that a whole
 * super-block's dot product is an integer: vpmaddubsw multiplies 64 unsigned codes by 64 int8
 * activations into int16 pair sums (no saturation: 2 x 63 x 127 < 32767), vpmaddwd multiplies
 * those by the sub-blocks' integer scales (Q4_K's six-bit ones, Q6_K's int8 ones) and adds pairs
 * into int32, so 64 weights cost three instructions and one float multiply-add remains per
 * super-block: y += d * xs * sum. Q4_K's minimums use the float sums of the activations per 32;
 * Q6_K's code offset of 32 is -32 x sum_j sc_j x (integer activation sum of sub-block j). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FAST_INT8 1
#define FAST_ROWS 8
#define QK_X 256 /* activation block of this path */

/* Per row: int8 codes, a scale per 256, float sums per 32 (Q4_K), int16 code sums per 16 (Q6_K). */
static void quantize_rows_k(const float *x, int8_t *xq, float *xs, float *xsum32, int16_t *bs16, int64_t M,
                            int64_t K, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t i = 0; i < M; ++i)
        for (int64_t b = 0; b < K / QK_X; ++b) {
            const float *src = x + i * K + b * QK_X;
            int8_t *q = xq + i * K + b * QK_X;
            float amax = 0.0f;
            for (int k = 0; k < QK_X; ++k) amax = fmaxf(amax, fabsf(src[k]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            xs[i * (K / QK_X) + b] = amax / 127.0f;
            for (int k = 0; k < QK_X; ++k) q[k] = (int8_t)lrintf(src[k] * inv);
            for (int j = 0; j < QK_X / XB; ++j) {
                float sum = 0.0f;
                for (int k = 0; k < XB; ++k) sum += src[j * XB + k];
                xsum32[i * (K / XB) + b * (QK_X / XB) + j] = sum;
            }
            for (int j = 0; j < QK_X / SUB; ++j) {
                int sum = 0;
                for (int k = 0; k < SUB; ++k) sum += q[j * SUB + k];
                bs16[i * (K / SUB) + b * (QK_X / SUB) + j] = (int16_t)sum;
            }
        }
}

/* Q4_K's 64-byte nibble vectors hold weights 0-31 and 64-95 of each 128 in their low nibbles and
 * 32-63 and 96-127 in their high ones: the quantized activations (`count` bytes, whole blocks
 * of 256) are put in that order once, so that one load and one mask give 64 codes. */
static void q4k_order_activations(int8_t *xq, int64_t count) {
    for (int64_t o = 0; o < count; o += 128) {
        int8_t t[128];
        memcpy(t, xq + o, 128);
        memcpy(xq + o, t, 32);
        memcpy(xq + o + 32, t + 64, 32);
        memcpy(xq + o + 64, t + 32, 32);
        memcpy(xq + o + 96, t + 96, 32);
    }
}

/* Q4_K's eight six-bit scales (as int16, in the low 128 bits) and its minimums times -dmin (floats). */
static inline __m512i k4_int_scales(const uint8_t *b, __m256 *mv) {
    const __m128i bytes = k4_scale_bytes(b);
    *mv = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
    return _mm512_castsi128_si512(_mm_cvtepu8_epi16(bytes));
}

/* An int16 vector whose 32 lanes are scales[first] x 16 | scales[second] x 16 (Q4_K) or four
 * scales x 8 each (Q6_K), picked from `scales` (int16 lanes) by vpermw. */
static inline __m512i spread16(__m512i scales, int a, int b, int c, int d) {
    const __m512i idx = _mm512_set_epi16(d, d, d, d, d, d, d, d, c, c, c, c, c, c, c, c,
                                         b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
    return _mm512_permutexvar_epi16(idx, scales);
}

static inline __m512i dot64(__m512i isum, __m512i codes, const int8_t *x, __m512i scales16) {
    const __m512i p16 = _mm512_maddubs_epi16(codes, _mm512_loadu_si512((const void *)x));
    return _mm512_add_epi32(isum, _mm512_madd_epi16(p16, scales16));
}

/* One weight row of Q4_K / Q6_K against mb <= FAST_ROWS quantized activation rows. */
static inline __attribute__((always_inline)) void int8_row_fast_t(
    const int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xs, const float *xsum32,
    const int16_t *bs16, const int64_t mb, int64_t K, float *out) {
    __m512 acc[FAST_ROWS];
    __m256 acc8[FAST_ROWS];
    for (int64_t i = 0; i < mb; ++i) acc[i] = _mm512_setzero_ps(), acc8[i] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * QK_X;
        __m512i codes[4], sc[4];
        float d;
        __m256 mv = _mm256_setzero_ps();
        __m256i sc6 = _mm256_setzero_si256();
        if (type == T_Q4_K) {
            const uint8_t *blk = row + b * 144;
            d = f16(blk);
            const __m512i s8 = k4_int_scales(blk, &mv);
            for (int c = 0; c < 4; ++c) { /* lanes 0-15: sub-block a, 16-31: sub-block a + 2 */
                const int a = 4 * (c / 2) + (c & 1);
                sc[c] = spread16(s8, a, a, a + 2, a + 2);
            }
            for (int c = 0; c < 2; ++c) {
                const __m512i q = _mm512_loadu_si512((const void *)(blk + 16 + 64 * c));
                codes[2 * c] = _mm512_and_si512(q, low4);
                codes[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            }
        } else {
            const uint8_t *blk = row + b * 210;
            d = f16(blk + 208);
            sc6 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m512i s16 = _mm512_castsi256_si512(sc6);
            for (int c = 0; c < 4; ++c) sc[c] = spread16(s16, 4 * c, 4 * c + 1, 4 * c + 2, 4 * c + 3);
            for (int h = 0; h < 2; ++h) { /* 64 bytes of ql: weights 0-63 low nibbles, 64-127 high */
                const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m512i qhx = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                               _mm512_slli_epi16(_mm512_and_si512(qhx, low2), 4));
                codes[2 * h + 1] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhx, 4), low2), 4));
            }
        }
        for (int64_t i = 0; i < mb; ++i) {
            const int8_t *xr = xq + i * K + k0;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) isum = dot64(isum, codes[c], xr + 64 * c, sc[c]);
            const float dx = d * xs[i * (K / QK_X) + b];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx), acc[i]);
            if (type == T_Q4_K) { /* minimums: -dmin * m_j * (float sum of the activations of j) */
                acc8[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum32 + i * (K / XB) + k0 / XB), acc8[i]);
            } else { /* -32 * sum_j sc_j * (code sum of sub-block j) */
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(bs16 + i * (K / SUB) + k0 / SUB));
                acc8[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc6, bs)),
                                          _mm256_set1_ps(-32.0f * dx), acc8[i]);
            }
        }
    }
    for (int64_t i = 0; i < mb; ++i)
        out[i] = _mm512_reduce_add_ps(acc[i]) + _mm512_reduce_add_ps(_mm512_castps256_ps512(acc8[i]));
}

/* Specialized for one row (decode: accumulators in registers) and for Q4_K / Q6_K. */
static void int8_row_fast(int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xs,
                          const float *xsum32, const int16_t *bs16, int64_t mb, int64_t K, float *out) {
    if (type == T_Q4_K && mb == 1) int8_row_fast_t(T_Q4_K, row, nb, xq, xs, xsum32, bs16, 1, K, out);
    else if (type == T_Q4_K) int8_row_fast_t(T_Q4_K, row, nb, xq, xs, xsum32, bs16, mb, K, out);
    else if (mb == 1) int8_row_fast_t(T_Q6_K, row, nb, xq, xs, xsum32, bs16, 1, K, out);
    else int8_row_fast_t(T_Q6_K, row, nb, xq, xs, xsum32, bs16, mb, K, out);
}
#else
#define FAST_INT8 0
#endif

/* Whether this build's int8 path has a vector kernel for `type` (else the generic one, slower
 * than the exact path: the layers route such parts to the exact path, quantization/gguf_kernel.py). */
int gguf_int8_vectorized(int type) { return FAST_INT8 && (type == T_Q4_K || type == T_Q6_K); }

int gguf_gemm_int8(int type, const float *x, const uint8_t *w, float *y, uint8_t *scratch, int64_t M,
                   int64_t N, int64_t K, int64_t ldy, int num_threads) {
    const traits_t *t = traits_of(type, K);
    if (t == NULL || t->decode == NULL || K % XB || M < 1 || N < 1 || ldy < N) return 1;
    int8_t *xq = (int8_t *)scratch;
    float *xs = (float *)(((uintptr_t)(scratch + M * K) + 63) & ~(uintptr_t)63);
    float *xsum = xs + M * (K / XB);
    int32_t *xl = (int32_t *)(xsum + M * (K / SUB)); /* the vector path's int16 code sums per 16 */
    const int64_t row_bytes = K / t->block * t->bytes, nb = K / t->block;
#if FAST_INT8
    if (type == T_Q4_K || type == T_Q6_K) {
        int16_t *bs16 = (int16_t *)xl;
        quantize_rows_k(x, xq, xs, xsum, bs16, M, K, num_threads);
        if (type == T_Q4_K) q4k_order_activations(xq, M * K);
        /* rows of W in tasks of ROW_TASK, activations in chunks of FAST_ROWS: a task's weights
         * stay in L1/L2 while every chunk passes over them */
        enum { ROW_TASK = 16 };
        const int64_t tasks = (N + ROW_TASK - 1) / ROW_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 65536)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t r0 = task * ROW_TASK, r1 = r0 + ROW_TASK < N ? r0 + ROW_TASK : N;
            for (int64_t i0 = 0; i0 < M; i0 += FAST_ROWS) {
                const int64_t mb = M - i0 < FAST_ROWS ? M - i0 : FAST_ROWS;
                for (int64_t r = r0; r < r1; ++r) {
                    float out[FAST_ROWS];
                    if (i0 == 0) prefetch_row(w + (r + PREFETCH_ROWS) * row_bytes, r + PREFETCH_ROWS < N ? row_bytes : 0);
                    int8_row_fast(type, w + r * row_bytes, nb, xq + i0 * K, xs + i0 * (K / QK_X), xsum + i0 * (K / XB),
                                  bs16 + i0 * (K / SUB), mb, K, out);
                    for (int64_t i = 0; i < mb; ++i) y[(i0 + i) * ldy + r] = out[i];
                }
            }
        }
        return 0;
    }
#endif
    quantize_rows(x, xq, xs, xsum, M, K, num_threads);
    const int n = t->block, subs = n / SUB;
    enum { MB = 8 }; /* activation rows per pass over a weight row's decoded blocks */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * N * K >= 65536)
    for (int64_t r = 0; r < N; ++r) {
        const uint8_t *row = w + r * row_bytes;
        for (int64_t i0 = 0; i0 < M; i0 += MB) {
            const int64_t mb = M - i0 < MB ? M - i0 : MB;
            float acc[MB] = {0};
            for (int64_t b = 0; b < nb; ++b) {
                int8_t q[QMAX];
                float s[QMAX / SUB], m[QMAX / SUB];
                t->decode(row + b * t->bytes, q, s, m);
                const int64_t k0 = b * n;
                for (int64_t i = 0; i < mb; ++i) {
                    const int8_t *xr = xq + (i0 + i) * K + k0;
                    const float *xsr = xs + (i0 + i) * (K / XB) + k0 / XB;
                    const float *xsumr = xsum + (i0 + i) * (K / SUB) + k0 / SUB;
                    float a = 0.0f;
                    for (int j = 0; j < subs; ++j)
                        a += s[j] * xsr[j * SUB / XB] * (float)dot16(q + j * SUB, xr + j * SUB) + m[j] * xsumr[j];
                    acc[i] += a;
                }
            }
            for (int64_t i = 0; i < mb; ++i) y[(i0 + i) * ldy + r] = acc[i];
        }
    }
    return 0;
}
