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
 * and down weights in the form the matmul reads (plain float32 or bfloat16 rows, GGUF block
 * descriptors, or decoder_stack.c's linear_t: quantization="int8"'s experts).
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "moe_opts.h"

int silu_and_mul_f32(const float *, float *, int64_t, int64_t);
int silu_and_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t);
int small_matmul_f32(const float *, const float *, const float *, float *, int64_t, int64_t,
                     int64_t);
int gguf_matmul_f32(const float *, const void *, const float *, float *, int64_t, int64_t,
                    int64_t);
int gguf_matmul_bf16(const uint16_t *, const void *, const uint16_t *, uint16_t *, int64_t,
                     int64_t, int64_t);
int rowmajor_matmul_bf16(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *,
                         int64_t, int64_t, int64_t);
int linear_matmul_f32(const float *, const void *, const float *, float *, int64_t, int64_t,
                      int64_t);
int linear_matmul_bf16(const uint16_t *, const void *, const uint16_t *, uint16_t *, int64_t,
                       int64_t, int64_t);

/* ids[i * k + j], w[i * k + j]: token i's j-th expert and its weight (largest first): the
 * top k of the softmax over all experts (renormalised over them when asked), or with
 * over_top_k the top k logits and the softmax over those alone (gpt-oss). */
static void route(const float *logits, int64_t t, int64_t e, int64_t k, int renormalize,
                  int over_top_k, int64_t *ids, float *w, float *probs) {
    for (int64_t i = 0; i < t; ++i) {
        const float *l = logits + i * e;
        float mx = l[0], sum = 0.f;
        for (int64_t x = 1; x < e; ++x) mx = fmaxf(mx, l[x]);
        if (over_top_k) { /* order by logit: the softmax keeps it */
            for (int64_t x = 0; x < e; ++x) probs[x] = l[x] - mx;
        } else {
            for (int64_t x = 0; x < e; ++x) sum += probs[x] = expf(l[x] - mx);
            for (int64_t x = 0; x < e; ++x) probs[x] /= sum;
        }
        float chosen = 0.f;
        for (int64_t j = 0; j < k; ++j) { /* the j-th largest; the lower index on a tie */
            int64_t best = -1;
            for (int64_t x = 0; x < e; ++x)
                if (probs[x] != -INFINITY && (best < 0 || probs[x] > probs[best])) best = x;
            ids[i * k + j] = best;
            w[i * k + j] = over_top_k ? expf(probs[best]) : probs[best];
            chosen += w[i * k + j];
            probs[best] = -INFINITY; /* taken */
        }
        if (renormalize || over_top_k)
            for (int64_t j = 0; j < k; ++j) w[i * k + j] /= chosen;
    }
}

/* gpt-oss's expert activation, rows of [gate (I) | up (I)] -> I values:
 * (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g), g the gate clamped to <= limit. */
#define DEFINE_SWIGLU(T, NAME, TO_F, FROM_F)                                                    \
    static void NAME(const T *gu, T *out, int64_t n, int64_t I, float alpha, float limit) {    \
        for (int64_t r = 0; r < n; ++r)                                                        \
            for (int64_t c = 0; c < I; ++c) {                                                  \
                const float g = fminf(TO_F(gu[r * 2 * I + c]), limit);                         \
                const float u = fminf(fmaxf(TO_F(gu[r * 2 * I + I + c]), -limit), limit);      \
                out[r * I + c] = FROM_F((u + 1.f) * (g / (1.f + expf(-alpha * g))));          \
            }                                                                                  \
    }

/* The router's logits [t, E] = hf [t, H] @ router.T, spread over the threads: at 16 tokens
 * of Qwen3-30B-A3B's 128 experts they are 4 M multiply-adds per layer, at a 512-token
 * prefill 134 M. With AVX-512 (H a multiple of 16) four tokens against four experts at a
 * time, so each loaded vector feeds four products (a dot product per pair loaded two
 * vectors per product: 8% of that prefill's layer); elsewhere a dot product per pair. */
static void router_logits(const float *hf, const float *router, float *logits, int64_t t,
                          int64_t E, int64_t H) {
#if defined(__AVX512F__)
    if (H % 16 == 0) {
        const int64_t tb = (t + 3) / 4, eb = (E + 3) / 4;
#pragma omp parallel for schedule(static) if (t * E * H > 65536)
        for (int64_t ix = 0; ix < tb * eb; ++ix) {
            const int64_t i0 = ix / eb * 4, x0 = ix % eb * 4;
            const int64_t ni = t - i0 < 4 ? t - i0 : 4, nx = E - x0 < 4 ? E - x0 : 4;
            const float *a[4], *b[4];
            for (int64_t r = 0; r < 4; ++r) { /* short blocks repeat their last row */
                a[r] = hf + (i0 + (r < ni ? r : ni - 1)) * H;
                b[r] = router + (x0 + (r < nx ? r : nx - 1)) * H;
            }
            __m512 acc[4][4];
            for (int r = 0; r < 4; ++r)
                for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
            for (int64_t c = 0; c < H; c += 16) {
                __m512 bv[4];
                for (int q = 0; q < 4; ++q) bv[q] = _mm512_loadu_ps(b[q] + c);
                for (int r = 0; r < 4; ++r) {
                    const __m512 av = _mm512_loadu_ps(a[r] + c);
                    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
                }
            }
            for (int64_t r = 0; r < ni; ++r)
                for (int64_t q = 0; q < nx; ++q)
                    logits[(i0 + r) * E + x0 + q] = _mm512_reduce_add_ps(acc[r][q]);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (t * E * H > 65536)
    for (int64_t ix = 0; ix < t * E; ++ix) {
        const float *a = hf + (ix / E) * H, *b = router + (ix % E) * H;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < H; ++c) s += a[c] * b[c];
        logits[ix] = s;
    }
}

/* The block's scratch (routing, the grouped rows and every expert's intermediates: tens
 * of MB at a prefill), kept per calling thread from call to call: fresh pages each call
 * cost about 8% of a Qwen3-30B-A3B layer's 512-token prefill in page faults. A buffer past
 * SCRATCH_KEEP (a prefill of thousands of tokens) is released after its call instead. */
#define SCRATCH_KEEP ((size_t)128 << 20)
static __thread char *scratch_buf = NULL;
static __thread size_t scratch_cap = 0;

static char *moe_scratch(size_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch_buf);
        scratch_cap = (bytes + 4095) / 4096 * 4096;
        scratch_buf = aligned_alloc(64, scratch_cap);
        if (!scratch_buf) scratch_cap = 0;
    }
    return scratch_buf;
}

static void moe_scratch_done(void) {
    if (scratch_cap > SCRATCH_KEEP) {
        free(scratch_buf);
        scratch_buf = NULL;
        scratch_cap = 0;
    }
}

/* The offset of the next n bytes at *at (64-byte aligned). */
static size_t carve(size_t *at, size_t n) {
    const size_t o = (*at + 63) / 64 * 64;
    *at = o + n;
    return o;
}

/* out [t, H] = the MoE MLP of h [t, H]; 0, or -1 (no memory) or the matmul's error.
 * The (token, expert) pairs are laid out grouped by expert (tokens in order within one),
 * and the experts that received tokens run in parallel, one whole expert per thread at a
 * time (its matmuls then single-threaded: nested regions are inactive): a decode step's k
 * small matmuls were each split over the threads with a fork and join per matmul, and
 * each thread now streams whole experts' weights. The weighted rows are then added per
 * token in increasing expert order, in float32, as before. */
#define DEFINE_MOE(T, NAME, MM, ACT, SWIGLU, TO_F, FROM_F)                                      \
    int NAME(const T *h, T *out, int64_t t, int64_t hidden, int64_t num_experts,               \
             int64_t top_k, int64_t inter, int64_t renormalize, const float *router,          \
             const int64_t *experts, const moe_opts_t *opts) {                                 \
        const moe_opts_t none = {0};                                                           \
        const moe_opts_t *o = opts ? opts : &none;                                             \
        const T *b13 = (const T *)o->b13, *b2 = (const T *)o->b2;                             \
        const int64_t H = hidden, E = num_experts, K = top_k, I = inter, P = t * top_k;        \
        size_t at = 0;                                                                         \
        const size_t o_hf = carve(&at, sizeof(float) * (size_t)(t * H));                     \
        const size_t o_logits = carve(&at, sizeof(float) * (size_t)(t * E));                  \
        const size_t o_probs = carve(&at, sizeof(float) * (size_t)E);                         \
        const size_t o_w = carve(&at, sizeof(float) * (size_t)P);                             \
        const size_t o_acc = carve(&at, sizeof(float) * (size_t)(t * H));                     \
        const size_t o_rw = carve(&at, sizeof(float) * (size_t)P);                            \
        const size_t o_ids = carve(&at, sizeof(int64_t) * (size_t)P);                         \
        const size_t o_who = carve(&at, sizeof(int64_t) * (size_t)P);                         \
        const size_t o_first = carve(&at, sizeof(int64_t) * (size_t)(E + 1));                \
        const size_t o_active = carve(&at, sizeof(int64_t) * (size_t)E);                      \
        const size_t o_rows = carve(&at, sizeof(T) * (size_t)(P * H));                        \
        const size_t o_eo = carve(&at, sizeof(T) * (size_t)(P * H));                          \
        const size_t o_gu = carve(&at, sizeof(T) * (size_t)(P * 2 * I));                      \
        const size_t o_act = carve(&at, sizeof(T) * (size_t)(P * I));                         \
        char *base = moe_scratch(at);                                                          \
        if (!base) return -1;                                                                  \
        float *hf = (float *)(base + o_hf), *logits = (float *)(base + o_logits);             \
        float *probs = (float *)(base + o_probs), *w = (float *)(base + o_w);                 \
        float *acc = (float *)(base + o_acc), *rw = (float *)(base + o_rw);                   \
        int64_t *ids = (int64_t *)(base + o_ids), *who = (int64_t *)(base + o_who);           \
        int64_t *first = (int64_t *)(base + o_first), *active = (int64_t *)(base + o_active); \
        T *rows = (T *)(base + o_rows), *eo = (T *)(base + o_eo);                             \
        T *gu = (T *)(base + o_gu), *act = (T *)(base + o_act);                               \
        memset(acc, 0, sizeof(float) * (size_t)(t * H));                                       \
        memset(first, 0, sizeof(int64_t) * (size_t)(E + 1));                                   \
        int rc = 0;                                                                            \
        int64_t na = 0;                                                                        \
        {                                                                                      \
            for (int64_t i = 0; i < t * H; ++i) hf[i] = TO_F(h[i]);                           \
            router_logits(hf, router, logits, t, E, H);                                        \
            if (o->router_bias)                                                                \
                for (int64_t i = 0; i < t * E; ++i) logits[i] += o->router_bias[i % E];       \
            route(logits, t, E, K, (int)renormalize, (int)o->softmax_over_top_k, ids, w,       \
                  probs);                                                                      \
            /* first[x]: expert x's first pair in the grouped layout */                       \
            for (int64_t p = 0; p < P; ++p) ++first[ids[p] + 1];                               \
            for (int64_t x = 0; x < E; ++x) {                                                  \
                if (first[x + 1] > 0) active[na++] = x;                                        \
                first[x + 1] += first[x];                                                      \
            }                                                                                  \
            for (int64_t x = 0, p = 0; x < E; ++x) /* tokens in order within each expert */   \
                for (int64_t i = 0; i < t && first[x + 1] > first[x]; ++i)                     \
                    for (int64_t j = 0; j < K; ++j)                                            \
                        if (ids[i * K + j] == x) {                                             \
                            who[p] = i;                                                        \
                            rw[p] = w[i * K + j];                                              \
                            memcpy(rows + p * H, h + i * H, sizeof(T) * (size_t)H);            \
                            ++p;                                                               \
                        }                                                                      \
        }                                                                                      \
        _Pragma("omp parallel for schedule(dynamic, 1) reduction(| : rc) if (na > 1)")        \
        for (int64_t a = 0; a < na; ++a) {                                                     \
            const int64_t x = active[a], p0 = first[x], n = first[x + 1] - p0;                 \
            const void *w13 = (const void *)(intptr_t)experts[2 * x];                          \
            const void *w2 = (const void *)(intptr_t)experts[2 * x + 1];                       \
            if (MM(rows + p0 * H, w13, b13 ? b13 + x * 2 * I : NULL, gu + p0 * 2 * I, n, 2 * I, \
                   H) != 0) {                                                                  \
                rc |= 1;                                                                       \
                continue;                                                                      \
            }                                                                                  \
            if (o->swiglu_limit > 0.f)                                                         \
                SWIGLU(gu + p0 * 2 * I, act + p0 * I, n, I, o->swiglu_alpha, o->swiglu_limit); \
            else                                                                               \
                ACT(gu + p0 * 2 * I, act + p0 * I, n, I);                                      \
            if (MM(act + p0 * I, w2, b2 ? b2 + x * H : NULL, eo + p0 * H, n, H, I) != 0)       \
                rc |= 1;                                                                       \
        }                                                                                      \
        if (rc != 0) rc = -1;                                                                  \
        for (int64_t p = 0; p < first[E] && rc == 0; ++p) /* expert order */                  \
            for (int64_t c = 0; c < H; ++c) acc[who[p] * H + c] += rw[p] * TO_F(eo[p * H + c]); \
        if (rc == 0)                                                                           \
            for (int64_t i = 0; i < t * H; ++i) out[i] = FROM_F(acc[i]);                      \
        moe_scratch_done();                                                                    \
        return rc;                                                                             \
    }

#define ID(v) (v)
static int plain_matmul_f32(const float *x, const void *w, const float *bias, float *y,
                            int64_t t, int64_t n, int64_t k) {
    return small_matmul_f32(x, (const float *)w, bias, y, t, n, k);
}
DEFINE_SWIGLU(float, swiglu_f32, ID, ID)
DEFINE_SWIGLU(uint16_t, swiglu_bf16, bf16_to_f32, f32_to_bf16)
DEFINE_MOE(float, moe_block_f32, plain_matmul_f32, silu_and_mul_f32, swiglu_f32, ID, ID)
static int plain_matmul_bf16(const uint16_t *x, const void *w, const uint16_t *bias,
                             uint16_t *y, int64_t t, int64_t n, int64_t k) {
    return rowmajor_matmul_bf16(x, (const uint16_t *)w, bias, y, t, n, k);
}
DEFINE_MOE(uint16_t, moe_block_bf16, plain_matmul_bf16, silu_and_mul_bf16, swiglu_bf16,
           bf16_to_f32, f32_to_bf16)
DEFINE_MOE(float, moe_block_q_f32, gguf_matmul_f32, silu_and_mul_f32, swiglu_f32, ID, ID)
DEFINE_MOE(uint16_t, moe_block_q_bf16, gguf_matmul_bf16, silu_and_mul_bf16, swiglu_bf16,
           bf16_to_f32, f32_to_bf16)
DEFINE_MOE(float, moe_block_l_f32, linear_matmul_f32, silu_and_mul_f32, swiglu_f32, ID, ID)
DEFINE_MOE(uint16_t, moe_block_l_bf16, linear_matmul_bf16, silu_and_mul_bf16, swiglu_bf16,
           bf16_to_f32, f32_to_bf16)
