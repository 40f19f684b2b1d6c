/* A mixture-of-experts MLP for the one-call decoder stack (decoder_stack.c), the same
 * function as forerun/model/moe.py: route every token of the step (softmax over the
 * experts in float32, the top k, renormalised over them when asked), group the
 * (token, expert) pairs by expert, run each expert that received tokens once over its rows
 * (gate/up, SiLU-mul, down: the stack's matmul, so a decode step reads only the chosen
 * experts' weights) and add the weighted rows back per token, in increasing expert order,
 * in float32.
 *
 * The router weight is float32 [E, H] (a few hundred KiB; the logits of a step are a few
 * thousand multiply-adds per token); experts[2e] and experts[2e + 1] are expert e's gate/up
 * and down weights in the form the matmul reads (plain float32 rows, or GGUF block
 * descriptors).
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

int silu_and_mul_f32(const float *, float *, int64_t, int64_t);
int silu_and_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t);
int small_matmul_f32(const float *, const float *, const float *, float *, int64_t, int64_t,
                     int64_t);
int gguf_matmul_f32(const float *, const void *, const float *, float *, int64_t, int64_t,
                    int64_t);
int gguf_matmul_bf16(const uint16_t *, const void *, const uint16_t *, uint16_t *, int64_t,
                     int64_t, int64_t);

/* ids[i * k + j], w[i * k + j]: token i's j-th expert and its weight (largest first). */
static void route(const float *logits, int64_t t, int64_t e, int64_t k, int renormalize,
                  int64_t *ids, float *w, float *probs) {
    for (int64_t i = 0; i < t; ++i) {
        const float *l = logits + i * e;
        float mx = l[0], sum = 0.f;
        for (int64_t x = 1; x < e; ++x) mx = fmaxf(mx, l[x]);
        for (int64_t x = 0; x < e; ++x) sum += probs[x] = expf(l[x] - mx);
        for (int64_t x = 0; x < e; ++x) probs[x] /= sum;
        float chosen = 0.f;
        for (int64_t j = 0; j < k; ++j) { /* the j-th largest; the lower index on a tie */
            int64_t best = -1;
            for (int64_t x = 0; x < e; ++x)
                if (probs[x] >= 0.f && (best < 0 || probs[x] > probs[best])) best = x;
            ids[i * k + j] = best;
            w[i * k + j] = probs[best];
            chosen += probs[best];
            probs[best] = -1.f; /* taken */
        }
        if (renormalize)
            for (int64_t j = 0; j < k; ++j) w[i * k + j] /= chosen;
    }
}

/* out [t, H] = the MoE MLP of h [t, H]; 0, or -1 (no memory) or the matmul's error. */
#define DEFINE_MOE(T, NAME, MM, ACT, TO_F, FROM_F)                                                    \
    int NAME(const T *h, T *out, int64_t t, int64_t hidden, int64_t num_experts,    \
                        int64_t top_k, int64_t inter, int64_t renormalize,                      \
                        const float *router, const int64_t *experts) {                          \
        const int64_t H = hidden, E = num_experts, K = top_k, I = inter;                       \
        float *hf = malloc(sizeof(float) * (size_t)(t * H));                                   \
        float *logits = malloc(sizeof(float) * (size_t)(t * E));                               \
        float *probs = malloc(sizeof(float) * (size_t)E);                                      \
        float *w = malloc(sizeof(float) * (size_t)(t * K));                                    \
        float *acc = calloc((size_t)(t * H), sizeof(float));                                   \
        float *rw = malloc(sizeof(float) * (size_t)t);                                         \
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)(t * K));                              \
        int64_t *who = malloc(sizeof(int64_t) * (size_t)t);                                    \
        T *rows = malloc(sizeof(T) * (size_t)(t * H)), *eo = malloc(sizeof(T) * (size_t)(t * H)); \
        T *gu = malloc(sizeof(T) * (size_t)(t * 2 * I)), *act = malloc(sizeof(T) * (size_t)(t * I)); \
        int rc = 0;                                                                             \
        if (!hf || !logits || !probs || !w || !acc || !rw || !ids || !who || !rows || !eo ||   \
            !gu || !act)                                                                        \
            rc = -1;                                                                            \
        if (rc == 0) {                                                                          \
            for (int64_t i = 0; i < t * H; ++i) hf[i] = TO_F(h[i]);                            \
            for (int64_t i = 0; i < t; ++i)                                                     \
                for (int64_t x = 0; x < E; ++x) {                                               \
                    const float *a = hf + i * H, *b = router + x * H;                           \
                    float s = 0.f;                                                              \
                    for (int64_t c = 0; c < H; ++c) s += a[c] * b[c];                           \
                    logits[i * E + x] = s;                                                      \
                }                                                                               \
            route(logits, t, E, K, (int)renormalize, ids, w, probs);                            \
        }                                                                                       \
        for (int64_t x = 0; x < E && rc == 0; ++x) {                                            \
            int64_t n = 0;                                                                      \
            for (int64_t i = 0; i < t; ++i)                                                     \
                for (int64_t j = 0; j < K; ++j)                                                 \
                    if (ids[i * K + j] == x) {                                                  \
                        who[n] = i;                                                             \
                        rw[n] = w[i * K + j];                                                   \
                        memcpy(rows + n * H, h + i * H, sizeof(T) * (size_t)H);                 \
                        ++n;                                                                    \
                    }                                                                           \
            if (n == 0) continue; /* an expert no token chose: its weights are not read */     \
            const void *w13 = (const void *)(intptr_t)experts[2 * x];                           \
            const void *w2 = (const void *)(intptr_t)experts[2 * x + 1];                        \
            if (MM(rows, w13, NULL, gu, n, 2 * I, H) != 0) rc = -1;                             \
            ACT(gu, act, n, I);                                                  \
            if (rc == 0 && MM(act, w2, NULL, eo, n, H, I) != 0) rc = -1;                        \
            for (int64_t r = 0; r < n && rc == 0; ++r)                                          \
                for (int64_t c = 0; c < H; ++c)                                                 \
                    acc[who[r] * H + c] += rw[r] * TO_F(eo[r * H + c]);                         \
        }                                                                                       \
        if (rc == 0)                                                                            \
            for (int64_t i = 0; i < t * H; ++i) out[i] = FROM_F(acc[i]);                       \
        free(hf);                                                                               \
        free(logits);                                                                           \
        free(probs);                                                                            \
        free(w);                                                                                \
        free(acc);                                                                              \
        free(rw);                                                                               \
        free(ids);                                                                              \
        free(who);                                                                              \
        free(rows);                                                                             \
        free(eo);                                                                               \
        free(gu);                                                                               \
        free(act);                                                                              \
        return rc;                                                                              \
    }

#define ID(v) (v)
static int plain_matmul_f32(const float *x, const void *w, const float *bias, float *y,
                            int64_t t, int64_t n, int64_t k) {
    return small_matmul_f32(x, (const float *)w, bias, y, t, n, k);
}
DEFINE_MOE(float, moe_block_f32, plain_matmul_f32, silu_and_mul_f32, ID, ID)
DEFINE_MOE(float, moe_block_q_f32, gguf_matmul_f32, silu_and_mul_f32, ID, ID)
DEFINE_MOE(uint16_t, moe_block_q_bf16, gguf_matmul_bf16, silu_and_mul_bf16, bf16_to_f32,
           f32_to_bf16)
