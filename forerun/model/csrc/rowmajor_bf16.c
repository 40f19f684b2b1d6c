/* y [m, n] = x [m, k] @ W.T (+ bias) for a bfloat16 weight W [n, k] as it is stored, row
 * after row (a MoE layer's stacked experts, which small_matmul.c would need packed copies
 * of), bfloat16 x, y and bias, float32 sums (moe_block.c's plain bfloat16 body).
 *
 * With AVX512-BF16 each 32 values of a weight row are loaded once for up to four rows of x
 * (one dot-product instruction each), four weight rows at a time, and each (row, column)
 * sum reduced once at the end; elsewhere the same sums in plain C. Split over the threads
 * by weight rows (a caller's parallel region makes that single-threaded: nested regions
 * are inactive).
 *
 * Where the CPU has AMX, the product is taken transposed:
 * y.T = W @ x.T. An AMX tile multiply wants its right-hand operand with value pairs
 * interleaved across 16 columns, which a row-major weight is not, but its left-hand operand
 * is 16 rows of 32 values each, which 16 weight rows as stored already are (a tile load with
 * the row pitch). So x, a few dozen rows, is interleaved once per call, and the weight is
 * read in place: each 32 of its rows once per 32 rows of x. Built and loaded by
 * forerun/model/cpu_kernels.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define WR 4 /* weight rows per pass */
#define XR 4 /* rows of x per pass */
/* Values of each weight row prefetched ahead of the stream, into L2 (16 KiB: experts a few
 * MiB each, one after another: Qwen3-30B-A3B's gate/up and down experts at one row of x
 * 18 -> 27-32 GB/s, at two 15 -> 23, on a 2-core Zen 4; 4 and 8 KiB ahead did less). */
#define RM_AHEAD 8192

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
        for (int j = 0; j < wr; ++j) {
            _mm_prefetch((const char *)(w + j * k + t + RM_AHEAD), _MM_HINT_T1);
            wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * k + t);
        }
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

static volatile int amx_enabled = 1;

int rowmajor_matmul_amx_set(int on) {
    const int prev = amx_enabled;
    amx_enabled = on != 0;
    return prev;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include "amx.h"

/* Even one row: tile loads of 16 weight rows stream from memory faster than the dot-product
 * body's vector loads (Qwen3-30B-A3B's gate/up experts from DRAM, one core: 13.7 against
 * 13.0 GB/s at one row, 13.1 against 10.7 at four; in cache level up to four rows). */
#define AMX_MIN_M 1

/* Rows t0.. of x (16 of them, zeros past m) as k / 32 B tiles: line j of tile kb holds the
 * value pair (32 kb + 2j, 32 kb + 2j + 1) of each of the 16 rows. */
static void pack_rows(const uint16_t *x, int64_t m, int64_t k, int64_t t0, uint32_t *b) {
    const int64_t pairs = k / 2;
    memset(b, 0, sizeof(uint32_t) * (size_t)(16 * pairs));
    for (int64_t t = 0; t < 16 && t0 + t < m; ++t) {
        const uint32_t *row = (const uint32_t *)(x + (t0 + t) * k);
        for (int64_t p = 0; p < pairs; ++p) b[16 * p + t] = row[p];
    }
}

/* A stored accumulator tile c (16 weight rows x 16 rows of x) into y: rows t0.. of x,
 * columns col..col + cols - 1. */
static void store_transposed(const float *c, uint16_t *y, int64_t n, const uint16_t *bias,
                             int64_t m, int64_t t0, int64_t col, int64_t cols) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    const __m512 bv = bias ? bf16x16_widen(_mm256_maskz_loadu_epi16(keep, bias + col))
                           : _mm512_setzero_ps();
    for (int64_t t = 0; t < 16 && t0 + t < m; ++t) {
        const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(down, c + t, 4), bv);
        _mm256_mask_storeu_epi16(y + (t0 + t) * n + col, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The AMX body; -2 where it does not apply, -1 without memory. */
static int rowmajor_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t m, int64_t n, int64_t k) {
    if (!amx_enabled || m < AMX_MIN_M || k % 32 != 0 || !amx_permitted()) return -2;
    const int64_t tiles = (m + 15) / 16, groups = (n + 31) / 32;
    uint32_t *xp = aligned_alloc(64, sizeof(uint32_t) * (size_t)(tiles * 8 * k));
    if (!xp) return -1;
    for (int64_t i = 0; i < tiles; ++i) pack_rows(x, m, k, 16 * i, xp + i * 8 * k);
    int failed = 0;
#pragma omp parallel if (groups > 1 && m * n * k > 65536)
    {
        amx_configure_full();
        float c[4][256] __attribute__((aligned(64)));
        uint16_t *pad = NULL; /* a last group of fewer than 32 weight rows, zero-padded */
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t r0 = 32 * g, left = n - r0;
            const uint16_t *a = w + r0 * k;
            if (left < 32 && left % 16) {
                if (!pad) pad = aligned_alloc(64, sizeof(uint16_t) * (size_t)(32 * k));
                if (!pad) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                memcpy(pad, a, sizeof(uint16_t) * (size_t)(left * k));
                memset(pad + left * k, 0, sizeof(uint16_t) * (size_t)((32 - left) * k));
                a = pad;
            }
            const int rows2 = left > 16;
            const int64_t cols0 = left < 16 ? left : 16, cols1 = left - 16 < 16 ? left - 16 : 16;
            for (int64_t i = 0; i < tiles; i += 2) {
                const uint16_t *b0 = (const uint16_t *)(xp + i * 8 * k);
                const uint16_t *b1 = i + 1 < tiles ? b0 + 16 * k : NULL;
                amx_bf16_pass(a, k, b0, b1, rows2, c);
                store_transposed(c[0], y, n, bias, m, 16 * i, r0, cols0);
                if (b1) store_transposed(c[1], y, n, bias, m, 16 * i + 16, r0, cols0);
                if (rows2) {
                    store_transposed(c[2], y, n, bias, m, 16 * i, r0 + 16, cols1);
                    if (b1) store_transposed(c[3], y, n, bias, m, 16 * i + 16, r0 + 16, cols1);
                }
            }
        }
        free(pad);
        _tile_release();
    }
    free(xp);
    return failed ? -1 : 0;
}
#else
static int rowmajor_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return -2;
}
#endif

int rowmajor_matmul_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t m, int64_t n, int64_t k) {
    const int rc = rowmajor_amx(x, w, bias, y, m, n, k);
    if (rc != -2) return rc;
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
