/* y [m, n] = x [m, k] @ W.T (+ bias) for a bfloat16 weight W [n, k] as it is stored, row
 * after row (a MoE layer's stacked experts, which small_matmul.c would need packed copies
 * of), bfloat16 x, y and bias, float32 sums; for the few rows an expert gets in a decode or
 * batch step (moe_block.c's plain bfloat16 body).
 *
 * With AVX512-BF16 each 32 values of a weight row are loaded once for up to four rows of x
 * (one dot-product instruction each), four weight rows at a time, and each (row, column)
 * sum reduced once at the end; elsewhere the same sums in plain C. Split over the threads
 * by weight rows (a caller's parallel region makes that single-threaded: nested regions
 * are inactive). Built and loaded by forerun/model/cpu_kernels.py. */
#include <stdint.h>

#include "bf16.h"

#define WR 4 /* weight rows per pass */
#define XR 4 /* rows of x per pass */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* xr rows of x against wr weight rows; masked loads past k read zeros on both sides. */
static inline __attribute__((always_inline)) void rows_block(const uint16_t *x, int64_t k,
                                                             const uint16_t *w, const int xr,
                                                             const int wr, float out[XR][WR]) {
    __m512 acc[XR][WR];
    for (int i = 0; i < xr; ++i)
        for (int j = 0; j < wr; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t += 32) {
        const __mmask32 mask = k - t >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (k - t)) - 1);
        __m512bh wv[WR];
        for (int j = 0; j < wr; ++j)
            wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k + t);
        for (int i = 0; i < xr; ++i) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + t);
            for (int j = 0; j < wr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < xr; ++i)
        for (int j = 0; j < wr; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static void block(const uint16_t *x, int64_t k, const uint16_t *w, int xr, int wr,
                  float out[XR][WR]) {
#define RB(A, B) rows_block(x, k, w, A, B, out)
    if (wr == WR) {
        switch (xr) {
        case 1: RB(1, WR); return;
        case 2: RB(2, WR); return;
        case 3: RB(3, WR); return;
        default: RB(XR, WR); return;
        }
    }
    switch (xr) { /* a last partial group of weight rows */
    case 1: RB(1, 1); break;
    case 2: RB(2, 1); break;
    case 3: RB(3, 1); break;
    default: RB(XR, 1); break;
    }
    for (int j = 1; j < wr; ++j) {
        float one[XR][WR];
        rows_block(x, k, w + j * k, xr, 1, one);
        for (int i = 0; i < xr; ++i) out[i][j] = one[i][0];
    }
#undef RB
}
#else
static void block(const uint16_t *x, int64_t k, const uint16_t *w, int xr, int wr,
                  float out[XR][WR]) {
    for (int i = 0; i < xr; ++i)
        for (int j = 0; j < wr; ++j) {
            float s = 0.f;
            for (int64_t t = 0; t < k; ++t) s += bf16_to_f32(x[i * k + t]) * bf16_to_f32(w[j * k + t]);
            out[i][j] = s;
        }
}
#endif

int rowmajor_matmul_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = (n + WR - 1) / WR;
#pragma omp parallel for schedule(static) if (m * n * k > 65536)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * WR;
        const int wr = (int)(n - c0 < WR ? n - c0 : WR);
        for (int64_t i0 = 0; i0 < m; i0 += XR) {
            const int xr = (int)(m - i0 < XR ? m - i0 : XR);
            float out[XR][WR];
            block(x + i0 * k, k, w + c0 * k, xr, wr, out);
            for (int i = 0; i < xr; ++i)
                for (int j = 0; j < wr; ++j)
                    y[(i0 + i) * n + c0 + j] =
                        f32_to_bf16(out[i][j] + (bias ? bf16_to_f32(bias[c0 + j]) : 0.f));
        }
    }
    return 0;
}
