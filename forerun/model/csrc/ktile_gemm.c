/* Q4_K, Q5_K and Q6_K tiles against many activation rows (a prefill, a large batch) in the
 * AVX2 build without VNNI and in the AVX512-VNNI build: a group's tiles are first expanded to
 * one byte per value (the 4-5 bit value with its high bits merged, 0..31; Q6_K's q - 32,
 * -32..31) and their scales to the forms the body multiplies by, once per call chunk; the
 * rows then run against the bytes with no unpacking (AVX2: three or four rows at a time,
 * 512-bit: eight). quant_matmul.c's group bodies unpack every line once per pass of rows,
 * which on AVX2 costs about what the byte products cost, and with AVX512-VNNI 3 (Q4_K) to 11
 * (Q5_K) instructions against a line's 16 byte products at 8 rows. The function computed is
 * theirs: Q4_K/Q5_K with the same integer sums and float terms in the same order; Q6_K's
 * integer sums include the offset -32, where theirs take it back from the activations' sums
 * in float (equal up to float rounding).
 *
 * Expanded layouts, per super-block of a group (16 rows x 256 values); a line is 64 bytes,
 * 4 consecutive values of each of the 16 rows (row r at bytes 4r..4r+3), as in the tiles:
 *   Q4_K / Q5_K: lines [sub-block s 8][g 8] (values 32s + 4g..4g+3), then d*sc and dmin*mn
 *                as [s 8][16 rows] floats (both builds);
 *   Q6_K (AVX2): lines [block j 8][g 8] (values 32j + 4g..4g+3) holding q - 32 as int8,
 *                then the 16 int8 scales per row as int32 lanes holding the int16 pair
 *                (s, s) ([c 16][16 rows]), then d as 16 floats;
 *   Q6_K (512):  the same lines, then the scales as int32 lanes, then -128 times each row's
 *                sum of each 16 values ([c 16][16 rows] int32: see expand_q6k), then d.
 * Built and loaded by forerun/model/cpu_kernels.py. */
#include "ktile.h"

#ifdef KTILE_EXPANDED
#include <immintrin.h>
#include <string.h>

#include "fp16.h"

#define XL 4096 /* bytes of a super-block's expanded lines */
#define XK_BYTES (XL + 2 * 8 * 16 * 4)
#define X6_SCP XL
#ifdef KTILE_512
#define X6_INIT (XL + 16 * 64) /* Q6_K, 512-bit: -128 (sum of each 16 values), int32 lanes */
#define X6_D (X6_INIT + 16 * 64)
#else
#define X6_D (XL + 16 * 64)
#endif
#define X6_BYTES (X6_D + 16 * 4)
#define QK 32


/* See quant_matmul.c's KEEP_IN_REG: without it GCC sums a sub-block's products as a tree and
 * spills them. */
#define KEEP_IN_REG(v) __asm__("" : "+x"(v))
#define KEEP_IN_ZMM(v) __asm__("" : "+v"(v))

int64_t ktile_expanded_bytes(int64_t type, int64_t nsb) {
    return nsb * (type == QT_Q6_K || type == QT_Q3_K ? X6_BYTES : XK_BYTES);
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
    /* The scales of all 16 rows at once (kt_scales): scalar, they took about as long as the
     * lines, a third of a 16-row call. */
    float *dsc = (float *)(x + XL), *dmn = dsc + 8 * 16;
    __m128i c[12];
    for (int j = 0; j < 12; ++j) c[j] = _mm_loadu_si128((const __m128i *)(t + 64 + 16 * j));
    for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * h)));
        for (int s = 0; s < 8; ++s) {
            __m128i sc, mn;
            kt_scales(c, s, &sc, &mn);
            if (h) {
                sc = _mm_srli_si128(sc, 8);
                mn = _mm_srli_si128(mn, 8);
            }
            _mm256_storeu_ps(dsc + 16 * s + 8 * h,
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
            _mm256_storeu_ps(dmn + 16 * s + 8 * h,
                             _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
        }
    }
}

#ifdef KTILE_512
/* Q6_K for the 512-bit body: w = q - 32 as int8 lines, multiplied against the activations
 * plus 128 (unsigned: the byte product takes one operand unsigned), so each row's sum of 16
 * values carries 128 sum(w), a constant of the weights stored here negated ([c 16][16 rows]
 * int32) to start the sum from; then each scale as an int32 lane ([c 16][16 rows]) and d as
 * 16 floats. The tile body instead takes the offset 32 back per 16 values in float, two FMAs
 * per row and block that compete with the byte products for the same units. */
/* Line l of block j (w, int8 values of 16 rows) into the 512-bit Q6_K form, its per-row sums
 * added to those of its 16 values (wsum[l / 4]). */
static inline void x6_line(uint8_t *x, int j, int l, __m512i w, __m512i wsum[2]) {
    wsum[l / 4] = _mm512_dpbusd_epi32(wsum[l / 4], _mm512_set1_epi8(1), w);
    _mm512_storeu_si512((void *)(x + 64 * (8 * j + l)), w);
}

/* Block j's two starting sums, -128 sum(w) per 16 values. */
static inline void x6_init(uint8_t *x, int j, const __m512i wsum[2]) {
    for (int hs = 0; hs < 2; ++hs)
        _mm512_storeu_si512((void *)(x + X6_INIT + 64 * (2 * j + hs)),
                            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(wsum[hs], 7)));
}

static void expand_q6k(const uint8_t *t, uint8_t *x) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), hi2 = _mm512_set1_epi8(0x30),
                  off = _mm512_set1_epi8(32);
    for (int j = 0; j < 8; ++j) {
        const int f = j / 4, q = j % 4;
        __m512i wsum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int g = 0; g < 8; ++g) {
            const __m512i l =
                _mm512_loadu_si512((const void *)(t + Q6T_QL + 64 * (16 * f + 8 * (q % 2) + g)));
            const __m512i qh = _mm512_loadu_si512((const void *)(t + Q6T_QH + 64 * (8 * f + g)));
            const __m512i lo = q / 2 ? _mm512_and_si512(_mm512_srli_epi16(l, 4), low4)
                                     : _mm512_and_si512(l, low4);
            const __m512i hb = q == 0   ? _mm512_slli_epi16(qh, 4)
                               : q == 1 ? _mm512_slli_epi16(qh, 2)
                               : q == 2 ? qh
                                        : _mm512_srli_epi16(qh, 2);
            const __m512i w = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_and_si512(hb, hi2)), off);
            x6_line(x, j, g, w, wsum);
        }
        x6_init(x, j, wsum);
    }
    for (int c = 0; c < 16; ++c)
        _mm512_storeu_si512((void *)(x + X6_SCP + 64 * c),
                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * c))));
    _mm512_storeu_ps((float *)(x + X6_D), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t)));
}

/* Q3_K in Q6_K's 512-bit form: w = q - 4 (value 128h + 32g + i is bits 2g..2g+1 of qs byte
 * 32h + i plus 4 times bit 4h + g of hmask byte i, minus 4: -4..3), the sums' -128 sum(w)
 * per 16 values, the scales minus 32, d. rows_q6k_m then computes d sc (q - 4) exactly as
 * for Q6_K. */
static void expand_q3k(const uint8_t *t, uint8_t *x) {
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    for (int j = 0; j < 8; ++j) { /* block of 32: half h, group g */
        const int h = j / 4, g = j % 4;
        __m512i wsum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int l = 0; l < 8; ++l) { /* values 4l..4l+3 of the block */
            const __m512i q = _mm512_loadu_si512((const void *)(t + Q3T_QS + 64 * (8 * h + l)));
            const __m512i hm = _mm512_loadu_si512((const void *)(t + Q3T_HM + 64 * l));
            const __m512i hb = j <= 2 ? _mm512_slli_epi16(hm, 2 - j) : _mm512_srli_epi16(hm, j - 2);
            const __m512i u = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 2 * g), three),
                                              _mm512_and_si512(hb, four));
            const __m512i w = _mm512_sub_epi8(u, four);
            x6_line(x, j, l, w, wsum);
        }
        x6_init(x, j, wsum);
    }
    for (int c = 0; c < 16; ++c)
        _mm512_storeu_si512((void *)(x + X6_SCP + 64 * c), q3k_scales16(t, c));
    _mm512_storeu_ps((float *)(x + X6_D), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t)));
}
#else
static void expand_q6k(const uint8_t *t, uint8_t *x) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30),
                  off = _mm256_set1_epi8(32);
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
                _mm256_storeu_si256(
                    (__m256i *)(x + 64 * (8 * j + g) + 32 * h),
                    _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hb, hi2)), off));
            }
    }
    /* Each scale as the int16 pair (s, s) in an int32 lane, 8 rows a vector. */
    for (int cc = 0; cc < 16; ++cc)
        for (int h = 0; h < 2; ++h) {
            const __m256i s32 =
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(t + 32 + 16 * cc + 8 * h)));
            _mm256_storeu_si256((__m256i *)(x + X6_SCP + 64 * cc + 32 * h),
                                _mm256_blend_epi16(s32, _mm256_slli_epi32(s32, 16), 0xaa));
        }
    for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps((float *)(x + X6_D) + 8 * h,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h))));
}
#endif

void ktile_expand(int64_t type, const uint8_t *tiles, int64_t nsb, uint8_t *x) {
    const int64_t tb = type == QT_Q6_K   ? Q6T_BYTES
                       : type == QT_Q3_K ? Q3T_BYTES
                                         : KT_BYTES(type == QT_Q5_K);
    for (int64_t b = 0; b < nsb; ++b) {
        /* The tiles come from memory once per call; the hardware prefetcher alone left the
         * expansion waiting on them. Into L2 from 32 KB ahead as well: Q5_K at 32 rows on a
         * Zen 4 went 160 -> 139 ms expanded. */
        for (int64_t o = 0; o < tb; o += 64) {
            _mm_prefetch((const char *)(tiles + (b + 2) * tb + o), _MM_HINT_T0);
            _mm_prefetch((const char *)(tiles + b * tb + 32768 + o), _MM_HINT_T1);
        }
        if (type == QT_Q6_K)
            expand_q6k(tiles + b * Q6T_BYTES, x + b * X6_BYTES);
#ifdef KTILE_Q3K
        else if (type == QT_Q3_K)
            expand_q3k(tiles + b * Q3T_BYTES, x + b * X6_BYTES);
#endif
        else
            expand_kt(type == QT_Q5_K, tiles + b * KT_BYTES(type == QT_Q5_K), x + b * XK_BYTES);
    }
}

#ifdef KTILE_512
static inline __m512i bcast4(const int8_t *a) { /* 4 activation bytes in every lane */
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Q4_K / Q5_K: all 16 rows in one vector against m <= 8 activation rows: per line one load
 * and one VNNI byte dot product per row, nothing unpacked; per sub-block of 32 the float
 * terms of group_kt_m (d sc s, dmin mn (s sum)), in its order. */
static inline __attribute__((always_inline)) void rows_kt_m(
    const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa, const float *ssa,
    int64_t k, const int m, float out[][16], const uint8_t *pf, int64_t pf_lines) {
    const int64_t nb = k / QK;
    __m512 acc[8];
    for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * XK_BYTES;
        const float *dsc = (const float *)(xb + XL), *dmn = dsc + 8 * 16;
        for (int s = 0; s < 8; ++s) {
            __m512i sum[8];
            for (int i = 0; i < m; ++i) sum[i] = _mm512_setzero_si512();
            for (int g = 0; g < 8; ++g) {
                const __m512i u = _mm512_loadu_si512((const void *)(xb + 64 * (8 * s + g)));
                for (int i = 0; i < m; ++i) {
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u,
                                                 bcast4(qa + i * k + b * 256 + 32 * s + 4 * g));
                    KEEP_IN_ZMM(sum[i]);
                }
            }
            for (int64_t l = 2 * (8 * b + s); l < 2 * (8 * b + s) + 2 && l < pf_lines; ++l)
                _mm_prefetch((const char *)(pf + 64 * l), _MM_HINT_T1);
            const int64_t j = b * 8 + s; /* activation block */
            const __m512 vsc = _mm512_loadu_ps(dsc + 16 * s), vmn = _mm512_loadu_ps(dmn + 16 * s);
            for (int i = 0; i < m; ++i) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                         _mm512_mul_ps(vsc, _mm512_set1_ps(sa[i * nb + j])),
                                         acc[i]);
                acc[i] = _mm512_fnmadd_ps(vmn, _mm512_set1_ps(ssa[i * nb + j]), acc[i]);
            }
        }
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

/* Q6_K: all 16 rows against m <= 8 activation rows (qa: plus 128, as uint8): per 16
 * values four VNNI products per row from the stored -128 sum(w), weighted by the scale in one
 * integer multiply; per block of 32 one float FMA by the activations' scale s_j, and d once
 * per super-block (a multiply by d per block took the FMA units from the byte products). */
static inline __attribute__((always_inline)) void rows_q6k_m(
    const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa, int64_t k, const int m,
    float out[][16], const uint8_t *pf, int64_t pf_lines) {
    const int64_t nb = k / QK;
    __m512 acc[8];
    for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * X6_BYTES;
        const __m512 d = _mm512_loadu_ps((const float *)(xb + X6_D));
        __m512 accb[8];
        for (int i = 0; i < m; ++i) accb[i] = _mm512_setzero_ps();
        for (int j = 0; j < 8; ++j) {
            __m512i dot[8];
            for (int i = 0; i < m; ++i) dot[i] = _mm512_setzero_si512();
            for (int hs = 0; hs < 2; ++hs) { /* 16 values: lines 4hs..4hs+3, one scale */
                const uint8_t *line = xb + 64 * (8 * j + 4 * hs);
                const __m512i w0 = _mm512_loadu_si512((const void *)line);
                const __m512i w1 = _mm512_loadu_si512((const void *)(line + 64));
                const __m512i w2 = _mm512_loadu_si512((const void *)(line + 128));
                const __m512i w3 = _mm512_loadu_si512((const void *)(line + 192));
                const int64_t c = 2 * j + hs;
                if (16 * b + c < pf_lines)
                    _mm_prefetch((const char *)(pf + 64 * (16 * b + c)), _MM_HINT_T1);
                const __m512i sc = _mm512_loadu_si512((const void *)(xb + X6_SCP + 64 * c));
                const __m512i init = _mm512_loadu_si512((const void *)(xb + X6_INIT + 64 * c));
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 16 * c;
                    __m512i p = _mm512_dpbusd_epi32(init, bcast4(a), w0);
                    p = _mm512_dpbusd_epi32(p, bcast4(a + 4), w1);
                    p = _mm512_dpbusd_epi32(p, bcast4(a + 8), w2);
                    p = _mm512_dpbusd_epi32(p, bcast4(a + 12), w3);
                    dot[i] = _mm512_add_epi32(dot[i], _mm512_mullo_epi32(p, sc));
                    KEEP_IN_ZMM(dot[i]);
                }
            }
            for (int i = 0; i < m; ++i)
                accb[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]),
                                          _mm512_set1_ps(sa[i * nb + b * 8 + j]), accb[i]);
        }
        for (int i = 0; i < m; ++i) acc[i] = _mm512_fmadd_ps(accb[i], d, acc[i]);
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

int64_t ktile_rows_per_call(int64_t type) { (void)type; return 8; }

/* One line per 16 values: a Q6_K pass's loop takes 16 values at a time, a Q4_K/Q5_K pass's
 * 32 (two lines a step). */
int64_t ktile_prefetch_lines(int64_t nsb) { return 16 * nsb; }

void ktile_expanded_rows(int64_t type, const uint8_t *x, int64_t nsb, const int8_t *qa,
                         const float *sa, const float *ssa, int64_t k, int64_t m,
                         float out[][16], const uint8_t *pf, int64_t pf_lines) {
#define ROWS(M)                                                                                 \
    case M:                                                                                     \
        if (type == QT_Q6_K || type == QT_Q3_K) rows_q6k_m(x, nsb, qa, sa, k, M, out, pf, pf_lines); \
        else rows_kt_m(x, nsb, qa, sa, ssa, k, M, out, pf, pf_lines);                           \
        return
    switch (m) {
        ROWS(1); ROWS(2); ROWS(3); ROWS(4); ROWS(5); ROWS(6); ROWS(7);
    default:
        ROWS(8);
    }
#undef ROWS
}
#else
static inline __m256i bcast4(const int8_t *a) { /* 4 activation bytes in every lane */
    int32_t v;
    memcpy(&v, a, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Q4_K / Q5_K: all 16 rows (two halves of 8 lanes) against m <= 3 activation rows, one
 * broadcast of 4 activation bytes feeding both halves. Per sub-block the 8 lines' byte
 * products are summed in int16 (Q5_K: widened after 4 lines, as 8 of its sums could pass
 * 32767) and widened once; then d sc s and dmin mn (s sum) as quant_matmul.c. A half per pass
 * with 4 rows (a broadcast per product) ran Q5_K 1.1-1.2x and Q4_K 1.03-1.09x slower on one
 * core of an AVX2-only Zen 3: with the widenings, Q5_K held more sums than registers. */
static inline __attribute__((always_inline)) void rows_kt_m(
    const int q5, const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa,
    const float *ssa, int64_t k, const int m, float out[][16]) {
    const int64_t nb = k / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[3][2];
    for (int i = 0; i < m; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * XK_BYTES;
        const float *dsc = (const float *)(xb + XL), *dmn = dsc + 8 * 16;
        for (int s = 0; s < 8; ++s) {
            __m256i sum[3][2], dot[3][2];
            for (int i = 0; i < m; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
                const uint8_t *line = xb + 64 * (8 * s + g);
                const __m256i u0 = _mm256_loadu_si256((const __m256i *)line);
                const __m256i u1 = _mm256_loadu_si256((const __m256i *)(line + 32));
                for (int i = 0; i < m; ++i) {
                    const __m256i a = bcast4(qa + i * k + b * 256 + 32 * s + 4 * g);
                    sum[i][0] = _mm256_add_epi16(sum[i][0], _mm256_maddubs_epi16(u0, a));
                    sum[i][1] = _mm256_add_epi16(sum[i][1], _mm256_maddubs_epi16(u1, a));
                    KEEP_IN_REG(sum[i][0]);
                    KEEP_IN_REG(sum[i][1]);
                }
                if (q5 && g == 3)
                    for (int i = 0; i < m; ++i)
                        for (int h = 0; h < 2; ++h) {
                            dot[i][h] = _mm256_madd_epi16(sum[i][h], ones);
                            sum[i][h] = _mm256_setzero_si256();
                        }
            }
            const int64_t j = b * 8 + s; /* activation block */
            for (int i = 0; i < m; ++i)
                for (int h = 0; h < 2; ++h) {
                    __m256i d32 = _mm256_madd_epi16(sum[i][h], ones);
                    if (q5) d32 = _mm256_add_epi32(d32, dot[i][h]);
                    const __m256 vsc = _mm256_loadu_ps(dsc + 16 * s + 8 * h);
                    const __m256 vmn = _mm256_loadu_ps(dmn + 16 * s + 8 * h);
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32),
                                                _mm256_mul_ps(vsc, _mm256_set1_ps(sa[i * nb + j])),
                                                acc[i][h]);
                    acc[i][h] = _mm256_fnmadd_ps(vmn, _mm256_set1_ps(ssa[i * nb + j]), acc[i][h]);
                }
        }
    }
    for (int i = 0; i < m; ++i) {
        _mm256_storeu_ps(out[i], acc[i][0]);
        _mm256_storeu_ps(out[i] + 8, acc[i][1]);
    }
}

/* Q6_K: half h of the rows against m <= 4 activation rows. The values are held as
 * w = q - 32 (|w| <= 32), multiplied as maddubs(|w|, sign(a, w)): 2 |w| |a| <= 8128, so
 * the 4 lines of one scale (16 values) sum in int16 and are weighted by the scale in the one
 * madd that widens them; per block of 32 one float FMA (d s). Holding q (0..63) instead fit
 * only 2 lines per madd and needed the offset 32 taken back from the activations' sums
 * (about 1.1x slower on one core of an AVX2-only Zen 3). */
static inline __attribute__((always_inline)) void rows_q6k_m(
    const uint8_t *x, int64_t nsb, const int8_t *qa, const float *sa, int64_t k, const int m,
    const int h, float out[][16]) {
    const int64_t nb = k / QK;
    __m256 acc[4];
    for (int i = 0; i < m; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *xb = x + b * X6_BYTES;
        const __m256 d = _mm256_loadu_ps((const float *)(xb + X6_D) + 8 * h);
        for (int j = 0; j < 8; ++j) {
            __m256i dot[4];
            for (int i = 0; i < m; ++i) dot[i] = _mm256_setzero_si256();
            for (int c = 0; c < 2; ++c) { /* the two scales of block j */
                const __m256i sc = _mm256_loadu_si256(
                    (const __m256i *)(xb + X6_SCP + 64 * (2 * j + c) + 32 * h));
                __m256i w[4], aw[4];
                for (int g = 0; g < 4; ++g) {
                    w[g] = _mm256_loadu_si256(
                        (const __m256i *)(xb + 64 * (8 * j + 4 * c + g) + 32 * h));
                    aw[g] = _mm256_sign_epi8(w[g], w[g]);
                }
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * j + 16 * c;
                    __m256i s16 = _mm256_maddubs_epi16(aw[0], _mm256_sign_epi8(bcast4(a), w[0]));
                    for (int g = 1; g < 4; ++g)
                        s16 = _mm256_add_epi16(
                            s16, _mm256_maddubs_epi16(aw[g], _mm256_sign_epi8(bcast4(a + 4 * g), w[g])));
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
    for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
}

int64_t ktile_rows_per_call(int64_t type) { return type == QT_Q6_K ? 4 : 3; }

void ktile_expanded_rows(int64_t type, const uint8_t *x, int64_t nsb, const int8_t *qa,
                         const float *sa, const float *ssa, int64_t k, int64_t m,
                         float out[][16]) {
#define Q6(M)                                                                                   \
    for (int h = 0; h < 2; ++h) rows_q6k_m(x, nsb, qa, sa, k, M, h, out);                       \
    return
#define KT(M)                                                                                   \
    if (type == QT_Q5_K) rows_kt_m(1, x, nsb, qa, sa, ssa, k, M, out);                          \
    else rows_kt_m(0, x, nsb, qa, sa, ssa, k, M, out);                                          \
    return
    if (type == QT_Q6_K) {
        switch (m) {
        case 1: Q6(1);
        case 2: Q6(2);
        case 3: Q6(3);
        default: Q6(4);
        }
    }
    switch (m) {
    case 1: KT(1);
    case 2: KT(2);
    default: KT(3);
    }
#undef Q6
#undef KT
}
#endif /* KTILE_512 */
#endif
