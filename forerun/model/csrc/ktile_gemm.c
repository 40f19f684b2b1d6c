/* Q4_K, Q5_K and Q6_K tiles against many activation rows (a prefill, a large batch) in the
 * AVX2 build without VNNI: a group's tiles are first expanded to one byte per value (the
 * 4-6 bit value with its high bits merged, 0..31 or 0..63) and their scales to the forms
 * the body multiplies by, once per call; the rows then run against the bytes, four at a
 * time, with no unpacking. quant_matmul.c's group bodies unpack every line for every four
 * activation rows, which on this instruction set costs about what the byte products cost.
 * The function computed is the same as theirs: the same integer sums, the same float terms
 * in the same order (equal results but where -ffast-math contracts an instance differently).
 *
 * Expanded layouts, per super-block of a group (16 rows x 256 values); a line is 64 bytes,
 * 4 consecutive values of each of the 16 rows (row r at bytes 4r..4r+3), as in the tiles:
 *   Q4_K / Q5_K: lines [sub-block s 8][g 8] (values 32s + 4g..4g+3), then d*sc and dmin*mn
 *                as [s 8][16 rows] floats;
 *   Q6_K:        lines [block j 8][g 8] (values 32j + 4g..4g+3), then the 16 int8 scales
 *                per row as int32 lanes holding the int16 pair (s, s) ([c 16][16 rows]), the
 *                same as floats, then d as 16 floats.
 * Built and loaded by forerun/model/cpu_kernels.py. */
#include "ktile.h"

#ifdef KTILE_EXPANDED
#include <immintrin.h>
#include <string.h>

#include "fp16.h"

#define XL 4096 /* bytes of a super-block's expanded lines */
#define XK_BYTES (XL + 2 * 8 * 16 * 4)
#define X6_SCP XL
#define X6_SCF (XL + 16 * 64)
#define X6_D (XL + 2 * 16 * 64)
#define X6_BYTES (X6_D + 16 * 4)
#define QK 32

enum { QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14 }; /* ggml's type ids */

/* See quant_matmul.c's KEEP_IN_REG: without it GCC sums a sub-block's products as a tree and
 * spills them. */
#define KEEP_IN_REG(v) __asm__("" : "+x"(v))

int64_t ktile_expanded_bytes(int64_t type, int64_t nsb) {
    return nsb * (type == QT_Q6_K ? X6_BYTES : XK_BYTES);
}

static void expand_kt(int q5, const uint8_t *t, uint8_t *x) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), bit = _mm256_set1_epi8(1);
    for (int tp = 0; tp < 4; ++tp)
        for (int g = 0; g < 8; ++g)
            for (int h = 0; h < 2; ++h) {
                const __m256i l =
                    _mm256_loadu_si256((const __m256i *)(t + KT_QS(q5) + 64 * (8 * tp + g) + 32 * h));
                __m256i u0 = _mm256_and_si256(l, low4);
                __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
                if (q5) { /* bits 2tp and 2tp + 1 of qh: the fifth bits */
                    const __m256i qh =
                        _mm256_loadu_si256((const __m256i *)(t + 256 + 64 * g + 32 * h));
                    u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(qh, 2 * tp), bit), 4));
                    u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(qh, 2 * tp + 1), bit), 4));
                }
                _mm256_storeu_si256((__m256i *)(x + 64 * (8 * (2 * tp) + g) + 32 * h), u0);
                _mm256_storeu_si256((__m256i *)(x + 64 * (8 * (2 * tp + 1) + g) + 32 * h), u1);
            }
    float *dsc = (float *)(x + XL), *dmn = dsc + 8 * 16;
    const uint8_t *c = t + 64; /* 12 scale lines: byte c of every row */
    for (int r = 0; r < 16; ++r) {
        const float d = fp16_to_f32(t + 2 * r), dmin = fp16_to_f32(t + 32 + 2 * r);
        for (int s = 0; s < 8; ++s) {
            const int sc = s < 4 ? c[16 * s + r] & 63
                                 : (c[16 * (s + 4) + r] & 0x0f) | ((c[16 * (s - 4) + r] >> 6) << 4);
            const int mn = s < 4 ? c[16 * (s + 4) + r] & 63
                                 : (c[16 * (s + 4) + r] >> 4) | ((c[16 * s + r] >> 6) << 4);
            dsc[16 * s + r] = d * (float)sc;
            dmn[16 * s + r] = dmin * (float)mn;
        }
    }
}

static void expand_q6k(const uint8_t *t, uint8_t *x) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
    for (int j = 0; j < 8; ++j) {
        const int f = j / 4, q = j % 4;
        for (int g = 0; g < 8; ++g)
            for (int h = 0; h < 2; ++h) {
                const __m256i l = _mm256_loadu_si256(
                    (const __m256i *)(t + Q6T_QL + 64 * (16 * f + 8 * (q % 2) + g) + 32 * h));
                const __m256i qh =
                    _mm256_loadu_si256((const __m256i *)(t + Q6T_QH + 64 * (8 * f + g) + 32 * h));
                const __m256i lo = q / 2 ? _mm256_and_si256(_mm256_srli_epi16(l, 4), low4)
                                         : _mm256_and_si256(l, low4);
                const __m256i hb = q == 0   ? _mm256_slli_epi16(qh, 4)
                                   : q == 1 ? _mm256_slli_epi16(qh, 2)
                                   : q == 2 ? qh
                                            : _mm256_srli_epi16(qh, 2);
                _mm256_storeu_si256((__m256i *)(x + 64 * (8 * j + g) + 32 * h),
                                    _mm256_or_si256(lo, _mm256_and_si256(hb, hi2)));
            }
    }
    uint32_t *scp = (uint32_t *)(x + X6_SCP);
    float *scf = (float *)(x + X6_SCF), *d = (float *)(x + X6_D);
    for (int cc = 0; cc < 16; ++cc)
        for (int r = 0; r < 16; ++r) {
            const int8_t s = (int8_t)t[32 + 16 * cc + r];
            const uint32_t s16 = (uint16_t)(int16_t)s;
            scp[16 * cc + r] = s16 | (s16 << 16);
            scf[16 * cc + r] = (float)s;
        }
    for (int r = 0; r < 16; ++r) d[r] = fp16_to_f32(t + 2 * r);
}

void ktile_expand(int64_t type, const uint8_t *tiles, int64_t nsb, uint8_t *x) {
    for (int64_t b = 0; b < nsb; ++b) {
        if (type == QT_Q6_K)
            expand_q6k(tiles + b * Q6T_BYTES, x + b * X6_BYTES);
        else
            expand_kt(type == QT_Q5_K, tiles + b * KT_BYTES(type == QT_Q5_K), x + b * XK_BYTES);
    }
}

static inline __m256i bcast4(const int8_t *a) { /* 4 activation bytes in every lane */
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Q4_K / Q5_K: half h of the rows (8 lanes) against m activation rows. Per sub-block the 8
 * lines' byte products are summed in int16 (Q5_K: widened after 4 lines, as 8 of its sums
 * could pass 32767) and widened once; then d sc s and dmin mn (s sum) as quant_matmul.c. */
static inline __attribute__((always_inline)) void rows_kt_m(
    const int q5, const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa,
    const float *ssa, int64_t k, const int m, const int h, float out[][16]) {
    const int64_t nb = k / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int i = 0; i < m; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * XK_BYTES;
        const float *dsc = (const float *)(xb + XL), *dmn = dsc + 8 * 16;
        for (int s = 0; s < 8; ++s) {
            __m256i sum[4], dot[4];
            for (int i = 0; i < m; ++i) sum[i] = dot[i] = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(xb + 64 * (8 * s + g) + 32 * h));
                for (int i = 0; i < m; ++i) {
                    sum[i] = _mm256_add_epi16(
                        sum[i], _mm256_maddubs_epi16(u, bcast4(qa + i * k + b * 256 + 32 * s + 4 * g)));
                    KEEP_IN_REG(sum[i]);
                }
                if (g == 7 || (q5 && g == 3))
                    for (int i = 0; i < m; ++i) {
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(sum[i], ones));
                        sum[i] = _mm256_setzero_si256();
                    }
            }
            const int64_t j = b * 8 + s; /* activation block */
            const __m256 vsc = _mm256_loadu_ps(dsc + 16 * s + 8 * h);
            const __m256 vmn = _mm256_loadu_ps(dmn + 16 * s + 8 * h);
            for (int i = 0; i < m; ++i) {
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                         _mm256_mul_ps(vsc, _mm256_set1_ps(sa[i * nb + j])), acc[i]);
                acc[i] = _mm256_fnmadd_ps(vmn, _mm256_set1_ps(ssa[i * nb + j]), acc[i]);
            }
        }
    }
    for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
}

/* Q6_K: half h of the rows against m activation rows. Per 16 values (two lines, one scale)
 * the products are summed in int16 and weighted by the scale in the madd that widens them;
 * per block of 32 one float FMA (d s); the offset 32 taken back from the activations' sums
 * per 16 at the end, as quant_matmul.c. */
static inline __attribute__((always_inline)) void rows_q6k_m(
    const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa, const float *ss16,
    int64_t k, const int m, const int h, float out[][16]) {
    const int64_t nb = k / QK;
    __m256 acc[4], fix[4];
    for (int i = 0; i < m; ++i) acc[i] = fix[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * X6_BYTES;
        const __m256 d = _mm256_loadu_ps((const float *)(xb + X6_D) + 8 * h);
        __m256 corr[4];
        for (int i = 0; i < m; ++i) corr[i] = _mm256_setzero_ps();
        for (int c = 0; c < 16; ++c) {
            const __m256 scf = _mm256_loadu_ps((const float *)(xb + X6_SCF) + 16 * c + 8 * h);
            for (int i = 0; i < m; ++i)
                corr[i] = _mm256_fmadd_ps(scf, _mm256_set1_ps(ss16[2 * i * nb + 16 * b + c]),
                                          corr[i]);
        }
        for (int i = 0; i < m; ++i) fix[i] = _mm256_fmadd_ps(corr[i], d, fix[i]);
        for (int j = 0; j < 8; ++j) {
            __m256i dot[4];
            for (int i = 0; i < m; ++i) dot[i] = _mm256_setzero_si256();
            for (int gg = 0; gg < 4; ++gg) {
                const __m256i sc =
                    _mm256_loadu_si256((const __m256i *)(xb + X6_SCP + 64 * (2 * j + gg / 2) + 32 * h));
                const __m256i u0 =
                    _mm256_loadu_si256((const __m256i *)(xb + 64 * (8 * j + 2 * gg) + 32 * h));
                const __m256i u1 =
                    _mm256_loadu_si256((const __m256i *)(xb + 64 * (8 * j + 2 * gg + 1) + 32 * h));
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * j + 8 * gg;
                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast4(a)),
                                                         _mm256_maddubs_epi16(u1, bcast4(a + 4)));
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(s16, sc));
                    KEEP_IN_REG(dot[i]);
                }
            }
            for (int i = 0; i < m; ++i)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                         _mm256_mul_ps(d, _mm256_set1_ps(sa[i * nb + b * 8 + j])),
                                         acc[i]);
        }
    }
    for (int i = 0; i < m; ++i)
        _mm256_storeu_ps(out[i] + 8 * h, _mm256_fnmadd_ps(fix[i], _mm256_set1_ps(32.f), acc[i]));
}

void ktile_expanded_rows(int64_t type, const uint8_t *x, int64_t nsb, const int8_t *qa,
                         const float *sa, const float *ssa, const float *ss16, int64_t k,
                         int64_t m, float out[][16]) {
#define ROWS(M)                                                                                 \
    for (int h = 0; h < 2; ++h) {                                                               \
        if (type == QT_Q6_K) rows_q6k_m(x, nsb, qa, sa, ss16, k, M, h, out);                    \
        else if (type == QT_Q5_K) rows_kt_m(1, x, nsb, qa, sa, ssa, k, M, h, out);              \
        else rows_kt_m(0, x, nsb, qa, sa, ssa, k, M, h, out);                                   \
    }
    switch (m) {
    case 1: ROWS(1); return;
    case 2: ROWS(2); return;
    case 3: ROWS(3); return;
    default: ROWS(4); return;
    }
#undef ROWS
}
#endif
