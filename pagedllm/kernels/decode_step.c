/* One decode step of a dense decoder in one call: every layer's norms, projections, rotary, KV
 * write, attention, gated MLP and residuals, then the final norm. One layer description serves
 * the families (worker/cpu_decode_step.py fills it): Llama / Mistral / Qwen2 / Phi-3 (pre-norms,
 * SiLU), Qwen3 (+ per-head q/k norms), Gemma 2 / 3 (+ post-norms after attention and MLP,
 * GELU-tanh, soft caps, a rotary table per layer type, sliding layers in their own KV cache
 * groups with their own block tables).
 *
 * Why: the eager step makes about 12 Python-level calls a layer (each a ctypes call with its
 * argument checks, views and fresh tensors): on SmolLM2-135M's 30 layers that was 6-8 ms of a
 * 17-22 ms one-row step, more than streaming the weights takes. This is the CPU analogue of a
 * captured CUDA graph: Python describes the model once (worker/cpu_decode_step.py), and each
 * decode step is one call that runs the same kernels the eager path runs, in the same order, on
 * the same buffers. The numbers are the eager path's to the bit: the same functions, called with
 * the same arguments.
 *
 * The products and the attention are called through pointers to the functions of their own
 * libraries (int_gemm.c, gguf_gemm.c, packed_gemm.c, paged_decode_attention.c), built for the same
 * instruction-set variant; the small fused operations are this file's copies of fused_ops.c.
 * Each call forks and joins its own OpenMP team on torch's pool, as in the eager path.
 *
 * A layer's projection is a list of parts writing column ranges of one output (a GGUF file's
 * fused q/k/v may mix types); the other kinds are whole layers. Returns 0, or
 * 1000 * (layer + 1) + the stage (1 qkv, 2 attention, 3 o, 4 gate/up, 5 down) * 100 + the
 * kernel's own code: the caller re-runs the step eagerly, which names the problem (every write
 * this call made is one the eager step makes too, with the same values). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fused_ops.c"

enum { OP_INT_EXACT = 1, OP_INT_INT8 = 2, OP_GGUF_EXACT = 3, OP_GGUF_INT8 = 4, OP_PACKED_F32 = 5 };
#define MAX_PARTS 4

typedef struct {
    int32_t op, bits, kind, type; /* int_gemm's bits and offset kind; gguf_gemm's type id */
    int64_t rows, group_size;     /* this part's output columns; int_gemm's group size */
    const void *weight;
} part_t;

typedef struct {
    int32_t n_parts, pad;
    int64_t out_features, in_features;
    const float *bias; /* NULL: none */
    part_t parts[MAX_PARTS];
} linear_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    /* Llama placement: input_norm before attention, post_norm (adding the residual) before the
     * MLP. Gemma's: post_norm normalizes the attention output, pre_ff_norm (adding the residual)
     * precedes the MLP and post_ff_norm normalizes its output (NULL: Llama's placement). */
    const float *input_norm, *post_norm, *pre_ff_norm, *post_ff_norm;
    const float *q_norm, *k_norm; /* per-head norms over head_dim before rotary (NULL: none) */
    linear_t qkv, o, gate_up, down;
    void *key_cache, *value_cache;
    float scale, softcap;
    int32_t window, rope_table; /* rope_table: which of the step's cos/sin tables */
    int32_t kv_group, act;      /* kv_group: whose slots / block tables / lengths; act: ACT_* */
} layer_t;

typedef struct {
    int (*int_exact)(int, int, const float *, const uint8_t *, float *, float *, int64_t, int64_t, int64_t,
                     int64_t, int);
    int (*int_int8)(int, int, const float *, const uint8_t *, float *, uint8_t *, int64_t, int64_t, int64_t,
                    int64_t, int);
    int (*gguf_exact)(int, const float *, const uint8_t *, float *, float *, int64_t, int64_t, int64_t, int64_t,
                      int);
    int (*gguf_int8)(int, const float *, const uint8_t *, float *, uint8_t *, int64_t, int64_t, int64_t, int64_t,
                     int);
    int (*packed_f32)(const float *, const float *, float *, float *, int64_t, int64_t, int64_t, int);
    int (*attention)(int, const float *, int64_t, const float *, const float *, int64_t, const int64_t *, void *,
                     void *, const int64_t *, const int64_t *, float *, int, int, int, int, int, int, int64_t,
                     float, int, int, float);
} ops_t;

typedef struct {
    int32_t num_layers, num_heads, num_kv_heads, head_dim;
    int32_t kv_kind, block_size, table_width, num_groups; /* KV cache groups (tables per group) */
    int64_t hidden, intermediate, num_blocks;
    float eps, pad2;
    const float *final_norm;
    double *seconds; /* NULL, or [3] += seconds in products, attention, the small fused ops */
} model_t;

/* Floats of the work buffer for M rows: residual, normed, x (M x hidden each), qkv, attention
 * output, gate/up, activation. */
int64_t decode_step_work_floats(const model_t *m, int64_t M) {
    const int64_t q = (int64_t)m->num_heads * m->head_dim, kv = (int64_t)m->num_kv_heads * m->head_dim;
    return M * (3 * m->hidden + (q + 2 * kv) + q + 3 * m->intermediate);
}

static int run_linear(const ops_t *ops, const linear_t *L, const float *x, float *y, void *scratch, int64_t M,
                      int threads) {
    const int64_t K = L->in_features, N = L->out_features;
    int64_t col = 0;
    for (int p = 0; p < L->n_parts; ++p) {
        const part_t *P = &L->parts[p];
        int rc;
        switch (P->op) {
        case OP_INT_EXACT:
            rc = ops->int_exact(P->bits, P->kind, x, P->weight, y, scratch, M, N, K, P->group_size, threads);
            break;
        case OP_INT_INT8:
            rc = ops->int_int8(P->bits, P->kind, x, P->weight, y, scratch, M, N, K, P->group_size, threads);
            break;
        case OP_GGUF_EXACT:
            rc = ops->gguf_exact(P->type, x, P->weight, y + col, scratch, M, P->rows, K, N, threads);
            break;
        case OP_GGUF_INT8:
            rc = ops->gguf_int8(P->type, x, P->weight, y + col, scratch, M, P->rows, K, N, threads);
            break;
        case OP_PACKED_F32:
            rc = ops->packed_f32(x, P->weight, y, scratch, M, N, K, threads);
            break;
        default:
            rc = 99;
        }
        if (rc) return rc;
        col += P->rows;
    }
    if (L->bias != NULL)
        for (int64_t r = 0; r < M; ++r) {
            float *row = y + r * N;
            for (int64_t j = 0; j < N; ++j) row[j] += L->bias[j];
        }
    return 0;
}

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* With `m->seconds` set, the time since `*t0` is added to category `c` and `*t0` moves on. */
static inline void lap(const model_t *m, double *t0, int c) {
    if (m->seconds == NULL) return;
    const double t = now_s();
    m->seconds[c] += t - *t0;
    *t0 = t;
}

#define FAIL(layer, stage, rc) return 1000 * ((layer) + 1) + 100 * (stage) + ((rc) > 99 ? 99 : (rc))

/* Per-head RMS norm of `heads` heads of D floats at the start of each of M rows (row stride
 * `stride`), in place: the rows the eager path norms as [M * heads, D]. */
static void head_norms(float *rows, int64_t stride, int64_t heads, int64_t D, const float *w, int64_t M, float eps,
                       int threads) {
    for (int64_t r = 0; r < M; ++r) {
        float *row = rows + r * stride;
        add_rms_norm_f32(row, row, w, row, heads, D, eps, 0, threads);
    }
}

/* `embedded [M, hidden]` (the tokens' embeddings; read only), `cos`/`sin [tables, M, head_dim]`,
 * the decode attention's slots [groups, M], block tables [groups, M, table_width] and context
 * lengths [groups, M] (int64) -> `out [M, hidden]`, the final norm's output. `work`:
 * decode_step_work_floats floats; `scratch`: the largest scratch any projection needs at M rows. */
int decode_step_run(const ops_t *ops, const model_t *m, const layer_t *layers, const float *embedded,
                    const float *cos_t, const float *sin_t, const int64_t *slots, const int64_t *tables,
                    const int64_t *context_lens, float *out, float *work, void *scratch, int64_t M,
                    int threads) {
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t q = m->num_heads * D, kv = m->num_kv_heads * D, qkv_w = q + 2 * kv;
    float *residual = work, *normed = residual + M * H, *x = normed + M * H, *qkv = x + M * H;
    float *attn = qkv + M * qkv_w, *gate_up = attn + M * q, *act = gate_up + M * 2 * I;
    double t0 = m->seconds != NULL ? now_s() : 0.0;
    memcpy(residual, embedded, (size_t)(M * H) * sizeof(float));
    for (int l = 0; l < m->num_layers; ++l) {
        const layer_t *L = &layers[l];
        int rc;
        /* the first layer norms the embedding; later ones add the previous layer's output first */
        add_rms_norm_f32(l > 0 ? x : residual, residual, L->input_norm, normed, M, H, m->eps, l > 0, threads);
        lap(m, &t0, 2);
        if ((rc = run_linear(ops, &L->qkv, normed, qkv, scratch, M, threads))) FAIL(l, 1, rc);
        lap(m, &t0, 0);
        if (L->q_norm != NULL) {
            head_norms(qkv, qkv_w, m->num_heads, D, L->q_norm, M, m->eps, threads);
            head_norms(qkv + q, qkv_w, m->num_kv_heads, D, L->k_norm, M, m->eps, threads);
        }
        rotary_f32(qkv, cos_t + L->rope_table * M * D, sin_t + L->rope_table * M * D, M, qkv_w,
                   m->num_heads + m->num_kv_heads, D, threads);
        lap(m, &t0, 2);
        const int64_t g = L->kv_group;
        rc = ops->attention(m->kv_kind, qkv, qkv_w, qkv + q, qkv + q + kv, qkv_w, slots + g * M, L->key_cache,
                            L->value_cache, tables + g * M * m->table_width, context_lens + g * M, attn, (int)M,
                            m->num_heads, m->num_kv_heads, (int)D, m->block_size, m->table_width, m->num_blocks,
                            L->scale, L->window, threads, L->softcap);
        if (rc) FAIL(l, 2, rc);
        lap(m, &t0, 1);
        if ((rc = run_linear(ops, &L->o, attn, x, scratch, M, threads))) FAIL(l, 3, rc);
        lap(m, &t0, 0);
        if (L->pre_ff_norm != NULL) { /* Gemma: post-norm the attention, then add and pre-norm */
            add_rms_norm_f32(x, x, L->post_norm, x, M, H, m->eps, 0, threads);
            add_rms_norm_f32(x, residual, L->pre_ff_norm, normed, M, H, m->eps, 1, threads);
        } else {
            add_rms_norm_f32(x, residual, L->post_norm, normed, M, H, m->eps, 1, threads);
        }
        lap(m, &t0, 2);
        if ((rc = run_linear(ops, &L->gate_up, normed, gate_up, scratch, M, threads))) FAIL(l, 4, rc);
        lap(m, &t0, 0);
        if (L->act == ACT_GELU_TANH) gelu_tanh_mul_f32(gate_up, act, M, I, threads);
        else silu_mul_f32(gate_up, act, M, I, threads);
        lap(m, &t0, 2);
        if ((rc = run_linear(ops, &L->down, act, x, scratch, M, threads))) FAIL(l, 5, rc);
        lap(m, &t0, 0);
        if (L->post_ff_norm != NULL) {
            add_rms_norm_f32(x, x, L->post_ff_norm, x, M, H, m->eps, 0, threads);
            lap(m, &t0, 2);
        }
    }
    add_rms_norm_f32(x, residual, m->final_norm, out, M, H, m->eps, 1, threads);
    lap(m, &t0, 2);
    return 0;
}
