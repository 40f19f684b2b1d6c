/* y = x @ w.T (+ bias) for a few rows of x: the matmuls of small-batch decode (CPU); in
 * bfloat16 without AMX also those of larger steps (packed_linear.py's TileLinear).
 *
 * At one to a few rows a linear layer is a read of its weight matrix and little else, so the
 * kernel's one job is to stream each weight from memory once, for all rows of x at once,
 * on every core, accumulating in float32 and rounding to the storage type once. float32
 * reads the plain row-major [n, k] weight, four rows at a time against up to four rows of x;
 * bfloat16 reads a copy packed for AVX512-BF16 dot products (below), which from 8 rows on
 * is also the layout AMX tile multiplies read, where the CPU has them (further below).
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))
#define WROWS 6 /* weight rows per block: two tiles of 3 */
#define XROWS 4 /* rows of x per pass over a block */

/* ---- float32 ---------------------------------------------------------------------------- */
#if defined(__AVX2__) && defined(__FMA__)
INLINE float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* MI rows of x against RI weight rows, their MI * RI sums in registers (MI, RI constants
 * per instance): each 8 floats of a weight row are loaded once for all MI rows, each 8 of
 * a row of x once for all RI weight rows. A dot product per (row, weight row) instead
 * loaded both for every product: at 8 rows of x that ran at 4 GB/s of weight on 2 cores,
 * where the matrix streams at 15-35. Three weight rows (12 sums, 3 weight vectors and one
 * of x: the 16 AVX2 registers) rather than two: 1.05-1.2x at 1-8 rows of x on a 2-core
 * AVX2 CPU, the same sums in the same order. */
INLINE void tile_f32(const float *x, const float *w, int64_t k, const int mi, const int ri,
                     float acc[XROWS][WROWS], int r0) {
    __m256 a[XROWS][3];
    for (int i = 0; i < mi; ++i)
        for (int r = 0; r < ri; ++r) a[i][r] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        __m256 wv[3];
        for (int r = 0; r < ri; ++r) wv[r] = _mm256_loadu_ps(w + r * k + j);
        for (int i = 0; i < mi; ++i) {
            const __m256 xv = _mm256_loadu_ps(x + i * k + j);
            for (int r = 0; r < ri; ++r) a[i][r] = _mm256_fmadd_ps(xv, wv[r], a[i][r]);
        }
    }
    for (int i = 0; i < mi; ++i)
        for (int r = 0; r < ri; ++r) {
            float s = hsum8(a[i][r]);
            for (int64_t t = j; t < k; ++t) s += x[i * k + t] * w[r * k + t];
            acc[i][r0 + r] = s;
        }
}

static void block_f32(const float *x, int64_t m, const float *w, int64_t rows, int64_t k,
                      float acc[XROWS][WROWS]) {
    for (int r0 = 0; r0 < rows; r0 += 3) {
        const int ri = rows - r0 >= 3 ? 3 : (int)(rows - r0);
        const float *wr = w + r0 * k;
#define TILE(MI, RI) tile_f32(x, wr, k, MI, RI, acc, r0)
        switch (m * 3 + ri - 1) { /* (m, ri) as one constant */
        case 3: TILE(1, 1); break;
        case 4: TILE(1, 2); break;
        case 5: TILE(1, 3); break;
        case 6: TILE(2, 1); break;
        case 7: TILE(2, 2); break;
        case 8: TILE(2, 3); break;
        case 9: TILE(3, 1); break;
        case 10: TILE(3, 2); break;
        case 11: TILE(3, 3); break;
        case 12: TILE(4, 1); break;
        case 13: TILE(4, 2); break;
        default: TILE(4, 3); break;
        }
#undef TILE
    }
}
#else
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
#endif

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

/* ---- many rows without AMX ----------------------------------------------------------------
 * Past MAXM rows the loop above is bound by its chains and its loads (one broadcast of x per
 * dot product of one block). A GEMM tile instead holds TR rows x three blocks (48 columns)
 * of accumulators in registers, 24 of the 32 zmm: each line triple then feeds 3 * TR dot
 * products for three weight loads and TR broadcasts. x is first copied into row tiles of
 * column pairs ([tile][k/2][TR] pairs), so that a tile's broadcasts are one sequential
 * stream rather than TR strided ones. The weight is taken in chunks of KC lines, so a chunk
 * of a block triple (48 KiB) stays near the core while every row tile passes over it; the
 * accumulators go to a float buffer between chunks. On a 2-core AVX512-BF16 CPU this runs
 * at 0.89-0.97 of the dot-product unit's peak on a 1B model's linears at 32-512 rows, level
 * with oneDNN's GEMM (benchmarks/gemm_bf16.py; the previous 12 x 32 tile on unpacked rows:
 * 0.62-0.91). */
#define TR 8
#define TB 3 /* blocks per tile */
#define KC 256

INLINE void tile3(const int32_t *xp, const uint16_t *w, int64_t wstride, int64_t j0, int64_t j1,
                  float *out, int first, const int mi, const int nb) {
    __m512 a0[TR], a1[TR], a2[TR];
    for (int i = 0; i < mi; ++i) {
        a0[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * TB * NB);
        if (nb > 1) a1[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * TB * NB + NB);
        if (nb > 2)
            a2[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + i * TB * NB + 2 * NB);
    }
    for (int64_t j = j0; j < j1; ++j) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + j * 2 * NB);
        const __m512bh b1 =
            nb > 1 ? (__m512bh)_mm512_loadu_si512(w + wstride + j * 2 * NB) : b0;
        const __m512bh b2 =
            nb > 2 ? (__m512bh)_mm512_loadu_si512(w + 2 * wstride + j * 2 * NB) : b0;
        for (int i = 0; i < mi; ++i) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[j * TR + i]);
            a0[i] = _mm512_dpbf16_ps(a0[i], xb, b0);
            if (nb > 1) a1[i] = _mm512_dpbf16_ps(a1[i], xb, b1);
            if (nb > 2) a2[i] = _mm512_dpbf16_ps(a2[i], xb, b2);
        }
    }
    for (int i = 0; i < mi; ++i) {
        _mm512_storeu_ps(out + i * TB * NB, a0[i]);
        if (nb > 1) _mm512_storeu_ps(out + i * TB * NB + NB, a1[i]);
        if (nb > 2) _mm512_storeu_ps(out + i * TB * NB + 2 * NB, a2[i]);
    }
}

#define TILE_CASE(r)                                                                          \
    case r:                                                                                   \
        if (nb == 3) tile3(xt, w, wstride, j0, j1, oi, first, r, 3);                          \
        else if (nb == 2) tile3(xt, w, wstride, j0, j1, oi, first, r, 2);                     \
        else tile3(xt, w, wstride, j0, j1, oi, first, r, 1);                                  \
        break;

/* out [m][TB * NB] = the packed x (m rows) against nb <= TB consecutive blocks from w. */
static void group_bf16(const int32_t *xp, int64_t m, int64_t k, const uint16_t *w, int nb,
                       float *out) {
    const int64_t kp = k / 2, wstride = k * NB;
    for (int64_t j0 = 0; j0 < kp; j0 += KC) {
        const int64_t j1 = j0 + KC < kp ? j0 + KC : kp;
        const int first = j0 == 0;
        for (int64_t i = 0; i < m; i += TR) {
            const int32_t *xt = xp + i * kp; /* tile i / TR: kp lines of TR pairs */
            float *oi = out + i * TB * NB;
            switch (m - i >= TR ? TR : m - i) {
                TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
                TILE_CASE(7) default: TILE_CASE(8)
            }
        }
    }
}

/* x [m, k] as row tiles of column pairs: tile t holds rows t*TR.. as [k/2][TR] pairs (rows
 * past m left unset: no tile reads them). */
static void pack_rows(const uint16_t *x, int64_t m, int64_t k, int32_t *xp) {
    const int64_t kp = k / 2, ntiles = (m + TR - 1) / TR;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t r0 = t * TR, mi = m - r0 < TR ? m - r0 : TR;
        int32_t *dst = xp + r0 * kp;
        for (int64_t i = 0; i < mi; ++i) {
            const uint16_t *row = x + (r0 + i) * k;
            for (int64_t j = 0; j < kp; ++j) memcpy(dst + j * TR + i, row + 2 * j, 4);
        }
    }
}
#define HAS_TILES 1
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

/* out's rows are ld floats apart. */
static void store_block_ld(uint16_t *y, const float *out, int64_t ld, const uint16_t *bias,
                           int64_t m, int64_t n, int64_t n0) {
    const int64_t cols = n0 + NB <= n ? NB : n - n0;
#if defined(__AVX512F__)
    if (cols == NB) { /* a full block: 16 lanes at a time (many-row steps store m * n) */
        const __m512 b = bias ? bf16x16_load(bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < m; ++i) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + i * ld), b);
            _mm_storeu_si128((__m128i *)(y + i * n + n0), f32x8_to_bf16(_mm512_castps512_ps256(v)));
            _mm_storeu_si128((__m128i *)(y + i * n + n0 + 8),
                             f32x8_to_bf16(_mm512_extractf32x8_ps(v, 1)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < cols; ++c)
            y[i * n + n0 + c] =
                f32_to_bf16(out[i * ld + c] + (bias ? bf16_to_f32(bias[n0 + c]) : 0.f));
}

static void store_block(uint16_t *y, const float *out, const uint16_t *bias, int64_t m, int64_t n,
                        int64_t n0) {
    store_block_ld(y, out, NB, bias, m, n, n0);
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

/* ---- bfloat16 on AMX tiles ----------------------------------------------------------------
 * Past MAXM rows of x the loop above passes over each weight block once per MAXM rows, and a
 * batch of 32 reads every weight four times. The same packed weight is already what an AMX
 * tile multiply takes as its right-hand side: one 32-wide slice of k of a 16-column block is
 * 16 lines of 64 bytes, a whole B tile, one sequential KiB. So with AMX each block pair is
 * read once for up to 32 rows (four 16x16 float32 accumulator tiles), and once per further
 * 32 rows out of L1. Rows of x are padded to a multiple of 16 with zeros. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The packed weight streams from memory as the B tiles: prefetched two tiles (2 KiB) ahead,
 * 16-64 rows read it ~10% faster (8192 x 2048 weights from DRAM in huge pages, 2 cores:
 * 32 rows 24.5-25.2 -> 27.1-27.6 GB/s; 4 or 8 tiles ahead gained nothing). */
#define AMX_PF 2
#include "amx.h"

/* Let every AMX body of the library run (on != 0, where the CPU has AMX) or none, as on a
 * CPU without it; returns the previous setting. */
int cpu_amx_set(int on) {
    const int prev = !forerun_amx_off;
    forerun_amx_off = on == 0;
    return prev;
}

/* Fewer rows: the loop above reads each weight once and is faster (1-4 rows: 5.5 against
 * 6.4-6.8 ms for SmolLM2's layer weights on a 2-core CPU; 8 rows: 9.5 against 7.3). */
#define AMX_MIN_M 8

/* A stored 16x16 accumulator tile is store_block's [rows][NB] buffer: into rows r0.. of y. */
INLINE void store_tile(uint16_t *y, const float *c, const uint16_t *bias, int64_t m, int64_t n,
                       int64_t r0, int64_t n0) {
    store_block(y + r0 * n, c, bias, m - r0 < 16 ? m - r0 : 16, n, n0);
}

static void amx_pair(const uint16_t *xp, int64_t mp, int64_t k, const uint16_t *w0,
                     const uint16_t *w1, const uint16_t *bias, uint16_t *y, int64_t m, int64_t n,
                     int64_t n0, float c[4][256]) {
    for (int64_t i0 = 0; i0 < mp; i0 += 32) {
        const int rows2 = i0 + 16 < mp;
        amx_bf16_pass(xp + i0 * k, k, w0, w1, rows2, c);
        store_tile(y, c[0], bias, m, n, i0, n0);
        if (w1) store_tile(y, c[1], bias, m, n, i0, n0 + 16);
        if (rows2) {
            store_tile(y, c[2], bias, m, n, i0 + 16, n0);
            if (w1) store_tile(y, c[3], bias, m, n, i0 + 16, n0 + 16);
        }
    }
}

/* As small_matmul_bf16, on AMX tiles; k a multiple of 32. Returns -2 where AMX cannot run. */
int small_matmul_amx_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                          uint16_t *y, int64_t m, int64_t n, int64_t k) {
    if (k % 32 != 0 || m < 1 || !amx_permitted()) return -2;
    const int64_t mp = (m + 15) / 16 * 16, nblocks = (n + NB - 1) / NB;
    uint16_t *xp = (uint16_t *)x;
    if (mp != m) {
        xp = aligned_alloc(64, (size_t)(mp * k) * sizeof(uint16_t));
        if (!xp) return -1;
        memcpy(xp, x, (size_t)(m * k) * sizeof(uint16_t));
        memset(xp + m * k, 0, (size_t)((mp - m) * k) * sizeof(uint16_t));
    }
#pragma omp parallel
    {
        amx_configure_full();
        float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (nblocks + 1) / 2; ++p) {
            const int64_t b = 2 * p;
            const uint16_t *w0 = w_packed + b * k * NB;
            amx_pair(xp, mp, k, w0, b + 1 < nblocks ? w0 + k * NB : NULL, bias, y, m, n, b * NB,
                     c);
        }
        _tile_release();
    }
    if (xp != x) free(xp);
    return 0;
}
#else
int cpu_amx_set(int on) { /* no AMX bodies built */
    (void)on;
    return 0;
}

#define AMX_MIN_M INT64_MAX
int small_matmul_amx_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                          uint16_t *y, int64_t m, int64_t n, int64_t k) {
    (void)x, (void)w_packed, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return -2;
}
#endif

/* y [m, n] = x [m, k] @ w.T (+ bias), w packed as above; k even. */
int small_matmul_bf16(const uint16_t *x, const uint16_t *w_packed, const uint16_t *bias,
                      uint16_t *y, int64_t m, int64_t n, int64_t k) {
    if (k % 2 != 0) return -1;
    if (m >= AMX_MIN_M && small_matmul_amx_bf16(x, w_packed, bias, y, m, n, k) == 0) return 0;
    const int64_t nblocks = (n + NB - 1) / NB;
    int failed = 0;
#if defined(HAS_TILES)
    if (m > MAXM) { /* past one pass of the loop above (1.4x it at 32 rows, one core) */
        const int64_t kp = k / 2, ngroups = (nblocks + TB - 1) / TB, mt = (m + TR - 1) / TR * TR;
        /* aligned_alloc wants a multiple of the alignment */
        int32_t *xp = aligned_alloc(64, (sizeof(int32_t) * (size_t)(mt * kp) + 63) & ~(size_t)63);
        if (!xp) return -1;
#pragma omp parallel
        {
            pack_rows(x, m, k, xp); /* ends in the for's barrier */
            float *out = aligned_alloc(64, sizeof(float) * (size_t)(mt * TB * NB));
            if (!out) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t g = 0; g < ngroups; ++g) {
                if (!out) continue;
                const int64_t b0 = g * TB;
                const int nb = nblocks - b0 < TB ? (int)(nblocks - b0) : TB;
                group_bf16(xp, m, k, w_packed + b0 * k * NB, nb, out);
                for (int b = 0; b < nb; ++b)
                    store_block_ld(y, out + b * NB, TB * NB, bias, m, n, (b0 + b) * NB);
            }
            free(out);
        }
        free(xp);
        return failed ? -1 : 0;
    }
#endif
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
