/* y = x @ w.T (+ bias) for a few rows of x: the matmuls of small-batch decode (CPU).
 *
 * At one to a few rows a linear layer is a read of its weight matrix and little else, so the
 * kernel's one job is to stream each weight from memory once, for all rows of x at once,
 * on every core, accumulating in float32 and rounding to the storage type once. float32
 * reads the plain row-major [n, k] weight, four rows at a time against up to four rows of x;
 * bfloat16 reads a copy packed for AVX512-BF16 dot products (below).
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))
#define WROWS 4 /* weight rows per block */
#define XROWS 4 /* rows of x per pass over a block */

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

/* ---- bfloat16, dot-product layout --------------------------------------------------------
 * The weight is packed once (forerun/model/cpu_kernels.py: pack_small_matmul_weight) as
 * [ceil(n/16)][k/2][16][2]: for each block of 16 output columns, k/2 lines of 64 bytes, line
 * j holding the column pairs (2j, 2j+1) of its 16 rows. One AVX512-BF16 instruction then
 * adds a line's 32 products for one row of x (its pair broadcast) into 16 outputs: no
 * horizontal sums, one load per 64 bytes of weight whatever the number of rows, and each
 * block's lines are one sequential stream. */
#define NB 16    /* output columns per block */
#define MAXM 8   /* rows of x per pass over a block */
#define AHEAD 256 /* lines (of 64 bytes, so 16 KiB) prefetched ahead of the stream */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* mi rows of x against one block, with u accumulators per row over consecutive lines (so
 * that a row's chain of dependent dot products does not bound a small mi); mi * u <= 8 and
 * both compile-time constants, so the accumulators stay in registers. */
INLINE void vnni_block(const uint16_t *x, int64_t k, const uint16_t *wb, int64_t kp, float *out,
                       const int mi, const int u) {
    __m512 acc[MAXM];
    for (int a = 0; a < mi * u; ++a) acc[a] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + u <= kp; j += u) {
        for (int v = 0; v < u; ++v) {
            _mm_prefetch((const char *)(wb + (j + v + AHEAD) * 2 * NB), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(wb + (j + v) * 2 * NB);
            for (int i = 0; i < mi; ++i) {
                int32_t pair;
                memcpy(&pair, x + i * k + 2 * (j + v), sizeof pair);
                acc[i * u + v] = _mm512_dpbf16_ps(acc[i * u + v],
                                                  (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
            }
        }
    }
    for (; j < kp; ++j) {
        const __m512i w = _mm512_loadu_si512(wb + j * 2 * NB);
        for (int i = 0; i < mi; ++i) {
            int32_t pair;
            memcpy(&pair, x + i * k + 2 * j, sizeof pair);
            acc[i * u] = _mm512_dpbf16_ps(acc[i * u], (__m512bh)_mm512_set1_epi32(pair),
                                          (__m512bh)w);
        }
    }
    for (int i = 0; i < mi; ++i) {
        __m512 t = acc[i * u];
        for (int v = 1; v < u; ++v) t = _mm512_add_ps(t, acc[i * u + v]);
        _mm512_storeu_ps(out + i * NB, t);
    }
}

static void block_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wb, float *out) {
    const int64_t kp = k / 2;
    for (int64_t i = 0; i < m;) {
        const int64_t left = m - i;
        const uint16_t *xi = x + i * k;
        float *oi = out + i * NB;
        switch (left >= MAXM ? MAXM : left) {
        case 1: vnni_block(xi, k, wb, kp, oi, 1, 4); break;
        case 2: vnni_block(xi, k, wb, kp, oi, 2, 4); break;
        case 3: vnni_block(xi, k, wb, kp, oi, 3, 2); break;
        case 4: vnni_block(xi, k, wb, kp, oi, 4, 2); break;
        case 5: vnni_block(xi, k, wb, kp, oi, 5, 1); break;
        case 6: vnni_block(xi, k, wb, kp, oi, 6, 1); break;
        case 7: vnni_block(xi, k, wb, kp, oi, 7, 1); break;
        default: vnni_block(xi, k, wb, kp, oi, 8, 1); break;
        }
        i += left >= MAXM ? MAXM : left;
    }
}
#else
static void block_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wb, float *out) {
    const int64_t kp = k / 2;
    for (int64_t i = 0; i < m; ++i)
        for (int c = 0; c < NB; ++c) {
            float s = 0.f;
            for (int64_t j = 0; j < kp; ++j)
                s += bf16_to_f32(x[i * k + 2 * j]) * bf16_to_f32(wb[(j * NB + c) * 2]) +
                     bf16_to_f32(x[i * k + 2 * j + 1]) * bf16_to_f32(wb[(j * NB + c) * 2 + 1]);
            out[i * NB + c] = s;
        }
}
#endif

static void store_block(uint16_t *y, const float *out, const uint16_t *bias, int64_t m, int64_t n,
                        int64_t n0) {
    const int64_t cols = n0 + NB <= n ? NB : n - n0;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < cols; ++c)
            y[i * n + n0 + c] =
                f32_to_bf16(out[i * NB + c] + (bias ? bf16_to_f32(bias[n0 + c]) : 0.f));
}

/* 1 where the bf16 kernel has its AVX512-BF16 body; elsewhere its scalar fallback is slower
 * than a matmul library, and the small-batch path stays off in bf16. */
int small_matmul_bf16_is_fast(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] @ w.T (+ bias), w packed as above; k even. */
int small_matmul_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                      uint16_t *y, int64_t m, int64_t n, int64_t k) {
    if (k % 2 != 0) return -1;
    const int64_t nblocks = (n + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel
    {
        float *out = malloc(sizeof(float) * (size_t)(m * NB));
        if (!out) {
#pragma omp atomic write
            failed = 1;
        }
        {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; ++b) {
                if (!out) continue;
                block_bf16(x, m, k, w_packed + b * k * NB, out);
                store_block(y, out, bias, m, n, b * NB);
            }
        }
        free(out);
    }
    return failed ? -1 : 0;
}
