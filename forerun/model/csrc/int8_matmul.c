/* y = (xq @ Wq.T) * sx[:, None] * sw[None, :] (+ bias): the matmul of quantization="int8"
 * (CPU), for int8 weights per output channel and int8 activations per row.
 *
 * Why not torch._int_mm everywhere: oneDNN's int8 GEMM is fast where the CPU has VNNI or
 * AMX and the batch is large, but on a CPU without them (AVX2 only) and at decode's few
 * rows it runs far below the rate the int8 weights stream at (measured on an AVX2-only
 * 2-core CPU, 8192 x 2048 at one row: 25 ms, against 3.2 ms for the float32 F.linear that
 * reads four times the bytes).
 *
 * The products are exact: each activation row is widened to int16 once per call, each weight
 * byte once per pass, and pairs of int16 products are summed into int32 lanes (madd), which
 * cannot overflow for |q| <= 127 and k < 2^16 (127 * 127 * 2 * k / 2 < 2^31). The maddubs
 * form (uint8 x int8 into saturating int16) would not be exact for signed activations. So
 * every body returns the integer sums torch._int_mm returns, and the rescale after it is
 * quant_matmul.c's int8_dequant either way.
 *
 * Work: output columns in blocks of 4 weight rows, activation rows in blocks of up to 4, so
 * that each widened weight vector feeds up to 4 rows and each activation vector 4 weight
 * rows (16 accumulators with AVX-512, 16 of the 16 ymm registers' worth of sums with AVX2
 * held as 4 x 4). Columns are split across OpenMP threads.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MB 4 /* activation rows per pass over a block of weight rows */
#define NB 4 /* weight rows per block */

/* The instruction set the body below was built for: 2 AVX-512BW, 1 AVX2, 0 plain C. */
int int8_matmul_isa(void) {
#if defined(__AVX512BW__) && defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
#define VW 32 /* int16 lanes per vector */
typedef __m512i vec;
static inline vec vzero(void) { return _mm512_setzero_si512(); }
static inline vec widen(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec load16(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vec madd_add(vec acc, vec a, vec b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
static inline int32_t hsum(vec v) { return _mm512_reduce_add_epi32(v); }
#elif defined(__AVX2__)
#define VW 16
typedef __m256i vec;
static inline vec vzero(void) { return _mm256_setzero_si256(); }
static inline vec widen(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vec load16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vec madd_add(vec acc, vec a, vec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
static inline int32_t hsum(vec v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* acc[r][c] = sum_t x16[r][t] * w[c][t] for MR rows of x16 (int16, stride k) and NB weight
 * rows (int8, stride k). MR is a constant in each copy, so the MR x NB sums stay in
 * registers. */
#ifdef VW
#define DEFINE_DOT_BLOCK(MR)                                                                  \
    static void dot_block_##MR(const int16_t *x16, const int8_t *w, int64_t k,              \
                               int32_t acc[MB][NB]) {                                       \
        vec s[MR][NB];                                                                      \
        for (int r = 0; r < MR; ++r)                                                        \
            for (int c = 0; c < NB; ++c) s[r][c] = vzero();                                 \
        int64_t t = 0;                                                                      \
        for (; t + VW <= k; t += VW) {                                                      \
            const vec w0 = widen(w + t), w1 = widen(w + k + t);                             \
            const vec w2 = widen(w + 2 * k + t), w3 = widen(w + 3 * k + t);                 \
            for (int r = 0; r < MR; ++r) {                                                  \
                const vec xv = load16(x16 + r * k + t);                                     \
                s[r][0] = madd_add(s[r][0], xv, w0);                                        \
                s[r][1] = madd_add(s[r][1], xv, w1);                                        \
                s[r][2] = madd_add(s[r][2], xv, w2);                                        \
                s[r][3] = madd_add(s[r][3], xv, w3);                                        \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < MR; ++r)                                                        \
            for (int c = 0; c < NB; ++c) acc[r][c] = hsum(s[r][c]);                         \
        for (; t < k; ++t)                                                                  \
            for (int r = 0; r < MR; ++r)                                                    \
                for (int c = 0; c < NB; ++c)                                                \
                    acc[r][c] += (int32_t)x16[r * k + t] * (int32_t)w[c * k + t];           \
    }
DEFINE_DOT_BLOCK(1)
DEFINE_DOT_BLOCK(2)
DEFINE_DOT_BLOCK(3)
DEFINE_DOT_BLOCK(4)
#endif

/* Any mr <= MB rows and nc <= NB weight rows: the vector copies for whole blocks, plain C
 * for a last block of fewer than NB weight rows (and everywhere without vectors). */
static void dot_block(const int16_t *x16, const int8_t *w, int64_t k, int mr, int nc,
                      int32_t acc[MB][NB]) {
#ifdef VW
    if (nc == NB) {
        switch (mr) {
        case 1: dot_block_1(x16, w, k, acc); return;
        case 2: dot_block_2(x16, w, k, acc); return;
        case 3: dot_block_3(x16, w, k, acc); return;
        default: dot_block_4(x16, w, k, acc); return;
        }
    }
#endif
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nc; ++c) {
            int32_t sum = 0;
            for (int64_t t = 0; t < k; ++t) sum += (int32_t)x16[r * k + t] * (int32_t)w[c * k + t];
            acc[r][c] = sum;
        }
}

/* ---- AVX512-VNNI ---------------------------------------------------------------------------
 * vpdpbusd multiplies unsigned by signed bytes and sums each 4 products into an int32 lane
 * (no saturation: the vpdpbusds form saturates), 64 weight bytes per instruction against
 * the madd body's widen + madd + add per 32. The activations are made unsigned as xu = x + 128
 * (x ^ 0x80 as a byte; |x| <= 127, so 1..255), which adds 128 * sum(w[c]) to row c's sum: the
 * caller's wsum, each weight row's sum, precomputed at load, takes it off again. The sums
 * stay exact: |lane| <= 255 * 127 * k / 16 < 2^31 for k < 2^16. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_VNNI 1
/* Bytes of each weight row prefetched ahead of the stream, into L2: prefetched into L1 the
 * four rows' lines evicted each other's (a 1B model's int8 linears at one row streamed at
 * 21 GB/s, into L2 at 27-28 GB/s, any distance from 8 to 64 KiB, on a 2-core Zen 4). */
#define I8_AHEAD 16384
#define DEFINE_VNNI_BLOCK(MR)                                                                 \
    static void vnni_block_##MR(const uint8_t *xu, const int8_t *w, int64_t k,              \
                                int32_t acc[MB][NB]) {                                      \
        __m512i s[MR][NB];                                                                  \
        for (int r = 0; r < MR; ++r)                                                        \
            for (int c = 0; c < NB; ++c) s[r][c] = _mm512_setzero_si512();                  \
        int64_t t = 0;                                                                      \
        for (; t + 64 <= k; t += 64) {                                                      \
            __m512i wv[NB];                                                                 \
            for (int c = 0; c < NB; ++c) {                                                  \
                _mm_prefetch((const char *)(w + c * k + t + I8_AHEAD), _MM_HINT_T1);        \
                wv[c] = _mm512_loadu_si512(w + c * k + t);                                  \
            }                                                                               \
            for (int r = 0; r < MR; ++r) {                                                  \
                const __m512i xv = _mm512_loadu_si512(xu + r * k + t);                      \
                for (int c = 0; c < NB; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], xv, wv[c]); \
            }                                                                               \
        }                                                                                   \
        if (t < k) { /* zeros past the row's end on both sides: products of 0 */            \
            const __mmask64 mask = (__mmask64)(~0ULL >> (64 - (k - t)));                    \
            __m512i wv[NB];                                                                 \
            for (int c = 0; c < NB; ++c) wv[c] = _mm512_maskz_loadu_epi8(mask, w + c * k + t); \
            for (int r = 0; r < MR; ++r) {                                                  \
                const __m512i xv = _mm512_maskz_loadu_epi8(mask, xu + r * k + t);           \
                for (int c = 0; c < NB; ++c) s[r][c] = _mm512_dpbusd_epi32(s[r][c], xv, wv[c]); \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < MR; ++r)                                                        \
            for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_reduce_add_epi32(s[r][c]);      \
    }
DEFINE_VNNI_BLOCK(1)
DEFINE_VNNI_BLOCK(2)
DEFINE_VNNI_BLOCK(3)
DEFINE_VNNI_BLOCK(4)

static void vnni_block(const uint8_t *xu, const int8_t *w, int64_t k, int mr,
                       int32_t acc[MB][NB]) {
    switch (mr) {
    case 1: vnni_block_1(xu, w, k, acc); return;
    case 2: vnni_block_2(xu, w, k, acc); return;
    case 3: vnni_block_3(xu, w, k, acc); return;
    default: vnni_block_4(xu, w, k, acc); return;
    }
}
#endif

/* The sums of both entries below: with wsum (only where HAVE_VNNI), whole blocks on the VNNI
 * body over xu = x + 128 and a last partial block of weight rows on signed bytes as they are;
 * without it, dot_block over x widened to int16. */
static int int8_sums(const int8_t *xq, const int8_t *wq, const int32_t *wsum, int32_t *out,
                     int64_t m, int64_t n, int64_t k) {
    const int vnni = wsum != NULL;
    void *xp = malloc((size_t)(m * k) * (vnni ? 1 : sizeof(int16_t)));
    if (!xp) return -1;
    for (int64_t i = 0; i < m * k; ++i) {
        if (vnni)
            ((uint8_t *)xp)[i] = (uint8_t)xq[i] ^ 0x80u;
        else
            ((int16_t *)xp)[i] = xq[i];
    }
    const int64_t nblocks = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) if (n * k > 65536)
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t c0 = b * NB;
        const int nc = (int)(n - c0 < NB ? n - c0 : NB);
        for (int64_t r0 = 0; r0 < m; r0 += MB) {
            const int mr = (int)(m - r0 < MB ? m - r0 : MB);
            int32_t acc[MB][NB];
            if (!vnni) {
                dot_block((const int16_t *)xp + r0 * k, wq + c0 * k, k, mr, nc, acc);
            } else if (nc == NB) {
#ifdef HAVE_VNNI
                vnni_block((const uint8_t *)xp + r0 * k, wq + c0 * k, k, mr, acc);
                for (int r = 0; r < mr; ++r)
                    for (int c = 0; c < NB; ++c) acc[r][c] -= 128 * wsum[c0 + c];
#endif
            } else {
                for (int r = 0; r < mr; ++r)
                    for (int c = 0; c < nc; ++c) {
                        int32_t sum = 0;
                        for (int64_t t = 0; t < k; ++t)
                            sum += (int32_t)xq[(r0 + r) * k + t] * (int32_t)wq[(c0 + c) * k + t];
                        acc[r][c] = sum;
                    }
            }
            for (int r = 0; r < mr; ++r)
                for (int c = 0; c < nc; ++c) out[(r0 + r) * n + c0 + c] = acc[r][c];
        }
    }
    free(xp);
    return 0;
}

/* Integer sums acc [m, n] of xq [m, k] against wq [n, k] on AVX512-VNNI, given wsum [n] (each
 * weight row's sum); the same sums as int8_matmul_acc. -2 where this build has no VNNI body
 * (nothing is done), -1 if scratch cannot be had. */
int int8_matmul_acc_vnni(const int8_t *xq, const int8_t *wq, const int32_t *wsum, int32_t *out,
                         int64_t m, int64_t n, int64_t k) {
#ifdef HAVE_VNNI
    return int8_sums(xq, wq, wsum, out, m, n, k);
#else
    (void)xq, (void)wq, (void)wsum, (void)out, (void)m, (void)n, (void)k;
    return -2;
#endif
}

/* Integer sums acc [m, n] of xq [m, k] against wq [n, k]; -1 if scratch cannot be had. */
int int8_matmul_acc(const int8_t *xq, const int8_t *wq, int32_t *out, int64_t m, int64_t n,
                    int64_t k) {
    return int8_sums(xq, wq, NULL, out, m, n, k);
}
