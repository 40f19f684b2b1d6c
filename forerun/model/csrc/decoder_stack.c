/* Every decoder layer of a small batch in one call (CPU): the small-batch path.
 *
 * At a handful of tokens a layer's arithmetic is a few hundred microseconds of weight
 * streaming, and running it op by op from Python adds about as much again: a ctypes call
 * and tensor bookkeeping per op, ten ops a layer. Here the same kernels the op-by-op path
 * uses (RMSNorm, rotary, KV write, paged attention, SiLU-mul) run back to back with the
 * weight-streaming matmul of small_matmul.c, in the order of the Python layer
 * (forerun/model/llama.py), with no return to Python between layers. A mixture-of-experts
 * layer's MLP is moe_block.c's, over the same matmul (with gpt-oss's options where the layer
 * has them, and its attention sinks in the paged attention).
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe_opts.h"

/* Per layer, addresses of (in this order): */
enum {
    W_INPUT_NORM,
    W_QKV,
    B_QKV, /* 0 if none */
    W_Q_NORM, /* 0 if none (per-head q/k norm, Qwen3) */
    W_K_NORM,
    W_O,
    B_O,
    W_POST_NORM,
    W_GATE_UP,
    W_DOWN,
    K_CACHE,
    V_CACHE,
    W_ROUTER,  /* a mixture-of-experts layer (W_GATE_UP and W_DOWN 0): its router, float32 */
    W_EXPERTS, /* int64 [2 * num_experts]: each expert's gate/up and down weights */
    WINDOW,    /* not an address: the layer's sliding window (0: full attention; Mistral) */
    K_SCALE,   /* a quantized KV cache (kv_type > 0): float32 [num_blocks, kv_heads] scales */
    V_SCALE,
    SINKS,    /* float32 [num_heads]: gpt-oss's attention sinks (0 if none) */
    MOE_OPTS, /* a moe_opts_t: gpt-oss's additions to its MoE layer (0 if none) */
    NUM_LAYER_PTRS
};

/* The model's shape, and the step's attention inputs (as the op-by-op path passes them). */
typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos_half, *sin_half;                  /* [t, head_dim / 2] */
    const int64_t *slot_mapping, *block_tables;        /* [t], [seqs, table_stride] */
    int64_t table_stride;
    const int64_t *token_seq, *token_len;              /* [t], [t] */
    int64_t num_experts, top_k, moe_intermediate, renormalize; /* MoE layers (moe_block.c) */
    /* NULL, or [layers, 2]: each layer's block table and slot mapping, in place of the two
     * above (a hybrid KV cache: one table per group, every table table_stride wide). */
    const int64_t *layer_tables;
    int64_t kv_type; /* the KV cache's element kind: KV_NATIVE (0) or a 1-byte one */
} stack_args_t;

int rms_norm_f32(float *, float *, const float *, int64_t, int64_t, float);
int rms_norm_bf16(uint16_t *, uint16_t *, const uint16_t *, int64_t, int64_t, float);
int silu_and_mul_f32(const float *, float *, int64_t, int64_t);
int silu_and_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t);
int rotary_f32(float *, int64_t, int64_t, int64_t, int64_t, const float *, const float *);
int rotary_bf16(uint16_t *, int64_t, int64_t, int64_t, int64_t, const float *, const float *);
int small_matmul_f32(const float *, const float *, const float *, float *, int64_t, int64_t,
                     int64_t);
int small_matmul_bf16(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                      int64_t, int64_t);
int gguf_matmul_f32(const float *, const void *, const float *, float *, int64_t, int64_t,
                    int64_t);
int gguf_matmul_bf16(const uint16_t *, const void *, const uint16_t *, uint16_t *, int64_t,
                     int64_t, int64_t);
int paged_attention_f32(const float *, int64_t, const float *, const float *, const int64_t *,
                        int64_t, const int64_t *, const int64_t *, float *, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float, int64_t, float, const float *);
int paged_attention_bf16(const uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                         const int64_t *, int64_t, const int64_t *, const int64_t *, uint16_t *,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float,
                         const float *);
int moe_block_f32(const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                  const float *, const int64_t *, const moe_opts_t *);
int moe_block_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                   int64_t, const float *, const int64_t *, const moe_opts_t *);
int moe_block_q_f32(const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    const float *, const int64_t *, const moe_opts_t *);
int moe_block_q_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, const float *, const int64_t *, const moe_opts_t *);
int moe_block_l_f32(const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    const float *, const int64_t *, const moe_opts_t *);
int moe_block_l_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, const float *, const int64_t *, const moe_opts_t *);
int kv_cache_write(const void *, const void *, int64_t, const int64_t *, void *, void *, int64_t,
                   int64_t, int64_t, int64_t, int64_t);
int kv_cache_write_kvq(const void *, const void *, int64_t, const int64_t *, void *, void *,
                       float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
int paged_attention_kvq(const void *, int64_t, const void *, const void *, const float *,
                        const float *, int64_t, const int64_t *, int64_t, const int64_t *,
                        const int64_t *, void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float, int64_t, float, const float *, int64_t);

int int8_quantize_rows_f32(const float *, int8_t *, float *, int64_t, int64_t);
int int8_quantize_rows_bf16(const uint16_t *, int8_t *, float *, int64_t, int64_t);
int int8_dequant_f32(const int32_t *, const float *, const float *, const float *, float *,
                     int64_t, int64_t);
int int8_dequant_bf16(const int32_t *, const float *, const float *, const uint16_t *,
                      uint16_t *, int64_t, int64_t);
int int8_matmul_acc(const int8_t *, const int8_t *, const int32_t *, int32_t *, int64_t, int64_t,
                    int64_t);

#define P(layer, i) ((const void *)(intptr_t)(layer)[i])

/* ---- a stack of mixed linears -----------------------------------------------------------
 * int8 layers keep their fused q/k/v in the model's dtype (int8_linear.KEEP_FLOAT), and a
 * GGUF file may hold some linears in blocks and others as plain tensors (gpt-oss's: MXFP4
 * experts, bf16 attention), so a layer holds linears of two kinds; each weight "address" of
 * such a stack is a linear_t (cpu_kernels.LinearDesc), and linear_matmul_* runs the kernel
 * of its kind. */
enum { LIN_PLAIN = 0, LIN_INT8 = 1, LIN_GGUF = 2 };
typedef struct {
    int64_t kind;
    const void *w;       /* LIN_PLAIN: small_matmul's form; LIN_INT8: int8 tiles (int8_matmul.c);
                          * LIN_GGUF: the blocks' qweight_t descriptor */
    const float *scale;  /* LIN_INT8: per output channel [n] */
    const int32_t *wsum; /* LIN_INT8: each row's sum (int8_matmul.c) */
} linear_t;

/* quantization="int8"'s linear, as Int8Linear.forward runs it op by op (the same row
 * quantization, exact integer sums, the same rescale: the same bits). */
#define DEFINE_INT8_LINEAR(T, SFX)                                                              \
    static int int8_linear_##SFX(const T *x, const linear_t *l, const T *bias, T *y, int64_t m, \
                                 int64_t n, int64_t k) {                                        \
        int8_t *xq = malloc((size_t)(m * k));                                                   \
        float *sx = malloc(sizeof(float) * (size_t)m);                                          \
        int32_t *acc = malloc(sizeof(int32_t) * (size_t)(m * n));                               \
        int rc = xq && sx && acc ? 0 : -1;                                                      \
        if (rc == 0) {                                                                          \
            int8_quantize_rows_##SFX(x, xq, sx, m, k);                                          \
            rc = int8_matmul_acc(xq, l->w, l->wsum, acc, m, n, k);                              \
            if (rc == 0) int8_dequant_##SFX(acc, sx, l->scale, bias, y, m, n);                  \
        }                                                                                       \
        free(xq);                                                                               \
        free(sx);                                                                               \
        free(acc);                                                                              \
        return rc;                                                                              \
    }                                                                                           \
    int linear_matmul_##SFX(const T *x, const void *desc, const T *bias, T *y, int64_t m,       \
                            int64_t n, int64_t k) {                                             \
        const linear_t *l = desc;                                                               \
        switch (l->kind) {                                                                      \
        case LIN_PLAIN: return small_matmul_##SFX(x, l->w, bias, y, m, n, k);                   \
        case LIN_INT8: return int8_linear_##SFX(x, l, bias, y, m, n, k);                        \
        case LIN_GGUF: return gguf_matmul_##SFX(x, l->w, bias, y, m, n, k);                     \
        default: return -2;                                                                     \
        }                                                                                       \
    }
DEFINE_INT8_LINEAR(float, f32)
DEFINE_INT8_LINEAR(uint16_t, bf16)

/* One body for both dtypes: T is the storage type, SFX the kernels' suffix, MM the matmul
 * (small_matmul over plain/packed weights, or gguf_matmul over GGUF blocks of any type,
 * whose weight "addresses" are qweight_t descriptors: quantization="gguf"), MOE the
 * mixture-of-experts MLP over the same weight form, NAME the entry point. */
#define DEFINE_STACK(T, SFX, MM, MOE, NAME)                                                     \
    int NAME(int64_t num_layers, const int64_t *layer_ptrs,                                     \
                            const T *final_norm, T *x, T *residual, int64_t t,                  \
                            const stack_args_t *a) {                                            \
        const int64_t H = a->hidden, D = a->head_dim, NH = a->num_heads,                        \
                      KVH = a->num_kv_heads, I = a->intermediate;                               \
        const int64_t qs = NH * D, kvs = KVH * D, row = qs + 2 * kvs;                           \
        T *qkv = malloc(sizeof(T) * t * row), *attn = malloc(sizeof(T) * t * qs);               \
        T *gate_up = malloc(sizeof(T) * t * 2 * I), *act = malloc(sizeof(T) * t * I);           \
        T *h = malloc(sizeof(T) * t * H);                                                       \
        int rc = 0;                                                                             \
        if (!qkv || !attn || !gate_up || !act || !h) rc = -1;                                   \
        for (int64_t l = 0; l < num_layers && rc == 0; ++l) {                                   \
            const int64_t *lp = layer_ptrs + l * NUM_LAYER_PTRS;                                \
            /* x is the previous layer's MLP output; its residual add is fused into this */     \
            /* layer's first norm (the first layer starts the residual stream). */              \
            if (l == 0) {                                                                       \
                memcpy(residual, x, sizeof(T) * t * H);                                         \
                rms_norm_##SFX(x, NULL, P(lp, W_INPUT_NORM), t, H, a->eps);                     \
            } else {                                                                            \
                rms_norm_##SFX(x, residual, P(lp, W_INPUT_NORM), t, H, a->eps);                 \
            }                                                                                   \
            if (MM(x, P(lp, W_QKV), P(lp, B_QKV), qkv, t, row, H) != 0) rc = -1;                \
            if (lp[W_Q_NORM]) {                                                                 \
                for (int64_t i = 0; i < t; ++i) {                                               \
                    rms_norm_##SFX(qkv + i * row, NULL, P(lp, W_Q_NORM), NH, D, a->eps);        \
                    rms_norm_##SFX(qkv + i * row + qs, NULL, P(lp, W_K_NORM), KVH, D, a->eps);  \
                }                                                                               \
            }                                                                                   \
            rotary_##SFX(qkv, t, NH, row, D, a->cos_half, a->sin_half);                         \
            rotary_##SFX(qkv + qs, t, KVH, row, D, a->cos_half, a->sin_half);                   \
            void *kc = (void *)(intptr_t)lp[K_CACHE], *vc = (void *)(intptr_t)lp[V_CACHE];      \
            const int64_t *tables = a->block_tables, *slots = a->slot_mapping;                  \
            if (a->layer_tables) {                                                              \
                tables = (const int64_t *)(intptr_t)a->layer_tables[2 * l];                     \
                slots = (const int64_t *)(intptr_t)a->layer_tables[2 * l + 1];                  \
            }                                                                                   \
            if (a->kv_type) { /* a quantized cache: its scales in the table */                  \
                float *ksc = (float *)(intptr_t)lp[K_SCALE], *vsc = (float *)(intptr_t)lp[V_SCALE]; \
                kv_cache_write_kvq(qkv + qs, qkv + qs + kvs, row, slots, kc, vc, ksc, vsc, t,    \
                                   KVH, a->block_size, D, sizeof(T) == 2, a->kv_type);          \
                if (paged_attention_kvq(qkv, row, kc, vc, ksc, vsc, a->kv_type, tables,          \
                                        a->table_stride, a->token_seq, a->token_len, attn, t,   \
                                        NH, KVH, a->block_size, D, a->scale, lp[WINDOW], 0.f,   \
                                        P(lp, SINKS), sizeof(T) == 2) != 0)                     \
                    rc = -1;                                                                    \
            } else {                                                                            \
                kv_cache_write(qkv + qs, qkv + qs + kvs, row, slots, kc, vc, t, KVH,            \
                               a->block_size, D, sizeof(T));                                    \
                if (paged_attention_##SFX(qkv, row, kc, vc, tables, a->table_stride,            \
                                          a->token_seq, a->token_len, attn, t, NH, KVH,         \
                                          a->block_size, D, a->scale, lp[WINDOW], 0.f,          \
                                          P(lp, SINKS)) != 0)                                   \
                    rc = -1;                                                                    \
            }                                                                                   \
            if (MM(attn, P(lp, W_O), P(lp, B_O), h, t, H, qs) != 0) rc = -1;                    \
            rms_norm_##SFX(h, residual, P(lp, W_POST_NORM), t, H, a->eps);                      \
            if (lp[W_ROUTER]) {                                                                 \
                if (MOE(h, x, t, H, a->num_experts, a->top_k, a->moe_intermediate,              \
                        a->renormalize, P(lp, W_ROUTER), P(lp, W_EXPERTS), P(lp, MOE_OPTS)) != 0) \
                    rc = -1;                                                                    \
                continue;                                                                       \
            }                                                                                   \
            if (MM(h, P(lp, W_GATE_UP), NULL, gate_up, t, 2 * I, H) != 0) rc = -1;              \
            silu_and_mul_##SFX(gate_up, act, t, I);                                             \
            if (MM(act, P(lp, W_DOWN), NULL, x, t, H, I) != 0) rc = -1;                         \
        }                                                                                       \
        if (rc == 0) rms_norm_##SFX(x, residual, final_norm, t, H, a->eps);                     \
        free(qkv);                                                                              \
        free(attn);                                                                             \
        free(gate_up);                                                                          \
        free(act);                                                                              \
        free(h);                                                                                \
        return rc;                                                                              \
    }

DEFINE_STACK(float, f32, small_matmul_f32, moe_block_f32, decoder_stack_f32)
DEFINE_STACK(uint16_t, bf16, small_matmul_bf16, moe_block_bf16, decoder_stack_bf16)
DEFINE_STACK(float, f32, gguf_matmul_f32, moe_block_q_f32, decoder_stack_q_f32)
DEFINE_STACK(uint16_t, bf16, gguf_matmul_bf16, moe_block_q_bf16, decoder_stack_q_bf16)
/* Mixed linears (linear_t), int8 experts too. */
DEFINE_STACK(float, f32, linear_matmul_f32, moe_block_l_f32, decoder_stack_l_f32)
DEFINE_STACK(uint16_t, bf16, linear_matmul_bf16, moe_block_l_bf16, decoder_stack_l_bf16)
