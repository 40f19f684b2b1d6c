/* Attention read straight from the paged KV cache (CPU), for every query token of a step.
 *
 * Each query token comes with the block-table row of its sequence and the number of
 * context positions it may see (its own position + 1: causal). A sliding-window layer
 * (window > 0) sees only the last `window` of those, its own included: the walk starts at
 * the block holding the first of them, so blocks wholly before the window are never read
 * (the KV cache manager may have freed them), and the earlier positions of that first block
 * get probability 0. With softcap > 0 (Gemma 2) each scaled score s becomes
 * softcap * tanh(s / softcap) before the softmax. With sinks (gpt-oss; NULL: none) each query
 * head's learned logit sinks[head] joins its softmax's denominator only: the probabilities
 * of the context then sum to less than 1 (the sink's share attends to nothing). A decode
 * token sees the whole sequence (or window); the tokens of a prefill chunk see growing prefixes, so one call serves a
 * mixed batch once the step's new K/V rows are in the cache (kv_cache_write below).
 * The torch fallback gathers every context into a dense copy and runs matmuls or SDPA over
 * it, reading the cache, writing it and reading it again; here each (token, kv head) pair
 * walks its blocks once for the scores and once for the values, in float32, with the G
 * query heads that share the kv head handled together, spread over the OpenMP threads.
 *
 * Cache layout (forerun/model/attention.py): V is [num_blocks, kv_heads, block_size, head_dim];
 * K is [num_blocks, kv_heads, head_dim, block_size], each block's keys stored dimension-major,
 * so the scores of a whole block are vertical multiply-adds over the head dimension (one
 * vector lane per key) instead of one horizontal reduction per key and query head.
 * Built by forerun/model/cpu_kernels.py with the system C compiler; loaded through ctypes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* how far ahead the context walk asks for the next blocks */

#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 consecutive values as float32 lanes. */
INLINE __m512 load16(const char *p, int is_bf16) {
    if (is_bf16) return bf16x16_load((const uint16_t *)p);
    return _mm512_loadu_ps((const float *)p);
}

/* Scores of one 16-key block for G query rows: out[g * 16 + i] = q_g . key_i, the keys
 * stored dimension-major (kb[d * 16 + i]); up to four query rows share each key load. */
INLINE void score_block16(const char *kb, const float *qf, int64_t G, int64_t D, int is_bf16,
                          float *out) {
    const size_t esz = is_bf16 ? 2 : 4;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = G - g0 < 4 ? G - g0 : 4;
        const float *q0 = qf + g0 * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; ++d) {
            const __m512 k = load16(kb + (size_t)d * 16 * esz, is_bf16);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), k, a0);
            if (gn > 1) a1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[D + d]), k, a1);
            if (gn > 2) a2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * D + d]), k, a2);
            if (gn > 3) a3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * D + d]), k, a3);
        }
        _mm512_storeu_ps(out + g0 * 16, a0);
        if (gn > 1) _mm512_storeu_ps(out + (g0 + 1) * 16, a1);
        if (gn > 2) _mm512_storeu_ps(out + (g0 + 2) * 16, a2);
        if (gn > 3) _mm512_storeu_ps(out + (g0 + 3) * 16, a3);
    }
}
/* Weighted sum of the context's values for up to four query rows (head_dim 64), the
 * sixteen float32 accumulators kept in registers for the whole walk over the blocks. */
INLINE void accumulate_values64(const char *v_cache, const int64_t *table, int64_t L,
                                int64_t KVH, int64_t h, int64_t BS, const float *probs,
                                int64_t G, int is_bf16, float *acc) {
    const size_t esz = is_bf16 ? 2 : 4;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = G - g0 < 4 ? G - g0 : 4;
        const float *p0 = probs + g0 * L;
        __m512 a[4][4];
        for (int r = 0; r < 4; ++r)
            for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < L; t0 += BS) {
            const char *blk = v_cache + (size_t)(table[t0 / BS] * KVH + h) * BS * 64 * esz;
            const int64_t n = L - t0 < BS ? L - t0 : BS;
            for (int64_t i = 0; i < n; ++i) {
                const char *vr = blk + (size_t)i * 64 * esz;
                __m512 v[4];
                for (int c = 0; c < 4; ++c) v[c] = load16(vr + (size_t)c * 16 * esz, is_bf16);
                for (int r = 0; r < 4; ++r) {
                    if (r >= gn) break;
                    const __m512 pr = _mm512_set1_ps(p0[r * L + t0 + i]);
                    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(pr, v[c], a[r][c]);
                }
            }
        }
        for (int r = 0; r < gn; ++r)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + r) * 64 + c * 16, a[r][c]);
    }
}

#endif

INLINE void load_row(const void *src, int is_bf16, int64_t i, int64_t D, float *dst) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_f32(s[d]);
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
    for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(src[d]);
}

/* One (token, kv head) pair: G query rows against the L context tokens. */
INLINE void attend(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                   const int64_t *table, void *out, int64_t b, int64_t h, int64_t L, int64_t H,
                   int64_t KVH, int64_t BS, int64_t D, int64_t G, float scale, int64_t window,
                   float softcap, const float *sinks, int is_bf16, float *qf, float *acc,
                   float *row, float *scores, float *blockscores) {
    const size_t esz = is_bf16 ? 2 : 4;
    /* The walk below covers positions [base, base + L) of the sequence, relative to base:
     * the window's first block onwards; the first `skip` of them are before the window. */
    const int64_t first = window > 0 && L > window ? L - window : 0, base = first / BS * BS;
    const int64_t skip = first - base;
    table += base / BS;
    L -= base;
    const char *qrow = (const char *)q + b * q_stride * esz;
    for (int64_t g = 0; g < G; ++g) {
        load_row(qrow, is_bf16, h * G + g, D, qf + g * D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    }
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const char *kb = (const char *)k_cache + (table[t0 / BS] * KVH + h) * BS * D * esz;
        if (t0 + PREFETCH_BLOCKS * BS < L) { /* a block further on: its keys and values */
            const size_t ahead = (size_t)(table[t0 / BS + PREFETCH_BLOCKS] * KVH + h) * BS * D * esz;
            for (int64_t c = 0; c < BS * D * (int64_t)esz; c += 64) {
                __builtin_prefetch((const char *)k_cache + ahead + c);
                __builtin_prefetch((const char *)v_cache + ahead + c);
            }
        }
        const int64_t n = L - t0 < BS ? L - t0 : BS;
#if defined(__AVX512F__)
        if (BS == 16) {
            score_block16(kb, qf, G, D, is_bf16, blockscores);
            for (int64_t g = 0; g < G; ++g)
                memcpy(scores + g * L + t0, blockscores + g * BS, sizeof(float) * n);
            continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g)
            for (int64_t i = 0; i < BS; ++i) blockscores[g * BS + i] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
            load_row(kb, is_bf16, d, BS, row); /* key dimension d of the block's BS keys */
            for (int64_t g = 0; g < G; ++g) {
                const float qd = qf[g * D + d];
                float *bs = blockscores + g * BS;
#pragma omp simd
                for (int64_t i = 0; i < BS; ++i) bs[i] += qd * row[i];
            }
        }
        for (int64_t g = 0; g < G; ++g)
            memcpy(scores + g * L + t0, blockscores + g * BS, sizeof(float) * n);
    }
    for (int64_t g = 0; g < G; ++g) {
        float *sg = scores + g * L, m = sinks ? sinks[h * G + g] : -FLT_MAX, sum = 0.f;
        if (softcap > 0.f) {
            const float inv_cap = 1.f / softcap;
            for (int64_t t = skip; t < L; ++t) sg[t] = softcap * tanhf(sg[t] * inv_cap);
        }
        for (int64_t t = skip; t < L; ++t) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = skip; t < L; ++t) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        if (sinks) sum += expf(sinks[h * G + g] - m);
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < skip; ++t) sg[t] = 0.f;
        for (int64_t t = skip; t < L; ++t) sg[t] *= inv;
    }
#if defined(__AVX512F__)
    if (D == 64) {
        accumulate_values64((const char *)v_cache, table, L, KVH, h, BS, scores, G, is_bf16, acc);
        for (int64_t g = 0; g < G; ++g)
            store_row(out, is_bf16, b * H + h * G + g, D, acc + g * D);
        return;
    }
#endif
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
#define ATTEND_CASE(BLOCK, DIM, BF16)                                                         \
    attend(q, q_stride, k_cache, v_cache, table, out, b, h, L, num_heads, num_kv_heads,      \
           BLOCK, DIM, G, scale, window, softcap, sinks, BF16, qf, acc, row, scores, blockscores)

static int run(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
               const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
               const int64_t *token_len, void *out, int64_t num_tokens, int64_t num_heads,
               int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
               int64_t window, float softcap, const float *sinks, int is_bf16) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_tokens; ++b)
        if (token_len[b] > max_len) max_len = token_len[b];
    int failed = 0;
#pragma omp parallel
    {
        float *qf = malloc(sizeof(float) * G * D), *acc = malloc(sizeof(float) * G * D);
        const int64_t width = D > block_size ? D : block_size;
        float *row = malloc(sizeof(float) * width), *scores = malloc(sizeof(float) * G * max_len);
        float *blockscores = malloc(sizeof(float) * G * block_size);
        if (!qf || !acc || !row || !scores || !blockscores) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 4)
            for (int64_t w = 0; w < num_tokens * num_kv_heads; ++w) {
                const int64_t b = w / num_kv_heads, h = w % num_kv_heads, L = token_len[b];
                const int64_t *table = block_tables + token_seq[b] * table_stride;
                if (block_size == 16 && D == 64 && is_bf16) ATTEND_CASE(16, 64, 1);
                else if (block_size == 16 && D == 64) ATTEND_CASE(16, 64, 0);
                else if (block_size == 16 && D == 128 && is_bf16) ATTEND_CASE(16, 128, 1);
                else if (block_size == 16 && D == 128) ATTEND_CASE(16, 128, 0);
                else if (is_bf16) ATTEND_CASE(block_size, D, 1);
                else ATTEND_CASE(block_size, D, 0);
            }
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
        free(blockscores);
    }
    return failed ? -1 : 0;
}

int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *token_seq, const int64_t *token_len, float *out,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t head_dim, float scale, int64_t window,
                        float softcap, const float *sinks) {
    return run(q, q_stride, k_cache, v_cache, block_tables, table_stride, token_seq, token_len,
               out, num_tokens, num_heads, num_kv_heads, block_size, head_dim, scale, window,
               softcap, sinks, 0);
}

int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *token_seq,
                         const int64_t *token_len, uint16_t *out, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                         int64_t head_dim, float scale, int64_t window, float softcap,
                         const float *sinks) {
    return run(q, q_stride, k_cache, v_cache, block_tables, table_stride, token_seq, token_len,
               out, num_tokens, num_heads, num_kv_heads, block_size, head_dim, scale, window,
               softcap, sinks, 1);
}

/* Store the step's new K and V rows (token t's heads contiguous, tokens src_stride
 * elements apart, e.g. views into the fused qkv output) in their cache slots: V rows whole,
 * K rows spread over the block's dimension-major layout. Only moves values, so one entry
 * serves every dtype: elem_size is 2 (bf16) or 4 (float32). */
int kv_cache_write(const void *k_src, const void *v_src, int64_t src_stride,
                   const int64_t *slot_mapping, void *k_cache, void *v_cache,
                   int64_t num_tokens, int64_t num_kv_heads, int64_t block_size,
                   int64_t head_dim, int64_t elem_size) {
    const char *k = k_src, *v = v_src;
    const size_t esz = (size_t)elem_size, row = (size_t)head_dim * esz;
    if (esz != 2 && esz != 4) return -1;
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t slot = slot_mapping[t], blk = slot / block_size, off = slot % block_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const size_t dst = (size_t)((blk * num_kv_heads + h) * block_size + off) * row;
            const size_t src = (size_t)t * src_stride * esz + (size_t)h * row;
            memcpy((char *)v_cache + dst, v + src, row);
            const size_t kd = (size_t)((blk * num_kv_heads + h) * head_dim * block_size + off);
            if (esz == 2) {
                const uint16_t *ks = (const uint16_t *)(k + src);
                uint16_t *kc = (uint16_t *)k_cache + kd;
                for (int64_t d = 0; d < head_dim; ++d) kc[d * block_size] = ks[d];
            } else {
                const float *ks = (const float *)(k + src);
                float *kc = (float *)k_cache + kd;
                for (int64_t d = 0; d < head_dim; ++d) kc[d * block_size] = ks[d];
            }
        }
    }
    return 0;
}
