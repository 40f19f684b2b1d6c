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
 * A quantized cache (kv_cache_dtype int8 / fp8_e4m3 / fp8_e5m2, docs/kv_cache.md "Quantized
 * KV") has the same layout in 1-byte elements and one float32 scale per (block, kv head) for
 * K and one for V: the walk widens each block's bytes to float32 inside the dot products and
 * applies the block's scale to its 16 scores (K) or to the probabilities (V), so no dequantized
 * copy of the context is ever made. The model-dtype cache (kv = KV_NATIVE) compiles to the
 * same code as before quantized caches existed: the kind is a compile-time constant.
 * Built by forerun/model/cpu_kernels.py with the system C compiler; loaded through ctypes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* What a KV cache element is: the query's dtype (float32 / bfloat16), or one byte. */
enum { KV_NATIVE = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

/* The largest finite magnitude of each 1-byte kind: a block's scale maps its |max| there. */
static const float kv_qmax[4] = {0.f, 127.f, 448.f, 57344.f};

/* Every fp8 code's value (e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, never stored here;
 * e5m2: bias 15), filled when the library loads. */
static float fp8_lut[2][256];

__attribute__((constructor)) static void init_fp8_lut(void) {
    for (int b = 0; b < 256; ++b) {
        const float sign = b & 0x80 ? -1.f : 1.f;
        const int e4 = (b >> 3) & 15, m4 = b & 7, e5 = (b >> 2) & 31, m5 = b & 3;
        fp8_lut[0][b] = sign * (e4 ? ldexpf((float)(8 + m4), e4 - 10) : ldexpf((float)m4, -9));
        fp8_lut[1][b] = sign * (e5 ? ldexpf((float)(4 + m5), e5 - 17) : ldexpf((float)m5, -16));
    }
}

INLINE float kv_elem(const void *p, int kv, int is_bf16, int64_t i) {
    switch (kv) {
    case KV_INT8: return (float)((const int8_t *)p)[i];
    case KV_FP8_E4M3: return fp8_lut[0][((const uint8_t *)p)[i]];
    case KV_FP8_E5M2: return fp8_lut[1][((const uint8_t *)p)[i]];
    default: return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
    }
}

/* The fp8 code nearest to |x| (ties to the even code, which is round-to-nearest-even, as
 * torch converts), saturating at the largest finite value: a binary search of the sorted
 * positive codes. */
INLINE uint8_t fp8_encode(float x, int kv) {
    const float *lut = fp8_lut[kv == KV_FP8_E4M3 ? 0 : 1];
    const int top = kv == KV_FP8_E4M3 ? 0x7e : 0x7b;
    const uint8_t sign = x < 0.f ? 0x80 : 0;
    const float a = fabsf(x);
    if (!(a < lut[top])) return sign | (uint8_t)top;
    int lo = 0, hi = top; /* lut[lo] <= a < lut[hi] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (lut[mid] <= a) lo = mid;
        else hi = mid;
    }
    const float dlo = a - lut[lo], dhi = lut[hi] - a;
    const int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1 ? hi : lo);
    return sign | (uint8_t)code;
}

/* x (already divided by its scale) as a 1-byte element of kind kv. */
INLINE uint8_t kv_quantize(float x, int kv) {
    if (kv == KV_INT8) {
        float r = nearbyintf(x);
        r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
        return (uint8_t)(int8_t)r;
    }
    return fp8_encode(x, kv);
}
#ifndef PREFETCH_BLOCKS
/* How far ahead the context walk asks for the next blocks, into L2 (hint 2, prefetcht1): a
 * long context's blocks are scattered pages, which the hardware prefetcher does not follow.
 * Into L1 and two blocks ahead, a 4,096-token walk from memory (head_dim 128, bfloat16) took
 * 1.3x as long. */
#define PREFETCH_BLOCKS 4
#endif
#define PREFETCH_KV(p) __builtin_prefetch((p), 0, 2)

/* Whether the values are walked by accumulate_values below (which asks for its own blocks,
 * span by span) or by the generic loop (whose blocks the score walk asks for). */
#if defined(__AVX512F__)
#define VALUE_WALK_TILED(D) ((D) % 64 == 0)
#else
#define VALUE_WALK_TILED(D) 0
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 consecutive cache values as float32 lanes (1-byte kinds unscaled). An fp8 byte moved
 * into a half's exponent and mantissa bits is a half (subnormals included) of the same value
 * times 2^(15 - bias): exact, one conversion instruction for 16 values. */
INLINE __m512 load16(const char *p, int is_bf16, int kv) {
    if (kv == KV_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    if (kv == KV_FP8_E4M3 || kv == KV_FP8_E5M2) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        if (kv == KV_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
        const __m256i h = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
            _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    }
    if (is_bf16) return bf16x16_load((const uint16_t *)p);
    return _mm512_loadu_ps((const float *)p);
}

/* Scores of one 16-key block for G query rows, the keys stored dimension-major
 * (kb[d * 16 + i]): out[g * ostride + i] = ks * (q_g . key_i) for the block's first n keys,
 * written straight into the context's score rows. Up to eight query rows share each key
 * load (Qwen3-30B-A3B has eight query heads a kv head: at four, every key was widened
 * twice). */
INLINE void score_block16(const char *kb, const float *qf, int64_t G, int64_t D, int is_bf16,
                          int kv, float ks, int64_t n, float *out, int64_t ostride) {
    const size_t esz = kv ? 1 : is_bf16 ? 2 : 4;
    const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t gn = G - g0 < 8 ? G - g0 : 8;
        const float *q0 = qf + g0 * D;
        __m512 a[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            const __m512 k = load16(kb + (size_t)d * 16 * esz, is_bf16, kv);
            for (int r = 0; r < 8; ++r)
                if (r < gn) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q0[r * D + d]), k, a[r]);
        }
        for (int r = 0; r < gn; ++r)
            _mm512_mask_storeu_ps(out + (g0 + r) * ostride, keep,
                                  kv ? _mm512_mul_ps(a[r], _mm512_set1_ps(ks)) : a[r]);
    }
}

#if defined(__AVX512BF16__)
/* score_block16 for bfloat16 queries over a bfloat16 cache, by the bf16 dot-product
 * instruction: each lane multiplies two dimensions of its key at once, products exact and
 * summed in float32, so a block takes half the multiply-add instructions and no widening of
 * the keys. qp holds each query row's dimensions in pairs (unscaled); rows d and d + 1 of
 * the block's keys are one 64-byte load, interleaved key by key. */
INLINE void score_block16_dp(const uint16_t *kb, const uint32_t *qp, int64_t G, int64_t D,
                             float scale, int64_t n, float *out, int64_t ostride) {
    const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    const int64_t half = D / 2;
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t gn = G - g0 < 8 ? G - g0 : 8;
        const uint32_t *q0 = qp + g0 * half;
        __m512 a[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < half; ++j) {
            const __m512bh k = (__m512bh)_mm512_permutexvar_epi16(
                pairs, _mm512_loadu_si512((const void *)(kb + j * 32)));
            for (int r = 0; r < 8; ++r)
                if (r < gn)
                    a[r] = _mm512_dpbf16_ps(
                        a[r], k, (__m512bh)_mm512_set1_epi32((int)q0[r * half + j]));
        }
        for (int r = 0; r < gn; ++r)
            _mm512_mask_storeu_ps(out + (g0 + r) * ostride, keep,
                                  _mm512_mul_ps(a[r], _mm512_set1_ps(scale)));
    }
}
#endif

/* acc[g0 + r][c0 .. c0 + 16 * C) for r < R (rn of them real) += the probability-weighted sum
 * of the values of context positions [s0, s1): R * C = 16 float32 accumulators kept in
 * registers over the walk, so each value vector loaded feeds R multiply-adds. With pf, the
 * walk also asks for the value block PREFETCH_BLOCKS ahead (the first tile of a span: the
 * others find the span in L2). */
INLINE void accumulate_tile(const char *v_cache, const float *v_scale, const int64_t *table,
                            int64_t s0, int64_t s1, int64_t L, int64_t KVH, int64_t h,
                            int64_t BS, int64_t D, const float *p0, int64_t g0, int64_t rn,
                            int64_t c0, int is_bf16, int kv, int pf, float *acc, const int R,
                            const int C) {
    const size_t esz = kv ? 1 : is_bf16 ? 2 : 4;
    __m512 a[8][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            a[r][c] = r < rn ? _mm512_loadu_ps(acc + (g0 + r) * D + c0 + c * 16)
                             : _mm512_setzero_ps();
    for (int64_t t0 = s0; t0 < s1; t0 += BS) {
        const char *blk = v_cache + (size_t)(table[t0 / BS] * KVH + h) * BS * D * esz;
        if (pf && t0 + PREFETCH_BLOCKS * BS < L) {
            const char *ahead =
                v_cache + (size_t)(table[t0 / BS + PREFETCH_BLOCKS] * KVH + h) * BS * D * esz;
            for (int64_t c = 0; c < BS * D * (int64_t)esz; c += 64) PREFETCH_KV(ahead + c);
        }
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        /* a quantized block's V scale rides on the probabilities */
        const float vs = kv ? v_scale[table[t0 / BS] * KVH + h] : 1.f;
        for (int64_t i = 0; i < n; ++i) {
            const char *vr = blk + (size_t)(i * D + c0) * esz;
            __m512 v[4];
            for (int c = 0; c < C; ++c) v[c] = load16(vr + (size_t)c * 16 * esz, is_bf16, kv);
            for (int r = 0; r < R; ++r) {
                if (r >= rn) break;
                const float pv = p0[r * L + t0 + i];
                const __m512 pr = _mm512_set1_ps(kv ? pv * vs : pv);
                for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pr, v[c], a[r][c]);
            }
        }
    }
    for (int r = 0; r < rn; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g0 + r) * D + c0 + c * 16, a[r][c]);
}

/* Context positions a span of the value walk covers: every tile of the query rows and
 * dimensions walks one span before the next, so a long context's values come from memory
 * once (the span, 64 KB at head_dim 128 in bfloat16, stays in L2 for the other tiles). */
#define VALUE_SPAN 256

/* The weighted sum of the values for all G query rows (head_dim a multiple of 64): tiles of
 * eight rows by 32 dimensions where eight rows remain, else four by 64. Kept in memory
 * instead, head_dim 128's eight rows' accumulators were loaded and stored once per context
 * token: half the speed of head_dim 64. */
INLINE void accumulate_values(const char *v_cache, const float *v_scale, const int64_t *table,
                              int64_t L, int64_t KVH, int64_t h, int64_t BS, int64_t D,
                              const float *probs, int64_t G, int is_bf16, int kv, float *acc) {
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    const int64_t span = (VALUE_SPAN + BS - 1) / BS * BS;
    for (int64_t s0 = 0; s0 < L; s0 += span) {
        const int64_t s1 = L - s0 < span ? L : s0 + span;
        int pf = 1;
        for (int64_t g0 = 0; g0 < G;) {
            const int64_t rest = G - g0;
            if (rest >= 8) {
                for (int64_t c0 = 0; c0 < D; c0 += 32, pf = 0)
                    accumulate_tile(v_cache, v_scale, table, s0, s1, L, KVH, h, BS, D,
                                    probs + g0 * L, g0, 8, c0, is_bf16, kv, pf, acc, 8, 2);
                g0 += 8;
            } else {
                const int64_t rn = rest < 4 ? rest : 4;
                for (int64_t c0 = 0; c0 < D; c0 += 64, pf = 0)
                    accumulate_tile(v_cache, v_scale, table, s0, s1, L, KVH, h, BS, D,
                                    probs + g0 * L, g0, rn, c0, is_bf16, kv, pf, acc, 4, 4);
                g0 += rn;
            }
        }
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

/* n cache values from element i * n on, widened to float32 (1-byte kinds unscaled). */
INLINE void load_kv_row(const void *src, int is_bf16, int kv, int64_t i, int64_t n, float *dst) {
    if (kv == KV_NATIVE) {
        load_row(src, is_bf16, i, n, dst);
        return;
    }
    const uint8_t *s = (const uint8_t *)src + i * n;
    int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
    /* fp8 8 at a time through halves (as load16 does), not one table lookup a value: the
     * lookups made an fp8 cache no faster than float32 on an AVX2 CPU */
    if (kv == KV_FP8_E4M3 || kv == KV_FP8_E5M2) {
        for (; d + 8 <= n; d += 8) {
            const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(s + d)));
            if (kv == KV_FP8_E5M2) {
                _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
            } else {
                const __m128i h = _mm_or_si128(
                    _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                    _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
                _mm256_storeu_ps(dst + d,
                                 _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f)));
            }
        }
    }
#endif
    for (; d < n; ++d) dst[d] = kv_elem(s, kv, 0, d);
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
                   const float *k_scale, const float *v_scale, const int64_t *table, void *out,
                   int64_t b, int64_t h, int64_t L, int64_t H, int64_t KVH, int64_t BS,
                   int64_t D, int64_t G, float scale, int64_t window, float softcap,
                   const float *sinks, int is_bf16, int kv, float *qf, float *acc, float *row,
                   float *scores, float *blockscores) {
    /* esz: the query's and output's element size; cesz: the cache's */
    const size_t esz = is_bf16 ? 2 : 4, cesz = kv ? 1 : esz;
    /* The walk below covers positions [base, base + L) of the sequence, relative to base:
     * the window's first block onwards; the first `skip` of them are before the window. */
    const int64_t first = window > 0 && L > window ? L - window : 0, base = first / BS * BS;
    const int64_t skip = first - base;
    table += base / BS;
    L -= base;
    const char *qrow = (const char *)q + b * q_stride * esz;
#if defined(__AVX512BF16__)
    /* bfloat16 queries over a bfloat16 cache: their pairs as they are, for score_block16_dp */
    const int dp = is_bf16 && kv == KV_NATIVE && BS == 16 && D % 2 == 0;
    if (dp) memcpy(qf, (const uint16_t *)qrow + h * G * D, sizeof(uint16_t) * (size_t)(G * D));
    else
#endif
    for (int64_t g = 0; g < G; ++g) {
        load_row(qrow, is_bf16, h * G + g, D, qf + g * D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    }
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const char *kb = (const char *)k_cache + (table[t0 / BS] * KVH + h) * BS * D * cesz;
        if (t0 + PREFETCH_BLOCKS * BS < L) { /* a block further on */
            const size_t ahead = (size_t)(table[t0 / BS + PREFETCH_BLOCKS] * KVH + h) * BS * D * cesz;
            for (int64_t c = 0; c < BS * D * (int64_t)cesz; c += 64) {
                PREFETCH_KV((const char *)k_cache + ahead + c);
                if (!VALUE_WALK_TILED(D)) PREFETCH_KV((const char *)v_cache + ahead + c);
            }
        }
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        /* a quantized block's K scale: applied to its scores once, not to every key */
        const float ks = kv ? k_scale[table[t0 / BS] * KVH + h] : 1.f;
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
        if (dp) {
            score_block16_dp((const uint16_t *)kb, (const uint32_t *)qf, G, D, scale, n,
                             scores + t0, L);
            continue;
        }
#endif
        if (BS == 16) {
            score_block16(kb, qf, G, D, is_bf16, kv, ks, n, scores + t0, L);
            continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g)
            for (int64_t i = 0; i < BS; ++i) blockscores[g * BS + i] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
            load_kv_row(kb, is_bf16, kv, d, BS, row); /* key dimension d of the block's BS keys */
            for (int64_t g = 0; g < G; ++g) {
                const float qd = qf[g * D + d];
                float *bs = blockscores + g * BS;
#pragma omp simd
                for (int64_t i = 0; i < BS; ++i) bs[i] += qd * row[i];
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            if (kv)
                for (int64_t i = 0; i < n; ++i) scores[g * L + t0 + i] = blockscores[g * BS + i] * ks;
            else
                memcpy(scores + g * L + t0, blockscores + g * BS, sizeof(float) * n);
        }
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
    if (VALUE_WALK_TILED(D)) {
        accumulate_values((const char *)v_cache, v_scale, table, L, KVH, h, BS, D, scores, G,
                          is_bf16, kv, acc);
        for (int64_t g = 0; g < G; ++g)
            store_row(out, is_bf16, b * H + h * G + g, D, acc + g * D);
        return;
    }
#endif
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const char *blk = (const char *)v_cache + (table[t0 / BS] * KVH + h) * BS * D * cesz;
        const int64_t n = L - t0 < BS ? L - t0 : BS;
        const float vs = kv ? v_scale[table[t0 / BS] * KVH + h] : 1.f;
        for (int64_t i = 0; i < n; ++i) {
            load_kv_row(blk, is_bf16, kv, i, D, row);
            for (int64_t g = 0; g < G; ++g) {
                const float p = kv ? scores[g * L + t0 + i] * vs : scores[g * L + t0 + i];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) store_row(out, is_bf16, b * H + h * G + g, D, acc + g * D);
}

/* Constant head_dim and dtype let the compiler unroll the row loops completely. */
#define ATTEND_KV(BLOCK, DIM, BF16, KV)                                                      \
    attend(q, q_stride, k_cache, v_cache, k_scale, v_scale, table, out, b, h, L, num_heads,  \
           num_kv_heads, BLOCK, DIM, G, scale, window, softcap, sinks, BF16, KV, qf, acc,    \
           row, scores, blockscores)
#define ATTEND_CASE(BLOCK, DIM, BF16) ATTEND_KV(BLOCK, DIM, BF16, KV_NATIVE)
/* A 1-byte kind: its common shape (block 16, head_dim 64) specialised, the rest generic. */
#define ATTEND_QUANT(KV)                                                                     \
    if (block_size == 16 && D == 64 && is_bf16) ATTEND_KV(16, 64, 1, KV);                    \
    else if (block_size == 16 && D == 64) ATTEND_KV(16, 64, 0, KV);                          \
    else if (is_bf16) ATTEND_KV(block_size, D, 1, KV);                                       \
    else ATTEND_KV(block_size, D, 0, KV)

static int run(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
               const float *k_scale, const float *v_scale, int kv,
               const int64_t *block_tables, int64_t table_stride, const int64_t *token_seq,
               const int64_t *token_len, void *out, int64_t num_tokens, int64_t num_heads,
               int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
               int64_t window, float softcap, const float *sinks, int is_bf16) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_tokens; ++b)
        if (token_len[b] > max_len) max_len = token_len[b];
    int failed = 0;
    /* Chunks of 4 (token, kv head) items keep a long prompt's scheduling cheap; a decode
     * step of a model with 4 kv heads has 4 items in all, which one chunk of 4 gave to one
     * thread while the others waited. */
    const int64_t items = num_tokens * num_kv_heads;
    const int chunk = items >= 16 * omp_get_max_threads() ? 4 : 1;
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
#pragma omp for schedule(dynamic, chunk)
            for (int64_t w = 0; w < items; ++w) {
                const int64_t b = w / num_kv_heads, h = w % num_kv_heads, L = token_len[b];
                const int64_t *table = block_tables + token_seq[b] * table_stride;
                if (kv == KV_INT8) { ATTEND_QUANT(KV_INT8); }
                else if (kv == KV_FP8_E4M3) { ATTEND_QUANT(KV_FP8_E4M3); }
                else if (kv == KV_FP8_E5M2) { ATTEND_QUANT(KV_FP8_E5M2); }
                else if (block_size == 16 && D == 64 && is_bf16) ATTEND_CASE(16, 64, 1);
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
    return run(q, q_stride, k_cache, v_cache, NULL, NULL, KV_NATIVE, block_tables, table_stride,
               token_seq, token_len, out, num_tokens, num_heads, num_kv_heads, block_size,
               head_dim, scale, window, softcap, sinks, 0);
}

int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *token_seq,
                         const int64_t *token_len, uint16_t *out, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                         int64_t head_dim, float scale, int64_t window, float softcap,
                         const float *sinks) {
    return run(q, q_stride, k_cache, v_cache, NULL, NULL, KV_NATIVE, block_tables, table_stride,
               token_seq, token_len, out, num_tokens, num_heads, num_kv_heads, block_size,
               head_dim, scale, window, softcap, sinks, 1);
}

/* The same over a quantized cache (kv: KV_INT8, KV_FP8_E4M3 or KV_FP8_E5M2): 1-byte K and V
 * in the layout above, k_scale / v_scale float32 [num_blocks, kv_heads]. q and out are
 * float32 (is_bf16 0) or bfloat16 (1). */
int paged_attention_kvq(const void *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const float *k_scale, const float *v_scale,
                        int64_t kv, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *token_seq, const int64_t *token_len, void *out,
                        int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t head_dim, float scale, int64_t window,
                        float softcap, const float *sinks, int64_t is_bf16) {
    if (kv < KV_INT8 || kv > KV_FP8_E5M2) return -2;
    return run(q, q_stride, k_cache, v_cache, k_scale, v_scale, (int)kv, block_tables,
               table_stride, token_seq, token_len, out, num_tokens, num_heads, num_kv_heads,
               block_size, head_dim, scale, window, softcap, sinks, is_bf16 ? 1 : 0);
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

/* Store the step's new K and V rows in a quantized cache (kv: KV_INT8, KV_FP8_E4M3 or
 * KV_FP8_E5M2; rows as kv_cache_write takes them, float32 or bfloat16 by src_is_bf16), one
 * scale per (block, kv head) in k_scale / v_scale [num_blocks, kv_heads].
 *
 * A block fills over many steps, so its scale is chosen as it goes (docs/kv_cache.md): the
 * step's tokens that land in one block (adjacent in the batch: one sequence's) are a run; a
 * run that starts the block (offset 0) sets the scale to the run's |max| / qmax, a later run
 * keeps it unless one of its values is larger, and then the block's stored values are first
 * re-quantized to the grown scale (a rare event after a block's first few tokens). fp8
 * scales are powers of two (a float format's relative precision does not depend on where
 * its top lands), so that re-quantization only shifts exponents: exact. One
 * thread per (kv head, K or V): each owns its scales, and takes its runs in batch order. */
int kv_cache_write_kvq(const void *k_src, const void *v_src, int64_t src_stride,
                       const int64_t *slot_mapping, void *k_cache, void *v_cache,
                       float *k_scale, float *v_scale, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t block_size, int64_t head_dim, int64_t src_is_bf16, int64_t kv) {
    if (kv < KV_INT8 || kv > KV_FP8_E5M2) return -2;
    const int kind = (int)kv, bf16 = src_is_bf16 ? 1 : 0;
    const float qmax = kv_qmax[kind];
    const int64_t KVH = num_kv_heads, BS = block_size, D = head_dim;
    const size_t esz = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t task = 0; task < 2 * KVH; ++task) {
        const int is_v = (int)(task / KVH);
        const int64_t h = task % KVH;
        const char *src = is_v ? v_src : k_src;
        uint8_t *cache = is_v ? v_cache : k_cache;
        float *scales = is_v ? v_scale : k_scale;
        for (int64_t t = 0; t < num_tokens;) {
            const int64_t blk = slot_mapping[t] / BS;
            int64_t u = t, first = BS;
            float amax = 0.f;
            for (; u < num_tokens && slot_mapping[u] / BS == blk; ++u) {
                const char *row = src + ((size_t)u * src_stride + (size_t)h * D) * esz;
                for (int64_t d = 0; d < D; ++d) {
                    const float a = fabsf(kv_elem(row, KV_NATIVE, bf16, d));
                    amax = a > amax ? a : amax;
                }
                const int64_t off = slot_mapping[u] % BS;
                first = off < first ? off : first;
            }
            uint8_t *run = cache + (size_t)(blk * KVH + h) * BS * D; /* the (block, head) */
            const float old = first == 0 ? 0.f : scales[blk * KVH + h];
            float need = amax / qmax;
            if (kind != KV_INT8 && need > 0.f) { /* fp8: the power of two at or above it */
                int e;
                if (frexpf(need, &e) != 0.5f) need = ldexpf(1.f, e);
            }
            const float s = need > old ? need : old;
            if (old > 0.f && s > old) { /* grown: the stored values to the new scale */
                const float r = old / s;
                for (int64_t i = 0; i < BS * D; ++i)
                    run[i] = kv_quantize(kv_elem(run, kind, 0, i) * r, kind);
            }
            scales[blk * KVH + h] = s;
            const float inv = s > 0.f ? 1.f / s : 0.f;
            for (int64_t w = t; w < u; ++w) {
                const char *row = src + ((size_t)w * src_stride + (size_t)h * D) * esz;
                const int64_t off = slot_mapping[w] % BS;
                for (int64_t d = 0; d < D; ++d) {
                    const uint8_t q = kv_quantize(kv_elem(row, KV_NATIVE, bf16, d) * inv, kind);
                    /* V rows whole; K dimension-major inside the block */
                    run[is_v ? off * D + d : d * BS + off] = q;
                }
            }
            t = u;
        }
    }
    return 0;
}
