/* y = x @ W.T for many bfloat16 rows (a prefill, a large batch) against a weight in GGUF
 * tiles (quant_matmul.c's layout: Q4_0, Q4_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K), on AMX.
 *
 * The integer bodies of quant_matmul.c unpack every line of a tile for every few activation
 * rows and run 64 byte products per VNNI instruction; an AMX-BF16 tile multiply runs 8192
 * products. So where the CPU has AMX, each thread takes a panel of 16-row groups, dequantizes
 * it a chunk of k at a time into bfloat16 B tiles (16 lines of 64 bytes per 32 values of k:
 * line j the value pair 2j, 2j + 1 of each of the 16 rows, as small_matmul.c's packed
 * weights), which stay in L2, and runs every 32-row stripe of x against each pair of groups
 * in it, four 16x16 float32 accumulator tiles. The unpacking is thus shared by all rows, and
 * the activations are not quantized: the function computed is x times the weight dequantized
 * to bfloat16 (w = q * s - o per block in float32, rounded to nearest even), summed in
 * float32, which is closer to the exact product than the integer bodies' (their activations
 * rounded to 8 bits).
 *
 * quant_matmul_rows_io takes this path from QAMX_MIN_ROWS rows of bfloat16 x (y bfloat16, or
 * float32 for an output head's logits); quant_matmul_amx_set turns it off (tests of the
 * integer bodies, benchmarks comparing them). Built and loaded by
 * forerun/model/cpu_kernels.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "ktile.h"
#include "qweight.h"

static volatile int amx_enabled = 1;

int quant_matmul_amx_set(int on) {
    const int prev = amx_enabled;
    amx_enabled = on != 0;
    return prev;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#include "amx.h"
#include "fp16.h"
#include "qtile.h"

#define GR 16   /* weight rows per group (tile) */
#define BT 512  /* bfloat16 values of a B tile: 32 of k for 16 rows */

/* B-tile lines 0 and 1 (dst, dst + 32) from 16 lanes (a tile's rows) of 4 values each, the
 * bytes of a lane (signed when sgn): the pairs (0, 1) and (2, 3), as w = q * s - o. */
static inline __attribute__((always_inline)) void put_quad(__m512i v, int sgn, __m512 s,
                                                           __m512 o, uint16_t *dst) {
    __m512i q[4];
    if (sgn) {
        q[0] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
        q[1] = _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24);
        q[2] = _mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24);
        q[3] = _mm512_srai_epi32(v, 24);
    } else {
        const __m512i ff = _mm512_set1_epi32(0xff);
        q[0] = _mm512_and_si512(v, ff);
        q[1] = _mm512_and_si512(_mm512_srli_epi32(v, 8), ff);
        q[2] = _mm512_and_si512(_mm512_srli_epi32(v, 16), ff);
        q[3] = _mm512_srli_epi32(v, 24);
    }
    /* cvtne2ps puts the second operand's 16 values first: interleave them to row pairs. */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    for (int h = 0; h < 2; ++h) {
        const __m512 f0 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q[2 * h]), s, o);
        const __m512 f1 = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q[2 * h + 1]), s, o);
        _mm512_store_si512((__m512i *)(dst + 32 * h),
                           _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
    }
}

static inline __m512i line(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }

static inline __m512 d16(const uint8_t *p) { /* the 16 rows' fp16 scales */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The types dequant_tile below has a body for; the integer bodies of quant_matmul.c take the
 * others (Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, IQ4_XS: no body here was tested on AMX yet). */
static int dequantizes(int64_t type) {
    return type == QT_Q4_0 || type == QT_Q4_1 || type == QT_Q8_0 || type == QT_MXFP4 ||
           type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K;
}

/* One tile (16 rows x block_values(type)) as its B tiles, from b. */
static void dequant_tile(int64_t type, const uint8_t *t, uint16_t *b) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    switch (type) {
    case QT_Q4_0:
    case QT_Q4_1:
    case QT_MXFP4: {
        __m512 s, o;
        if (type == QT_MXFP4) {
            s = e8m0_half16(t);
            o = _mm512_mul_ps(s, _mm512_set1_ps(MXFP4_OFFSET)); /* held as u = level + 12 */
        } else {
            s = d16(t);
            o = type == QT_Q4_0 ? _mm512_mul_ps(s, _mm512_set1_ps(8.f))
                                : _mm512_sub_ps(_mm512_setzero_ps(), d16(t + 32));
        }
        const uint8_t *qs = t + tile_header(type);
        const __m512i mx = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_U));
        for (int j = 0; j < 4; ++j) { /* value i low nibble of byte i, 16 + i the high one */
            const __m512i l = line(qs + 64 * j);
            __m512i lo = _mm512_and_si512(l, low4), hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
            if (type == QT_MXFP4) {
                lo = _mm512_shuffle_epi8(mx, lo);
                hi = _mm512_shuffle_epi8(mx, hi);
            }
            put_quad(lo, 0, s, o, b + 64 * j);
            put_quad(hi, 0, s, o, b + 256 + 64 * j);
        }
        return;
    }
    case QT_Q8_0: {
        const __m512 s = d16(t), o = _mm512_setzero_ps();
        for (int j = 0; j < 8; ++j) put_quad(line(t + tile_header(type) + 64 * j), 1, s, o, b + 64 * j);
        return;
    }
    case QT_Q4_K:
    case QT_Q5_K: {
        const int q5 = type == QT_Q5_K;
        const __m512 d = d16(t), dmin = d16(t + 32);
        __m128i c[12];
        for (int j = 0; j < 12; ++j) c[j] = _mm_loadu_si128((const __m128i *)(t + 64 + 16 * j));
        const __m512i bit = _mm512_set1_epi8(1);
        for (int tp = 0; tp < 4; ++tp) { /* sub-blocks 2tp (low nibbles), 2tp + 1 (high) */
            __m512 s[2], o[2];
            for (int e = 0; e < 2; ++e) {
                __m128i sc, mn;
                kt_scales(c, 2 * tp + e, &sc, &mn);
                s[e] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
                o[e] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
            }
            for (int g = 0; g < 8; ++g) {
                const __m512i l = line(t + KT_QS(q5) + 64 * (8 * tp + g));
                __m512i lo = _mm512_and_si512(l, low4), hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
                if (q5) { /* bit s of qh: value 32s + i's fifth bit */
                    const __m512i qh = line(t + 256 + 64 * g);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srli_epi16(qh, 2 * tp), bit), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srli_epi16(qh, 2 * tp + 1), bit), 4));
                }
                put_quad(lo, 0, s[0], o[0], b + BT * (2 * tp) + 64 * g);
                put_quad(hi, 0, s[1], o[1], b + BT * (2 * tp + 1) + 64 * g);
            }
        }
        return;
    }
    case QT_Q6_K: {
        const __m512 d = d16(t);
        const __m512i three = _mm512_set1_epi8(3);
        for (int f = 0; f < 2; ++f)
            for (int g = 0; g < 4; ++g) { /* values 128f + 32g + l, l < 32: one B tile */
                __m512 s[2], o[2];
                for (int e = 0; e < 2; ++e) {
                    const __m128i sc =
                        _mm_loadu_si128((const __m128i *)(t + 32 + 16 * (8 * f + 2 * g + e)));
                    s[e] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
                    o[e] = _mm512_mul_ps(s[e], _mm512_set1_ps(32.f));
                }
                for (int lq = 0; lq < 8; ++lq) {
                    const __m512i ql = line(t + Q6T_QL + 64 * (16 * f + 8 * (g % 2) + lq));
                    const __m512i qh = line(t + Q6T_QH + 64 * (8 * f + lq));
                    const __m512i nib = _mm512_and_si512(g < 2 ? ql : _mm512_srli_epi16(ql, 4), low4);
                    const __m512i q = _mm512_or_si512(nib, _mm512_slli_epi16(
                        _mm512_and_si512(_mm512_srli_epi16(qh, 2 * g), three), 4));
                    put_quad(q, 0, s[lq / 4], o[lq / 4], b + BT * (4 * f + g) + 64 * lq);
                }
            }
        return;
    }
    }
}

/* A group's k values (its nt tiles) as B tiles. */
static void dequant_group(int64_t type, const uint8_t *tiles, int64_t nt, uint16_t *b) {
    const int64_t tb = GR * block_bytes(type), per = block_values(type) / 32 * BT;
    for (int64_t i = 0; i < nt; ++i) dequant_tile(type, tiles + i * tb, b + i * per);
}

/* Rows r0.. of a 16x16 float32 accumulator tile c (rows ldc apart) into y's columns col..col +
 * cols - 1 (y and bias bfloat16 where y_bf16, else float32). */
static void store_c(const float *c, int64_t ldc, void *y, int y_bf16, int64_t ldy,
                    const void *bias, int64_t m, int64_t r0, int64_t col, int64_t cols) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    __m512 bv = _mm512_setzero_ps();
    if (bias)
        bv = y_bf16 ? bf16x16_widen(_mm256_maskz_loadu_epi16(keep, (const uint16_t *)bias + col))
                    : _mm512_maskz_loadu_ps(keep, (const float *)bias + col);
    for (int64_t t = 0; t < 16 && r0 + t < m; ++t) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + ldc * t), bv);
        if (y_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + t) * ldy + col, keep,
                                     (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + (r0 + t) * ldy + col, keep, v);
    }
}

/* This thread's scratch slot (0: the dequantized tiles, 1: the float32 sums between k
 * chunks), kept between calls and grown to at least bytes. */
static void *thread_scratch(int slot, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (bytes > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (bytes + 63) & ~(size_t)63;
        buf[slot] = aligned_alloc(64, cap[slot]);
        if (!buf[slot]) cap[slot] = 0;
    }
    return buf[slot];
}

/* kcs 32-value steps of the A tiles from x0 (x held as A tiles; x0 + 16 xk its next 16 rows,
 * where rows2) against B tiles from b0 and b1 (b1 NULL: none), into the 16x16 float32 tiles
 * of acc (rows ldc apart: c0 at acc, c1 at acc + 16, c2 and c3 16 rows below), which hold a
 * previous chunk's sums where load, else start from zero. */
static inline void amx_chunk(const uint16_t *x0, int64_t xk, int64_t kcs, const uint16_t *b0,
                             const uint16_t *b1, int rows2, float *acc, int64_t ldc, int load) {
    const uint16_t *x1 = x0 + 16 * xk;
    float *c[4] = {acc, acc + 16, acc + 16 * ldc, acc + 16 * ldc + 16};
    if (load) {
        _tile_loadd(0, c[0], 4 * ldc);
        if (b1) _tile_loadd(1, c[1], 4 * ldc);
        if (rows2) _tile_loadd(2, c[2], 4 * ldc);
        if (rows2 && b1) _tile_loadd(3, c[3], 4 * ldc);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kcs; ++kb) {
        _tile_loadd(4, x0 + kb * 512, 64);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (b1) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rows2) {
            _tile_loadd(5, x1 + kb * 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (b1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 4 * ldc);
    if (b1) _tile_stored(1, c[1], 4 * ldc);
    if (rows2) _tile_stored(2, c[2], 4 * ldc);
    if (rows2 && b1) _tile_stored(3, c[3], 4 * ldc);
}

/* A thread's unit of work is a panel: an even number of 16-row groups (at most PANEL_ROWS
 * rows, fewer where that leaves under 4 panels a thread), dequantized a chunk of k at a time,
 * at most PANEL_BYTES, which stays in L2. Each 32-row stripe of x is run against every group
 * pair of the chunk, so x streams from memory once per panel and chunk instead of once per
 * 32 weight rows (a 2048-row prefill of a 2048-wide weight re-read its 8 MB of x for every
 * pair: 17.1 -> 11.4 ms for 3072 x 2048 on 2 cores); with several chunks the sums wait in a
 * float32 buffer of the panel's width. */
#define PANEL_ROWS 256
#define PANEL_BYTES (1024 << 10)

int quant_matmul_amx(const uint16_t *x, const qweight_t *w, void *y, int y_bf16,
                     const void *bias, int64_t ldy, int64_t m, int64_t k) {
    if (!amx_enabled || m < 1 || k % 32 || w->nparts < 1 || w->nparts > QW_MAXPARTS)
        return -2;
    int64_t groups = 0;
    int all_k = 1;
    for (int64_t p = 0; p < w->nparts; ++p) {
        const int64_t t = w->type[p];
        if (!dequantizes(t) || w->rows[p] < 1 || k % block_values(t)) return -2;
        all_k &= block_values(w->type[p]) == 256;
        groups += (w->rows[p] + GR - 1) / GR;
    }
    /* Below these the integer bodies win: they unpack the K-quants' tiles for every 8 rows,
     * the 32-value types' simpler ones cost less (2048 x 8192 on 2 cores: Q4_K at 16 rows
     * 0.92 against 1.70 ms; Q4_0 at 16 rows 0.87 against 0.86, at 32 1.02 against 1.74). */
    if (m < (all_k ? QAMX_MIN_ROWS : 2 * QAMX_MIN_ROWS) || !amx_permitted()) return -2;
    int64_t pgroups = groups / (4 * omp_get_max_threads()) / 2 * 2;
    if (pgroups > PANEL_ROWS / GR) pgroups = PANEL_ROWS / GR;
    if (pgroups < 2) pgroups = 2;
    /* k per chunk: a whole number of blocks (256 values serve every type) */
    int64_t kc = PANEL_BYTES / ((int64_t)sizeof(uint16_t) * GR * pgroups) / 256 * 256;
    if (kc < 256) kc = 256;
    if (kc > k) kc = k;
    const int64_t nchunks = (k + kc - 1) / kc;
    int64_t first_panel[QW_MAXPARTS + 1], first_row[QW_MAXPARTS], panels = 0, rows = 0;
    for (int64_t p = 0; p < w->nparts; ++p) {
        first_panel[p] = panels;
        first_row[p] = rows;
        panels += ((w->rows[p] + GR - 1) / GR + pgroups - 1) / pgroups;
        rows += w->rows[p];
    }
    first_panel[w->nparts] = panels;
    /* x as its A tiles (rows padded with zeros to whole tiles): contiguous 1 KB tile loads,
     * where rows k values apart put a tile's 16 lines in one L1 set (k = 2048 bfloat16). */
    const int64_t mp = (m + 15) / 16 * 16;
    uint16_t *xp = aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * k));
    if (!xp) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t rb = 0; rb < mp / 16; ++rb)
        for (int64_t r = 0; r < 16; ++r) {
            const int64_t i = 16 * rb + r;
            uint16_t *dst = xp + 16 * rb * k + 32 * r;
            for (int64_t kb = 0; kb < k / 32; ++kb, dst += 512) {
                _mm512_store_si512(dst, i < m ? _mm512_loadu_si512(x + i * k + 32 * kb)
                                              : _mm512_setzero_si512());
            }
        }
    const int64_t ldacc = GR * pgroups;
    int failed = 0;
#pragma omp parallel
    {
        amx_configure_full();
        float c[32 * 32] __attribute__((aligned(64)));
        uint16_t *bt = thread_scratch(0, sizeof(uint16_t) * (size_t)(pgroups * GR * kc));
        float *acc = nchunks > 1 ? thread_scratch(1, sizeof(float) * (size_t)(mp * ldacc)) : c;
        if (!bt || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < panels; ++q) {
            if (!bt || !acc) continue;
            int64_t p = 0;
            while (q >= first_panel[p + 1]) ++p;
            const int64_t type = w->type[p], bv = block_values(type);
            const int64_t gbytes = k / bv * GR * block_bytes(type);
            const int64_t g0 = pgroups * (q - first_panel[p]), r0 = g0 * GR;
            int64_t ng = (w->rows[p] - r0 + GR - 1) / GR;
            if (ng > pgroups) ng = pgroups;
            for (int64_t ci = 0; ci < nchunks; ++ci) {
                const int64_t k0 = ci * kc, kn = k - k0 < kc ? k - k0 : kc;
                const int last = ci == nchunks - 1;
                for (int64_t g = 0; g < ng; ++g)
                    dequant_group(type, w->data[p] + (g0 + g) * gbytes + k0 / bv * GR * block_bytes(type),
                                  kn / bv, bt + g * GR * kn);
                for (int64_t i0 = 0; i0 < mp; i0 += 32) {
                    const int rows2 = i0 + 16 < mp;
                    for (int64_t g = 0; g < ng; g += 2) {
                        const int64_t left = w->rows[p] - r0 - g * GR, two = left > GR;
                        const int64_t col = first_row[p] + r0 + g * GR;
                        float *a = nchunks > 1 ? acc + i0 * ldacc + g * GR : c;
                        const int64_t lda = nchunks > 1 ? ldacc : 32;
                        amx_chunk(xp + i0 * k + k0 / 32 * 512, k, kn / 32, bt + g * GR * kn,
                                  two ? bt + (g + 1) * GR * kn : NULL, rows2, a, lda, ci > 0);
                        if (!last) continue;
                        const int64_t cols0 = left < GR ? left : GR;
                        const int64_t cols1 = left - GR < GR ? left - GR : GR;
                        store_c(a, lda, y, y_bf16, ldy, bias, m, i0, col, cols0);
                        if (two) store_c(a + 16, lda, y, y_bf16, ldy, bias, m, i0, col + GR, cols1);
                        if (rows2) {
                            store_c(a + 16 * lda, lda, y, y_bf16, ldy, bias, m, i0 + 16, col, cols0);
                            if (two)
                                store_c(a + 16 * lda + 16, lda, y, y_bf16, ldy, bias, m, i0 + 16,
                                        col + GR, cols1);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    free(xp);
    return failed ? -1 : 0;
}
#else
int quant_matmul_amx(const uint16_t *x, const qweight_t *w, void *y, int y_bf16,
                     const void *bias, int64_t ldy, int64_t m, int64_t k) {
    (void)x, (void)w, (void)y, (void)y_bf16, (void)bias, (void)ldy, (void)m, (void)k;
    return -2;
}
#endif
