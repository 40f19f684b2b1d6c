/* y = x @ W.T for many bfloat16 rows (a prefill, a large batch) against a weight in GGUF
 * tiles (quant_matmul.c's layout: Q4_0, Q4_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K), on AMX.
 *
 * The integer bodies of quant_matmul.c unpack every line of a tile for every few activation
 * rows and run 64 byte products per VNNI instruction; an AMX-BF16 tile multiply runs 8192
 * products. So where the CPU has AMX, each thread takes two groups of 16 weight rows at a
 * time, dequantizes their whole k range once into bfloat16 B tiles (16 lines of 64 bytes per
 * 32 values of k: line j the value pair 2j, 2j+1 of each of the 16 rows, as small_matmul.c's
 * packed weights), which stay in L2 (64 k bytes), and runs every activation row against them
 * 32 at a time, four 16x16 float32 accumulator tiles. The unpacking is thus shared by all
 * rows, and the activations are not quantized: the function computed is x times the weight
 * dequantized to bfloat16 (w = q * s - o per block in float32, rounded to nearest even),
 * summed in float32, which is closer to the exact product than the integer bodies' (their
 * activations rounded to 8 bits).
 *
 * quant_matmul_rows_io takes this path from QAMX_MIN_ROWS rows of bfloat16 x and y;
 * quant_matmul_amx_set turns it off (tests of the integer bodies, benchmarks comparing
 * them). Built and loaded by forerun/model/cpu_kernels.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Rows r0.. of a stored 16x16 accumulator tile c into y's columns col..col + cols - 1. */
static void store_c(const float *c, uint16_t *y, int64_t ldy, const uint16_t *bias, int64_t m,
                    int64_t r0, int64_t col, int64_t cols) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias ? bf16x16_widen(_mm256_maskz_loadu_epi16(keep, bias + col))
                           : _mm512_setzero_ps();
    for (int64_t t = 0; t < 16 && r0 + t < m; ++t) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * t), bv);
        _mm256_mask_storeu_epi16(y + (r0 + t) * ldy + col, keep,
                                 (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Every row of xp (mp of them, a multiple of 16) against one or two groups' B tiles. */
static void amx_groups(const uint16_t *xp, int64_t mp, int64_t k, const uint16_t *b0,
                       const uint16_t *b1, uint16_t *y, int64_t ldy, const uint16_t *bias,
                       int64_t m, int64_t col, int64_t cols0, int64_t cols1, float c[4][256]) {
    for (int64_t i0 = 0; i0 < mp; i0 += 32) {
        const int rows2 = i0 + 16 < mp;
        amx_bf16_pass(xp + i0 * k, k, b0, b1, rows2, c);
        store_c(c[0], y, ldy, bias, m, i0, col, cols0);
        if (b1) store_c(c[1], y, ldy, bias, m, i0, col + GR, cols1);
        if (rows2) {
            store_c(c[2], y, ldy, bias, m, i0 + 16, col, cols0);
            if (b1) store_c(c[3], y, ldy, bias, m, i0 + 16, col + GR, cols1);
        }
    }
}

static uint16_t *group_scratch(size_t values) {
    static __thread uint16_t *buf = NULL;
    static __thread size_t cap = 0;
    if (values > cap) {
        free(buf);
        cap = values;
        buf = aligned_alloc(64, sizeof(uint16_t) * cap);
        if (!buf) cap = 0;
    }
    return buf;
}

int quant_matmul_amx(const uint16_t *x, const qweight_t *w, uint16_t *y, const uint16_t *bias,
                     int64_t ldy, int64_t m, int64_t k) {
    if (!amx_enabled || m < 1 || k % 32 || w->nparts < 1 || w->nparts > QW_MAXPARTS)
        return -2;
    int64_t first_pair[QW_MAXPARTS + 1], first_row[QW_MAXPARTS], pairs = 0, rows = 0;
    int all_k = 1;
    for (int64_t p = 0; p < w->nparts; ++p) {
        if (!block_bytes(w->type[p]) || w->rows[p] < 1 || k % block_values(w->type[p])) return -2;
        all_k &= block_values(w->type[p]) == 256;
        first_pair[p] = pairs;
        first_row[p] = rows;
        pairs += ((w->rows[p] + GR - 1) / GR + 1) / 2;
        rows += w->rows[p];
    }
    first_pair[w->nparts] = pairs;
    /* Below these the integer bodies win: they unpack the K-quants' tiles for every 8 rows,
     * the 32-value types' simpler ones cost less (2048 x 8192 on 2 cores: Q4_K at 16 rows
     * 0.92 against 1.70 ms; Q4_0 at 16 rows 0.87 against 0.86, at 32 1.02 against 1.74). */
    if (m < (all_k ? QAMX_MIN_ROWS : 2 * QAMX_MIN_ROWS) || !amx_permitted()) return -2;
    const int64_t mp = (m + 15) / 16 * 16;
    uint16_t *xp = (uint16_t *)x;
    if (mp != m) { /* rows padded with zeros to whole tiles */
        xp = aligned_alloc(64, sizeof(uint16_t) * (size_t)(mp * k));
        if (!xp) return -1;
        memcpy(xp, x, sizeof(uint16_t) * (size_t)(m * k));
        memset(xp + m * k, 0, sizeof(uint16_t) * (size_t)((mp - m) * k));
    }
    int failed = 0;
#pragma omp parallel
    {
        amx_configure_full();
        float c[4][256] __attribute__((aligned(64)));
        uint16_t *bt = group_scratch((size_t)(2 * GR * k));
        if (!bt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t q = 0; q < pairs; ++q) {
            if (!bt) continue;
            int64_t p = 0;
            while (q >= first_pair[p + 1]) ++p;
            const int64_t type = w->type[p], nt = k / block_values(type);
            const int64_t g0 = 2 * (q - first_pair[p]), r0 = g0 * GR;
            const int64_t left = w->rows[p] - r0, two = left > GR;
            const uint8_t *tiles = w->data[p] + g0 * nt * GR * block_bytes(type);
            dequant_group(type, tiles, nt, bt);
            if (two) dequant_group(type, tiles + nt * GR * block_bytes(type), nt, bt + GR * k);
            amx_groups(xp, mp, k, bt, two ? bt + GR * k : NULL, y, ldy, bias, m,
                       first_row[p] + r0, left < GR ? left : GR,
                       two ? (left - GR < GR ? left - GR : GR) : 0, c);
        }
        _tile_release();
    }
    if (xp != x) free(xp);
    return failed ? -1 : 0;
}
#else
int quant_matmul_amx(const uint16_t *x, const qweight_t *w, uint16_t *y, const uint16_t *bias,
                     int64_t ldy, int64_t m, int64_t k) {
    (void)x, (void)w, (void)y, (void)bias, (void)ldy, (void)m, (void)k;
    return -2;
}
#endif
