/* Attention read straight from the paged KV cache (CPU), for every query token of a step.
 *
 * Each query token comes with the block-table row of its sequence and the number of
 * context positions it may see (its own position + 1: causal). A decode token sees the
 * whole sequence; the tokens of a prefill chunk see growing prefixes, so one call serves a
 * mixed batch once the step's new K/V rows are in the cache (kv_cache_write below).
 * The torch fallback gathers every context into a dense copy and runs matmuls or SDPA over
 * it, reading the cache, writing it and reading it again; here each (token, kv head) pair
 * walks its blocks once for the scores and once for the values, in float32, with the G
 * query heads that share the kv head handled together, spread over the OpenMP threads.
 *
 * Cache layout (forerun/model/attention.py): [num_blocks, kv_heads, block_size, head_dim].
 * Built by forerun/model/cpu_kernels.py with the system C compiler; loaded through ctypes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE void load_row(const void *src, int is_bf16, int64_t i, int64_t D, float *dst) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
            uint32_t u = (uint32_t)s[d] << 16;
            memcpy(&dst[d], &u, sizeof u);
        }
    } else {
        memcpy(dst, (const float *)src + i * D, sizeof(float) * D);
    }
}

INLINE void store_row(void *dst, int is_bf16, int64_t i, int64_t D, const float *src) {
    if (!is_bf16) {
        memcpy((float *)dst + i * D, src, sizeof(float) * D);
        return;
    }
    uint16_t *o = (uint16_t *)dst + i * D;
    for (int64_t d = 0; d < D; ++d) {
        uint32_t u;
        memcpy(&u, &src[d], sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            o[d] = (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
        else
            o[d] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* nearest even */
    }
}

/* One (token, kv head) pair: G query rows against the L context tokens. */
INLINE void attend(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                   const int64_t *table, void *out, int64_t b, int64_t h, int64_t L, int64_t H,
                   int64_t KVH, int64_t BS, int64_t D, int64_t G, float scale, int is_bf16,
                   float *qf, float *acc, float *row, float *scores) {
    const size_t esz = is_bf16 ? 2 : 4;
    const char *qrow = (const char *)q + b * q_stride * esz;
    for (int64_t g = 0; g < G; ++g) {
        load_row(qrow, is_bf16, h * G + g, D, qf + g * D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    }
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const char *blk = (const char *)k_cache + (table[t0 / BS] * KVH + h) * BS * D * esz;
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        for (int64_t i = 0; i < n; ++i) {
            load_row(blk, is_bf16, i, D, row);
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = qf + g * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
                scores[g * L + t0 + i] = s;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *sg = scores + g * L, m = -FLT_MAX, sum = 0.f;
        for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const char *blk = (const char *)v_cache + (table[t0 / BS] * KVH + h) * BS * D * esz;
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        for (int64_t i = 0; i < n; ++i) {
            load_row(blk, is_bf16, i, D, row);
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * L + t0 + i];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) store_row(out, is_bf16, b * H + h * G + g, D, acc + g * D);
}

/* Constant head_dim and dtype let the compiler unroll the row loops completely. */
#define ATTEND_CASE(DIM, BF16)                                                                \
    attend(q, q_stride, k_cache, v_cache, table, out, b, h, L, num_heads, num_kv_heads,      \
           block_size, DIM, G, scale, BF16, qf, acc, row, scores)

static int run(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
               const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
               const int64_t *token_len, void *out, int64_t num_tokens, int64_t num_heads,
               int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
               int is_bf16) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_tokens; ++b)
        if (token_len[b] > max_len) max_len = token_len[b];
    int failed = 0;
#pragma omp parallel
    {
        float *qf = malloc(sizeof(float) * G * D), *acc = malloc(sizeof(float) * G * D);
        float *row = malloc(sizeof(float) * D), *scores = malloc(sizeof(float) * G * max_len);
        if (!qf || !acc || !row || !scores) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int64_t w = 0; w < num_tokens * num_kv_heads; ++w) {
                const int64_t b = w / num_kv_heads, h = w % num_kv_heads, L = token_len[b];
                const int64_t *table = block_tables + token_seq[b] * table_stride;
                if (D == 64 && is_bf16) ATTEND_CASE(64, 1);
                else if (D == 64) ATTEND_CASE(64, 0);
                else if (D == 128 && is_bf16) ATTEND_CASE(128, 1);
                else if (D == 128) ATTEND_CASE(128, 0);
                else if (is_bf16) ATTEND_CASE(D, 1);
                else ATTEND_CASE(D, 0);
            }
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
    }
    return failed ? -1 : 0;
}

int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *token_seq, const int64_t *token_len, float *out,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t head_dim, float scale) {
    return run(q, q_stride, k_cache, v_cache, block_tables, table_stride, token_seq, token_len,
               out, num_tokens, num_heads, num_kv_heads, block_size, head_dim, scale, 0);
}

int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *token_seq,
                         const int64_t *token_len, uint16_t *out, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                         int64_t head_dim, float scale) {
    return run(q, q_stride, k_cache, v_cache, block_tables, table_stride, token_seq, token_len,
               out, num_tokens, num_heads, num_kv_heads, block_size, head_dim, scale, 1);
}

/* Store the step's new K and V rows (token t's heads contiguous, tokens src_stride
 * elements apart, e.g. views into the fused qkv output) in their cache slots. */
static void write_rows(const char *k, const char *v, int64_t src_stride,
                       const int64_t *slot_mapping, char *k_cache, char *v_cache,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
                       int64_t head_dim, size_t esz) {
    const size_t row = (size_t)head_dim * esz;
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t], blk = slot / block_size, off = slot % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const size_t dst = (size_t)((blk * num_kv_heads + h) * block_size + off) * row;
            const size_t src = (size_t)t * src_stride * esz + (size_t)h * row;
            memcpy(k_cache + dst, k + src, row);
            memcpy(v_cache + dst, v + src, row);
        }
    }
}

int kv_cache_write_f32(const float *k, const float *v, int64_t src_stride,
                       const int64_t *slot_mapping, float *k_cache, float *v_cache,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
                       int64_t head_dim) {
    write_rows((const char *)k, (const char *)v, src_stride, slot_mapping, (char *)k_cache,
               (char *)v_cache, num_tokens, num_kv_heads, block_size, head_dim, 4);
    return 0;
}

int kv_cache_write_bf16(const uint16_t *k, const uint16_t *v, int64_t src_stride,
                        const int64_t *slot_mapping, uint16_t *k_cache, uint16_t *v_cache,
                        int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
                        int64_t head_dim) {
    write_rows((const char *)k, (const char *)v, src_stride, slot_mapping, (char *)k_cache,
               (char *)v_cache, num_tokens, num_kv_heads, block_size, head_dim, 2);
    return 0;
}
