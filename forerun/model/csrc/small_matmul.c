/* y = x @ w.T (+ bias) for a few rows of x: the matmuls of small-batch decode (CPU).
 *
 * At one to a few rows a linear layer is a read of its weight matrix and little else, so the
 * kernel's one job is to stream each weight row from memory once, for all rows of x at
 * once, on every core: four weight rows at a time, dotted with up to four rows of x held in
 * L1, accumulated in float32 (bf16 pairs by AVX512-BF16 dot products where the CPU has them)
 * and rounded to the storage type once. Weights are the plain row-major [n, k] tensors.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define WROWS 4 /* weight rows per block */
#define XROWS 4 /* rows of x per pass over a block */

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- float32 ---------------------------------------------------------------------------- */
static void block_f32(const float *x, int64_t m, const float *w, int64_t rows, int64_t k,
                      float acc[XROWS][WROWS]) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            const float *xi = x + i * k, *wr = w + r * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < k; ++j) s += xi[j] * wr[j];
            acc[i][r] = s;
        }
}

int small_matmul_f32(const float *x, const float *w, const float *bias, float *y, int64_t m,
                     int64_t n, int64_t k) {
    const int64_t nblocks = (n + WROWS - 1) / WROWS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t n0 = b * WROWS, rows = n0 + WROWS <= n ? WROWS : n - n0;
        for (int64_t i0 = 0; i0 < m; i0 += XROWS) {
            const int64_t mi = i0 + XROWS <= m ? XROWS : m - i0;
            float acc[XROWS][WROWS];
            block_f32(x + i0 * k, mi, w + n0 * k, rows, k, acc);
            for (int64_t i = 0; i < mi; ++i)
                for (int64_t r = 0; r < rows; ++r)
                    y[(i0 + i) * n + n0 + r] = acc[i][r] + (bias ? bias[n0 + r] : 0.f);
        }
    }
    return 0;
}

/* ---- bfloat16 --------------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* WROWS weight rows against MI rows of x (a compile-time count, so the accumulators stay
 * in registers), 32 bf16 pairs per instruction. */
INLINE void block_bf16_fixed(const uint16_t *x, const uint16_t *w, int64_t k,
                             float acc[XROWS][WROWS], const int mi) {
    __m512 a[XROWS][WROWS];
    for (int i = 0; i < mi; ++i)
        for (int r = 0; r < WROWS; ++r) a[i][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        __m512i wv[WROWS];
        for (int r = 0; r < WROWS; ++r) wv[r] = _mm512_loadu_si512(w + r * k + j);
        for (int i = 0; i < mi; ++i) {
            const __m512i xv = _mm512_loadu_si512(x + i * k + j);
            for (int r = 0; r < WROWS; ++r)
                a[i][r] = _mm512_dpbf16_ps(a[i][r], (__m512bh)xv, (__m512bh)wv[r]);
        }
    }
    for (int i = 0; i < mi; ++i)
        for (int r = 0; r < WROWS; ++r) acc[i][r] = _mm512_reduce_add_ps(a[i][r]);
}

static void block_bf16(const uint16_t *x, int64_t m, const uint16_t *w, int64_t rows,
                       int64_t k, float acc[XROWS][WROWS]) {
    if (rows == WROWS && k % 32 == 0) {
        switch (m) {
        case 1: block_bf16_fixed(x, w, k, acc, 1); return;
        case 2: block_bf16_fixed(x, w, k, acc, 2); return;
        case 3: block_bf16_fixed(x, w, k, acc, 3); return;
        case 4: block_bf16_fixed(x, w, k, acc, 4); return;
        default: break;
        }
    }
    for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            const uint16_t *xi = x + i * k, *wr = w + r * k;
            __m512 s = _mm512_setzero_ps();
            int64_t j = 0;
            for (; j + 32 <= k; j += 32)
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(xi + j),
                                     (__m512bh)_mm512_loadu_si512(wr + j));
            float t = _mm512_reduce_add_ps(s);
            for (; j < k; ++j) t += bf16_to_f32(xi[j]) * bf16_to_f32(wr[j]);
            acc[i][r] = t;
        }
}
#else
static void block_bf16(const uint16_t *x, int64_t m, const uint16_t *w, int64_t rows,
                       int64_t k, float acc[XROWS][WROWS]) {
    for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            const uint16_t *xi = x + i * k, *wr = w + r * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < k; ++j) s += bf16_to_f32(xi[j]) * bf16_to_f32(wr[j]);
            acc[i][r] = s;
        }
}
#endif

int small_matmul_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                      uint16_t *y, int64_t m, int64_t n, int64_t k) {
    const int64_t nblocks = (n + WROWS - 1) / WROWS;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t n0 = b * WROWS, rows = n0 + WROWS <= n ? WROWS : n - n0;
        for (int64_t i0 = 0; i0 < m; i0 += XROWS) {
            const int64_t mi = i0 + XROWS <= m ? XROWS : m - i0;
            float acc[XROWS][WROWS];
            block_bf16(x + i0 * k, mi, w + n0 * k, rows, k, acc);
            for (int64_t i = 0; i < mi; ++i)
                for (int64_t r = 0; r < rows; ++r)
                    y[(i0 + i) * n + n0 + r] = f32_to_bf16(
                        acc[i][r] + (bias ? bf16_to_f32(bias[n0 + r]) : 0.f));
        }
    }
    return 0;
}
