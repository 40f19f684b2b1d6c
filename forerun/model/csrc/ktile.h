/* The K-quant tiles of quant_matmul.c (Q4_K, Q5_K, Q6_K regrouped by 16 rows; the layouts
 * are described there) and the many-row path of ktile_gemm.c, which expands a group's tiles
 * to one byte per value once per call and runs the activation rows against the bytes.
 * Built and loaded by forerun/model/cpu_kernels.py. */
#ifndef FORERUN_KTILE_H
#define FORERUN_KTILE_H
#include <stdint.h>

#include "qtile.h"

#define KT_QS(q5) ((q5) ? 768 : 256)     /* Q4_K/Q5_K: offset of the quant lines in a tile */
#define KT_BYTES(q5) ((q5) ? 2816 : 2304) /* Q4_K/Q5_K: bytes of a tile */
#define Q6T_BYTES 3360                    /* Q6_K: bytes of a tile */
#define Q6T_QL 288                        /* Q6_K: offset of the ql lines */
#define Q6T_QH 2336                       /* Q6_K: offset of the qh lines */
#define Q3T_BYTES 1760                    /* Q3_K: bytes of a tile (16 x 110) */
#define Q3T_SC 32                         /* Q3_K: offset of the 12 scale lines of 16 bytes */
#define Q3T_HM 224                        /* Q3_K: offset of the hmask lines */
#define Q3T_QS 736                        /* Q3_K: offset of the qs lines */

#if defined(__SSE2__)
#include <immintrin.h>
/* Sub-block j's 6-bit scale and min of the 16 rows (one byte each) from a Q4_K/Q5_K tile's
 * 12 scale lines c (byte c of every row; ggml's get_scale_min_k4, 16 rows at once). */
static inline void kt_scales(const __m128i c[12], int j, __m128i *sc, __m128i *mn) {
    const __m128i six = _mm_set1_epi8(63), lo4 = _mm_set1_epi8(0x0f), two = _mm_set1_epi8(3);
    if (j < 4) {
        *sc = _mm_and_si128(c[j], six);
        *mn = _mm_and_si128(c[j + 4], six);
    } else {
        *sc = _mm_or_si128(_mm_and_si128(c[j + 4], lo4),
                           _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(c[j - 4], 6), two), 4));
        *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c[j + 4], 4), lo4),
                           _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(c[j], 6), two), 4));
    }
}
#endif

#if defined(__AVX512F__)
/* Q3_K: sub-block c's (16 values) 6-bit scale minus 32 of the 16 rows of tile t, as int32
 * lanes (ggml's 12 scale bytes: low nibbles in bytes 0-7, the high two bits in bytes 8-11). */
static inline __m512i q3k_scales16(const uint8_t *t, int c) {
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + Q3T_SC + 16 * (c % 8))));
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + Q3T_SC + 16 * (8 + c % 4))));
    const __m512i low4 = c < 8 ? _mm512_and_si512(lo, _mm512_set1_epi32(15)) : _mm512_srli_epi32(lo, 4);
    const __m512i high2 = _mm512_and_si512(_mm512_srli_epi32(hi, 2 * (c / 4)), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(low4, _mm512_slli_epi32(high2, 4)), _mm512_set1_epi32(32));
}
#endif

/* The expanded path exists in the AVX2 build without byte dot-product instructions, where
 * unpacking a line's 4-6 bit values costs as much as the products of the rows it feeds
 * (maddubs and madd, two instructions per four values, where VNNI takes one), and in the
 * AVX512-VNNI build, where the 512-bit group bodies unpack every line once per 8 activation
 * rows: at 8 rows a pass the unpacking is 3 (Q4_K) to 11 (Q5_K) instructions per line against
 * 16 byte products, which a prompt of 512 rows repeats 64 times. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
#define KTILE_EXPANDED 1
#define KTILE_512 1
/* Activation rows (of a call's chunk) from which a group's tiles are expanded. The 1B's
 * linears on 2 cores of a Zen 4, tiles -> expanded, at 32 / 64 / 128 / 512 rows: Q5_K
 * 1.03 / 1.26 / 1.10 / 1.32x, Q6_K 1.15 / 1.25 / - / 1.27x, Q4_K - / 1.00 / 1.05 / 1.11x;
 * at 16 rows Q5_K and Q6_K 0.89x (Q6_K 0.95x with the passes prefetching the next group).
 * Below that the expansion, which reads the tiles from memory, costs what it saves.
 * Q3_K, whose tile body unpacks two bit planes per line, expanded at 8 / 16 / 24 / 32 / 64 /
 * 512 rows: 0.97 / 1.19 / 1.37 / 1.41 / 1.52 / 1.64x (the 1B Q3_K_M file's Q3_K linears).
 * (Activations per 256 values for Q6_K, as llama.cpp's Q8_K, ran its expanded body 1.1x
 * faster but moved SmolLM2's teacher-forced NLL in Q6_K 2.45% off the exact engine, per 32
 * 0.47%: an outlier channel coarsens its whole super-block.) */
static inline int64_t ktile_min_rows(int64_t type) {
    return type == QT_Q3_K ? 16 : type == QT_Q5_K || type == QT_Q6_K ? 32 : 128;
}
/* Q3_K expands to Q6_K's 512-bit form (values q - 4, scales sc - 32) and runs its body. */
#define KTILE_Q3K 1
#define KTILE_MAX_ROWS 8 /* rows per ktile_expanded_rows call */
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVXVNNI__) && \
    !defined(__AVX512VNNI__)
#define KTILE_EXPANDED 1
/* Activation rows from which a call expands a group's tiles (the unpacking, done once, is
 * then shared by every row instead of by four). With the scales expanded 16 rows at a time,
 * 8 and 12 rows (one core, 8192 x 2048) ran 1.1-1.4x faster expanded (Q6_K at 12 level);
 * at 4 and 6 rows it was a wash. */
static inline int64_t ktile_min_rows(int64_t type) { return (void)type, 8; }
#define KTILE_MAX_ROWS 4
#endif

#ifdef KTILE_EXPANDED
/* Bytes of a group's nsb tiles of ggml type `type` (12 Q4_K, 13 Q5_K, 14 Q6_K; 11 Q3_K where
 * KTILE_Q3K) expanded. */
int64_t ktile_expanded_bytes(int64_t type, int64_t nsb);
/* Expand a group's nsb tiles (16 rows x 256 nsb values) into x (ktile_expanded_bytes). */
void ktile_expand(int64_t type, const uint8_t *tiles, int64_t nsb, uint8_t *x);
/* Activation rows one ktile_expanded_rows call takes at most (<= KTILE_MAX_ROWS). */
int64_t ktile_rows_per_call(int64_t type);
/* out[i][r] = row r of the group . activation row i, for m <= ktile_rows_per_call(type) rows
 * of qa (int8 per block of 32, k per row; for Q6_K and Q3_K in the 512-bit build (KTILE_512)
 * those bytes plus 128, read as uint8) with their block scales sa and scaled sums ssa (per 32), as
 * quant_matmul.c's group bodies take them. */
#ifdef KTILE_512
/* Meanwhile it prefetches into L2 the pf_lines 64-byte lines from pf (at most
 * ktile_prefetch_lines(nsb)): the next group's tiles, so that their expansion need not wait
 * on memory, which the products leave idle. */
void ktile_expanded_rows(int64_t type, const uint8_t *x, int64_t nsb, const int8_t *qa,
                         const float *sa, const float *ssa, int64_t k, int64_t m,
                         float out[][16], const uint8_t *pf, int64_t pf_lines);
int64_t ktile_prefetch_lines(int64_t nsb);
#else
void ktile_expanded_rows(int64_t type, const uint8_t *x, int64_t nsb, const int8_t *qa,
                         const float *sa, const float *ssa, int64_t k, int64_t m,
                         float out[][16]);
#endif
#endif

#endif
