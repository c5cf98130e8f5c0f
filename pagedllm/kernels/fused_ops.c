/* The small per-layer operations of a Llama layer, fused, float32, on CPU:
 *   add_rms_norm_f32: residual += x (optional), out = weight * (residual * rsqrt(mean(residual^2) + eps))
 *   silu_mul_f32:     out = silu(gate) * up, from the fused [gate | up] projection
 *   gelu_tanh_mul_f32: out = gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`)
 *   rotary_f32:       rotate the q and k heads of the fused qkv projection in place
 *
 * Why: in eager torch each of these is 3-8 separate operators (pow, mean, add, rsqrt, mul, cat,
 * neg, slice...), each a dispatch of a few microseconds plus a pass over memory; at decode batch
 * sizes that is ~20 operators a layer and about a tenth to a fifth of a step
 * (benchmarks/NOTES.md). Each kernel here is one call and one pass. The order of the arithmetic
 * follows transformers' Llama (RMSNorm: scale the input by the reciprocal root, then multiply by
 * the weight; rotary: x * cos + rotate_half(x) * sin), so results differ from torch only in
 * the last bits (summation order, fused multiply-adds). Rows are split across threads only when
 * there is enough work to pay for it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAR_MIN_ELEMS 65536

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t M,
                      int64_t H, float eps, int add, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * H >= PAR_MIN_ELEMS)
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * H;
        float *rr = residual + m * H;
        float *o = out + m * H;
        const float *h = xr;
        if (add) {
            for (int64_t j = 0; j < H; ++j) rr[j] += xr[j];
            h = rr;
        }
        float ss = 0.0f;
        for (int64_t j = 0; j < H; ++j) ss += h[j] * h[j];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t j = 0; j < H; ++j) o[j] = weight[j] * (h[j] * r);
    }
}

void silu_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I >= PAR_MIN_ELEMS)
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* torch's `gelu(x, approximate="tanh")`: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))),
 * times up. */
void gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int num_threads) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I >= PAR_MIN_ELEMS)
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        for (int64_t j = 0; j < I; ++j) {
            const float x = g[j];
            o[j] = 0.5f * x * (1.0f + tanhf(beta * (x + kappa * x * x * x))) * u[j];
        }
    }
}

/* qkv rows of `row_stride` floats; the first `heads` heads of `D` floats each (q's, then k's)
 * are rotated by cos/sin [T, D] (the two halves of each row of cos/sin are equal). */
void rotary_f32(float *qkv, const float *cos_t, const float *sin_t, int64_t T, int64_t row_stride,
                int64_t heads, int64_t D, int num_threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * heads * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = qkv + t * row_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out[m] = the index of the largest value of row m of x [M, V] (row stride ld), the first of
 * equal maxima; a row with a NaN gets its first NaN, as torch's max(dim) gives (its NaN is the
 * maximum). Why: greedy sampling reads every logits row once; torch's CPU max(dim).indices ran
 * 256 x 49,152 float32 rows at about 5 GB/s (9-10 ms a step on a 2-core Xeon). With AVX-512 (and
 * AVX2, 8 lanes) one pass keeps per lane the largest value and its first index (a strict compare,
 * so the earliest of equal values stays) and the lanes are reduced at the end; elsewhere two passes, the second
 * over a row still in L2: the maximum (a vectorized max reduction, with an integer test for NaN
 * that -ffast-math cannot fold away), then the first index holding it. */
static inline int is_nan_bits(const float *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

static int64_t first_nan(const float *r, int64_t V) {
    for (int64_t j = 0; j < V; ++j)
        if (is_nan_bits(r + j)) return j;
    return -1;
}

/* Short rows, and rows too long for 32-bit lane indices. */
static inline int64_t argmax_scalar(const float *r, int64_t V) {
    float best = r[0];
    int64_t at = 0;
    for (int64_t j = 1; j < V; ++j)
        if (r[j] > best) best = r[j], at = j;
    const int64_t nan = first_nan(r, V);
    return nan >= 0 ? nan : at;
}

/* The vector pass's lanes (value, first index) reduced to the row's first maximum, then the
 * tail past `body` (no NaN in the body: the caller checked). */
static inline int64_t reduce_lanes(const float *vals, const int32_t *idx, int lanes, const float *r, int64_t body,
                                   int64_t V) {
    float top = vals[0];
    int64_t pos = idx[0];
    for (int l = 1; l < lanes; ++l)
        if (vals[l] > top || (vals[l] == top && idx[l] < pos)) top = vals[l], pos = idx[l];
    for (int64_t k = body; k < V; ++k) {
        if (is_nan_bits(r + k)) return k;
        if (r[k] > top) top = r[k], pos = k;
    }
    return pos;
}

#if defined(__AVX512F__)
#include <immintrin.h>
static int64_t argmax_row(const float *r, int64_t V) {
    const int64_t body = V / 16 * 16;
    if (body == 0 || V >= (int64_t)1 << 31) return argmax_scalar(r, V);
    __m512 best = _mm512_loadu_ps(r);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i j = at;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    for (int64_t k = 16; k < body; k += 16) {
        const __m512 v = _mm512_loadu_ps(r + k);
        j = _mm512_add_epi32(j, step);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, j);
    }
    if (nan) return first_nan(r, V);
    float vals[16];
    int32_t idx[16];
    _mm512_storeu_ps(vals, best);
    _mm512_storeu_si512(idx, at);
    return reduce_lanes(vals, idx, 16, r, body, V);
}
#elif defined(__AVX2__)
#include <immintrin.h>
/* The AVX-512 pass with 8 lanes: a blend keeps each lane's largest value and first index. */
static int64_t argmax_row(const float *r, int64_t V) {
    const int64_t body = V / 8 * 8;
    if (body == 0 || V >= (int64_t)1 << 31) return argmax_scalar(r, V);
    __m256 best = _mm256_loadu_ps(r);
    __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i j = at;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    for (int64_t k = 8; k < body; k += 8) {
        const __m256 v = _mm256_loadu_ps(r + k);
        j = _mm256_add_epi32(j, step);
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, gt);
        at = _mm256_blendv_epi8(at, j, _mm256_castps_si256(gt));
    }
    if (_mm256_movemask_ps(nan)) return first_nan(r, V);
    float vals[8];
    int32_t idx[8];
    _mm256_storeu_ps(vals, best);
    _mm256_storeu_si256((__m256i *)idx, at);
    return reduce_lanes(vals, idx, 8, r, body, V);
}
#else
static int64_t argmax_row(const float *r, int64_t V) {
    float best = r[0];
    uint32_t nan_seen = 0;
    for (int64_t j = 0; j < V; ++j) {
        nan_seen |= (uint32_t)is_nan_bits(r + j);
        best = r[j] > best ? r[j] : best;
    }
    if (nan_seen) return first_nan(r, V);
    for (int64_t j = 0; j < V; ++j)
        if (r[j] == best) return j;
    return 0; /* unreachable: best is one of the row's values */
}
#endif

void argmax_rows_f32(const float *x, int64_t M, int64_t V, int64_t ld, int64_t *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * V >= 4 * PAR_MIN_ELEMS)
    for (int64_t m = 0; m < M; ++m) out[m] = argmax_row(x + m * ld, V);
}
