/* y = x @ W.T (+ bias) with W in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * IQ4_NL, MXFP4): the matmuls of quantization="gguf" (CPU).
 *
 * The formats, per block of 32 values of a weight row:
 *   Q8_0: fp16 d, int8 q[32]                         w = d * q
 *   Q4_0: fp16 d, uint8 qs[16]                       w = d * (nibble - 8)
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]               w = d * nibble + m
 *   Q5_0: fp16 d, uint32 qh, uint8 qs[16]            w = d * (q5 - 16)
 *   Q5_1: fp16 d, fp16 m, uint32 qh, uint8 qs[16]    w = d * q5 + m
 *   IQ4_NL: fp16 d, uint8 qs[16]                     w = d * level[nibble]
 *   MXFP4: uint8 e (E8M0), uint8 qs[16]              w = 2^(e - 128) * level[nibble]
 * (value j of a 4-bit block is the low nibble of qs[j], value 16 + j its high nibble; a Q5
 * value's fifth bit is bit j of qh, little-endian). Q5_0, Q5_1 and IQ4_NL are what llama.cpp
 * writes in a K-quant file (Q4_K_M, Q5_K_M, IQ4_XS) for a tensor whose rows are not a multiple
 * of 256 values, so widths like 576, 896 or 2880 put many of a model's linears in them.
 * MXFP4's levels are its FP4 E2M1 values doubled (ggml's kvalues_mxfp4, -12..12; the scale
 * halved to match); the kernels read them as u = level + 12 (0..24) with c = -12 d, so that
 * they take the unsigned byte dot products of the other 4-bit types, one byte shuffle per 32
 * nibbles looking the 16 values up. IQ4_NL's levels (ggml's kvalues_iq4nl, -127..113) are
 * read the same way, as u = level + 127 with c = -127 d, where the dot product is VNNI's; the
 * AVX2 maddubs form would saturate on those u, so the AVX2 bodies take the signed level and
 * move its sign onto the activation byte, as for Q8_0.
 *
 * Layout in memory: the file's blocks, regrouped (same bytes, same bits) by 16 rows, so that
 * one 64-byte load feeds 16 output rows at once: a "tile" is block b of 16 consecutive rows,
 *   d of the 16 rows (16 x fp16; MXFP4: their 16 exponent bytes), [Q4_1: m of the 16 rows],
 *   then the quants as lines of 64
 *   bytes, line j holding bytes 4j..4j+3 of each row's qs in row order.
 * Tiles run block by block within a group of 16 rows, groups one after another; a last group
 * of fewer rows is padded with zero blocks. forerun/model/quant/gguf_blocks.py makes it
 * (repack_tiles) and reads it back (tiles_to_blocks).
 *
 * Activations: each row of x is quantized per block of 32 to int8 with its own scale
 * s = max|x| / 127 (round to nearest even), as llama.cpp's q8 activations are. A block's dot
 * product is then a sum of 32 byte products: with a line of 16 rows' bytes against 4
 * activation bytes broadcast to every lane, one AVX512-VNNI instruction adds 4 products into
 * each of 16 rows' sums, with no horizontal sums and no shuffles. With every weight written
 * as w = d * u + c (u a small non-negative integer per value, d and c per block), a block
 * contributes d * s * sum_j(u_j a_j) + c * (s * sum_j a_j); the types differ only in how u
 * and c are read. gguf_blocks.py computes the same function in torch (the fallback).
 *
 * Which body is compiled follows the build's -march (cpu_kernels.py builds for the machine):
 * AVX512-VNNI (16 rows per instruction), AVX2 with AVX-VNNI or maddubs (8 rows per
 * instruction), or plain C; quant_matmul_isa() says which.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fp16.h"
#include "ktile.h"
#include "qtile.h"
#include "qweight.h"

/* An empty asm that takes v in a register and may change it: GCC can then neither
 * reassociate a chain of adds through it nor hoist the products of later lines above it.
 * Without it GCC computed all 8 lines' products of a sub-block pair first and summed them
 * as a tree, spilling 28 vectors to the stack per pass (Q4_K, 4 activation rows per pass:
 * 10-25% slower at 8 and 512 rows, one core). */
#define KEEP_IN_REG(v) __asm__("" : "+x"(v))
#define KEEP_IN_ZMM(v) __asm__("" : "+v"(v)) /* any of the 32 vector registers */

#define QK 32
#define GR 16       /* rows per tile */
#define MAXM 4      /* rows of x per pass over a group of weight rows */
/* The K-quant tiles' 512-bit bodies hold two more rows' sums per pass (their 32 registers),
 * so a line's unpacked nibbles serve 8 activation rows. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
#define MAXM_K 8
#else
#define MAXM_K MAXM
#endif
#define MCHUNK 256  /* rows of x whose quantized activations stay cache-resident together */
/* CALL(M) for m = M in 1..MAXM_K, M a compile-time constant in each call: the vector bodies
 * are instantiated per row count so that every row's sums stay in registers (with m a
 * runtime count they lived on the stack: 1.5x slower). */
#if MAXM_K > 4
#define FOR_ROW_COUNT(m, CALL)                                                                   \
    switch (m) {                                                                                 \
    case 1: CALL(1); return;                                                                     \
    case 2: CALL(2); return;                                                                     \
    case 3: CALL(3); return;                                                                     \
    case 4: CALL(4); return;                                                                     \
    case 5: CALL(5); return;                                                                     \
    case 6: CALL(6); return;                                                                     \
    case 7: CALL(7); return;                                                                     \
    default: CALL(8); return;                                                                    \
    }
#else
#define FOR_ROW_COUNT(m, CALL)                                                                   \
    switch (m) {                                                                                 \
    case 1: CALL(1); return;                                                                     \
    case 2: CALL(2); return;                                                                     \
    case 3: CALL(3); return;                                                                     \
    default: CALL(4); return;                                                                    \
    }
#endif
#define PREFETCH_TILES 8 /* tiles ahead of the one being read (AVX2 body) */
/* How far ahead of the tile being read the 512-bit bodies prefetch, into L2: a GEMV of
 * 300 MB streamed from DRAM on 2 cores went 16-18 -> 18-20 GB/s (Q4_0, one row), 8 -> 14
 * (eight rows); 1-16 KB ahead into L1 did no better than the hardware alone. Later, on a
 * Zen 4 (the 1B's linears, one row, 2 cores): the bodies that read a tile's lines in order
 * (Q4_0/Q8_0, Q4_K/Q5_K) streamed 1.03-1.17x faster leaving one row to the hardware
 * prefetcher (a tile's prefetches issued at once stalled on full miss buffers), while Q6_K,
 * whose lines are read out of order, went 1.10-1.2x faster with its prefetches spread over
 * the tile's blocks (at 8 rows too) instead of issued at its start. */
#define PF_BYTES 32768
/* A tile of `bytes` PF_BYTES ahead of t, into L2, as the group bodies take it at many rows.
 * always_inline: see prefetch_act. */
static inline __attribute__((always_inline)) void prefetch_tile_ahead(const uint8_t *t,
                                                                      int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch((const char *)(t + PF_BYTES + o), _MM_HINT_T1);
}

/* ---- activations ------------------------------------------------------------------------ */
/* Row of k floats -> int8 per block of 32, its scale s and s * sum(q); and, where ss16 is
 * not NULL, s * sum(q) per 16 values (Q6_K's sub-blocks). */
static void quantize_row(const void *x, int x_bf16, int64_t k, int8_t *q, float *s,
                         float *ssum, float *ss16) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* The same function a block of 32 at a time in two vectors (the conversion rounds to
     * nearest even, as nearbyintf does): the scalar loop took ~12% of a 512-row Q4_K GEMM. */
    for (int64_t b = 0; b < k / QK; ++b) {
        __m512 x0, x1;
        if (x_bf16) {
            x0 = bf16x16_load((const uint16_t *)x + b * QK);
            x1 = bf16x16_load((const uint16_t *)x + b * QK + 16);
        } else {
            x0 = _mm512_loadu_ps((const float *)x + b * QK);
            x1 = _mm512_loadu_ps((const float *)x + b * QK + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t sum0 = _mm512_reduce_add_epi32(q0), sum1 = _mm512_reduce_add_epi32(q1);
        s[b] = d;
        ssum[b] = d * (float)(sum0 + sum1);
        if (ss16) {
            ss16[2 * b] = d * (float)sum0;
            ss16[2 * b + 1] = d * (float)sum1;
        }
    }
#else
    for (int64_t b = 0; b < k / QK; ++b) {
        float xw[QK]; /* a bfloat16 row is widened a block at a time, never as a whole */
        const float *xb = (const float *)x + b * QK;
        if (x_bf16) {
            for (int j = 0; j < QK; ++j) xw[j] = bf16_to_f32(((const uint16_t *)x)[b * QK + j]);
            xb = xw;
        }
        float amax = 0.f;
        for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sum[2] = {0, 0};
        for (int j = 0; j < QK; ++j) {
            const int32_t v = (int32_t)nearbyintf(xb[j] * inv);
            q[b * QK + j] = (int8_t)v;
            sum[j / 16] += v;
        }
        s[b] = d;
        ssum[b] = d * (float)(sum[0] + sum[1]);
        if (ss16) {
            ss16[2 * b] = d * (float)sum[0];
            ss16[2 * b + 1] = d * (float)sum[1];
        }
    }
#endif
}

/* How the AVX2 one-row Q6_K body prefetches: step s of a tile's loop prefetches lines
 * s * n .. s * n + n - 1 of the tile PF_AHEAD on (those within its `bytes`), a few lines per
 * step rather than the whole next tile at the start of each: from DRAM, 2 cores of a Zen 3,
 * that GEMV went 25-32 -> 34-47 GOP/s (1 to 4 tiles ahead alike). The Q4_K/Q5_K tile bodies
 * measured slower with it (0.7-1.03x) and keep their burst. */
#define PF_AHEAD 2
static inline void prefetch_spread(const uint8_t *tile, int s, int n, int64_t bytes) {
    for (int l = s * n; l < s * n + n; ++l)
        if (64 * (int64_t)l < bytes) _mm_prefetch((const char *)(tile + 64 * l), _MM_HINT_T0);
}

/* Activation bytes a tile loop reads soon, into L1: beside the streaming tiles L1 keeps
 * little else, so with a long k (the MLP's down projection, k = 8192) each group of rows
 * found its activations evicted since the group before and waited on L2 for them (1B
 * Q4_K_M down projections, one row, from DRAM, 2 cores: 38.7 -> 43.8 and 41.6 -> 49.9 GB/s
 * in two runs). Only the Q4_K/Q5_K body takes it: the Q6_K and Q4_0/Q8_0 bodies measured
 * no faster with it. always_inline: GCC deleted the calls of a non-inlined copy, a function
 * that only prefetches counting as pure. */
static inline __attribute__((always_inline)) void prefetch_act(const int8_t *qa, int64_t k,
                                                               int m, int64_t from,
                                                               int64_t bytes) {
    if (from >= k) return;
    for (int i = 0; i < m; ++i)
        for (int64_t o = from; o < from + bytes; o += 64)
            _mm_prefetch((const char *)(qa + i * k + o), _MM_HINT_T0);
}

static inline int32_t act4(const int8_t *a) { /* 4 activation bytes as one lane */
    int32_t v;
    memcpy(&v, a, sizeof v);
    return v;
}

/* Q5_0 / Q5_1 tiles: the 64-byte line after the header holds the 16 rows' qh (row r's in
 * bytes 4r..4r+3), so each 32-bit lane of a line carries its row's fifth bits. Quant line j
 * holds values 4j..4j+3 (low nibbles) and 16 + 4j..16 + 4j + 3 (high): their fifth bits are
 * bits 4j.. of qh byte j / 2 and of byte 2 + j / 2. QH_SEL picks that byte into all four
 * bytes of its lane (a byte shuffle stays within 16 bytes: dword p's bytes are 4p..4p+3),
 * QH_BITS(j) is the bit each of the four bytes tests. */
#define QH_SEL(byte) (0x01010101 * (byte))
#define QH_BITS(j) ((int)(0x08040201u << (4 * ((j) % 2))))
static const int32_t QH_LANE[4] = {0, 0x04040404, 0x08080808, 0x0c0c0c0c};

/* ---- one group of 16 weight rows against up to MAXM activation rows ----------------------
 * out[i][r] = row r of the group . activation row i. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISA 3
/* u0 / u1 (line j's low / high nibbles of 16 rows) plus 16 where the value's fifth bit is set,
 * from the rows' qh line. */
static inline __attribute__((always_inline)) void add_fifth_bits(__m512i qh, int j,
                                                                  __m512i *u0, __m512i *u1) {
    const __m512i lane = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)QH_LANE));
    const __m512i bits = _mm512_set1_epi32(QH_BITS(j)), sixteen = _mm512_set1_epi8(16);
    const __m512i lo = _mm512_shuffle_epi8(qh, _mm512_add_epi32(lane, _mm512_set1_epi32(QH_SEL(j / 2))));
    const __m512i hi = _mm512_shuffle_epi8(qh, _mm512_add_epi32(lane, _mm512_set1_epi32(QH_SEL(2 + j / 2))));
    *u0 = _mm512_mask_add_epi8(*u0, _mm512_test_epi8_mask(lo, bits), *u0, sixteen);
    *u1 = _mm512_mask_add_epi8(*u1, _mm512_test_epi8_mask(hi, bits), *u1, sixteen);
}
/* m a compile-time constant per instance (group_rows below), so each row's sum and
 * accumulator stay in registers for up to MAXM_K rows; a block's offset term (c times the
 * activations' scaled sum) goes into the same accumulator. */
static inline __attribute__((always_inline)) void group_rows_m(
    int64_t type, const uint8_t *tiles, int64_t nb, const int8_t *qa, const float *sa,
    const float *ssa, int64_t k, const int m, float out[MAXM_K][GR]) {
    const int64_t tb = GR * block_bytes(type), hdr = tile_header(type);
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const int mx = type == QT_MXFP4, nl = type == QT_IQ4_NL;
    const int q5 = type == QT_Q5_0 || type == QT_Q5_1, with_m = type == QT_Q4_1 || type == QT_Q5_1;
    const __m512i lut =
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(nl ? IQ4NL_U : MXFP4_U)));
    const __m512 cd = _mm512_set1_ps(type == QT_Q4_0   ? -8.f
                                     : type == QT_Q5_0 ? -16.f
                                     : mx              ? -MXFP4_OFFSET
                                     : nl              ? -IQ4NL_OFFSET
                                                       : -128.f);
    __m512 acc[MAXM_K];
    for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *t = tiles + b * tb, *lines = t + hdr;
        if (m > 1) prefetch_tile_ahead(t, tb); /* one row: the hardware's alone */
        const __m512 d = mx ? e8m0_half16(t)
                            : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        /* c = m (Q4_1, Q5_1), -8 d (Q4_0), -16 d (Q5_0), -128 d (Q8_0: u = q + 128), -12 d
         * (MXFP4), -127 d (IQ4_NL) */
        const __m512 c = with_m
                             ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32)))
                             : _mm512_mul_ps(d, cd);
        __m512i sum[MAXM_K];
        for (int i = 0; i < m; ++i) sum[i] = _mm512_setzero_si512();
        if (type == QT_Q8_0) {
            for (int j = 0; j < 8; ++j) {
                const __m512i u = _mm512_xor_si512(
                    _mm512_loadu_si512((const void *)(lines + 64 * j)), flip);
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * QK;
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u, _mm512_set1_epi32(act4(a + 4 * j)));
                    KEEP_IN_ZMM(sum[i]);
                }
            }
        } else {
            const uint8_t *qs = q5 ? lines + 64 : lines;
            const __m512i qh = q5 ? _mm512_loadu_si512((const void *)lines) : low4;
            for (int j = 0; j < 4; ++j) {
                const __m512i l = _mm512_loadu_si512((const void *)(qs + 64 * j));
                __m512i u0 = _mm512_and_si512(l, low4);
                __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
                if (mx || nl) {
                    u0 = _mm512_shuffle_epi8(lut, u0);
                    u1 = _mm512_shuffle_epi8(lut, u1);
                } else if (q5) {
                    add_fifth_bits(qh, j, &u0, &u1);
                }
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * QK;
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u0, _mm512_set1_epi32(act4(a + 4 * j)));
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u1,
                                                 _mm512_set1_epi32(act4(a + 16 + 4 * j)));
                    KEEP_IN_ZMM(sum[i]);
                }
            }
        }
        for (int i = 0; i < m; ++i) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(sa[i * nb + b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(ssa[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], acc[i]);
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* add_fifth_bits of the 512-bit body for 8 rows (half a line). */
static inline __attribute__((always_inline)) void add_fifth_bits(__m256i qh, int j,
                                                                  __m256i *u0, __m256i *u1) {
    const __m256i lane = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)QH_LANE));
    const __m256i bits = _mm256_set1_epi32(QH_BITS(j)), sixteen = _mm256_set1_epi8(16);
    const __m256i lo = _mm256_and_si256(
        _mm256_shuffle_epi8(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(QH_SEL(j / 2)))), bits);
    const __m256i hi = _mm256_and_si256(
        _mm256_shuffle_epi8(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(QH_SEL(2 + j / 2)))),
        bits);
    *u0 = _mm256_or_si256(*u0, _mm256_and_si256(_mm256_cmpeq_epi8(lo, bits), sixteen));
    *u1 = _mm256_or_si256(*u1, _mm256_and_si256(_mm256_cmpeq_epi8(hi, bits), sixteen));
}
#if defined(__AVXVNNI__)
#define ISA 2
#define DOT_U8S8(acc, u, a) _mm256_dpbusd_avx_epi32(acc, u, a)
#else
#define ISA 1
/* maddubs saturates int16 pairs: u <= 15 (4-bit) or |q| <= 128 with the sign moved onto a
 * (Q8_0, |a| <= 127) stays below 32767. */
#define DOT_U8S8(acc, u, a) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)))
#endif
/* 8 rows' MXFP4 scales 2^(e - 128) from their exponent bytes: 2^(e - 127) is the float with
 * exponent field e (e = 0: the subnormal 2^-127 instead), halved exactly. */
static inline __m256 e8m0_half8(const uint8_t *e) {
    const __m256i e32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i zero = _mm256_and_si256(_mm256_cmpeq_epi32(e32, _mm256_setzero_si256()),
                                          _mm256_set1_epi32(0x00400000));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(e32, 23), zero);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
}
/* Eight rows per 256-bit vector: half h of a tile's 64-byte line holds rows 8h..8h+7. Both
 * halves in one pass over the blocks (two independent float chains per activation row);
 * m is a compile-time constant in each instance (see group_rows), so every accumulator
 * stays in a register (with m a runtime count they lived on the stack: 1.5x slower). */
static inline __attribute__((always_inline)) void group_rows_m(
    int64_t type, const uint8_t *tiles, int64_t nb, const int8_t *qa, const float *sa,
    const float *ssa, int64_t k, const int m, float out[MAXM][GR]) {
    const int64_t tb = GR * block_bytes(type), hdr = tile_header(type);
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i mxu = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_U));
    const __m256i nlv =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_LEVELS));
    const int mx = type == QT_MXFP4, nl = type == QT_IQ4_NL;
    const int q5 = type == QT_Q5_0 || type == QT_Q5_1;
    const __m256 cd = _mm256_set1_ps(mx ? -MXFP4_OFFSET : type == QT_Q5_0 ? -16.f : -8.f);
    (void)ones; /* unused with VNNI */
    __m256 acc[2][MAXM];
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < m; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *t = tiles + b * tb, *lines = t + hdr;
        /* Software prefetch on top of the hardware's: 24 -> 27 GB/s for a 2048 x 8192 Q4_0
         * GEMV on 2 cores with the weights in DRAM. */
        for (int64_t o = 0; o < tb; o += 64)
            _mm_prefetch((const char *)(t + PREFETCH_TILES * tb + o), _MM_HINT_T0);
        __m256i dot[2][MAXM];
        if (type == QT_Q8_0) {
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < m; ++i) dot[h][i] = _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                __m256i a[MAXM];
                for (int i = 0; i < m; ++i)
                    a[i] = _mm256_set1_epi32(act4(qa + i * k + b * QK + 4 * j));
                for (int h = 0; h < 2; ++h) {
                    const __m256i q =
                        _mm256_loadu_si256((const __m256i *)(lines + 64 * j + 32 * h));
                    const __m256i u = _mm256_sign_epi8(q, q); /* |q|; q's sign goes onto a */
                    for (int i = 0; i < m; ++i)
                        dot[h][i] = DOT_U8S8(dot[h][i], u, _mm256_sign_epi8(a[i], q));
                }
            }
        } else {
            /* Without VNNI the 8 byte-pair products of a block are summed in int16
             * (8 * 2 * 15 * 127 < 32767) and widened by one madd; MXFP4's u (<= 24) and the
             * Q5 types' (<= 31) by two, four pairs each (4 * 2 * 31 * 127 < 32767). IQ4_NL's
             * signed levels (|level| <= 127, its sign on a) are widened at once. */
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < m; ++i) dot[h][i] = _mm256_setzero_si256();
#if ISA != 2
            __m256i s16[2][MAXM];
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < m; ++i) s16[h][i] = _mm256_setzero_si256();
#endif
            const uint8_t *qs = q5 ? lines + 64 : lines;
            __m256i qh[2] = {low4, low4};
            if (q5)
                for (int h = 0; h < 2; ++h)
                    qh[h] = _mm256_loadu_si256((const __m256i *)(lines + 32 * h));
            for (int j = 0; j < 4; ++j) {
                __m256i alo[MAXM], ahi[MAXM];
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * QK;
                    alo[i] = _mm256_set1_epi32(act4(a + 4 * j));
                    ahi[i] = _mm256_set1_epi32(act4(a + 16 + 4 * j));
                }
                for (int h = 0; h < 2; ++h) {
                    const __m256i l =
                        _mm256_loadu_si256((const __m256i *)(qs + 64 * j + 32 * h));
                    __m256i u0 = _mm256_and_si256(l, low4);
                    __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
                    if (nl) {
                        const __m256i v0 = _mm256_shuffle_epi8(nlv, u0);
                        const __m256i v1 = _mm256_shuffle_epi8(nlv, u1);
                        u0 = _mm256_sign_epi8(v0, v0);
                        u1 = _mm256_sign_epi8(v1, v1);
                        for (int i = 0; i < m; ++i)
                            dot[h][i] = DOT_U8S8(DOT_U8S8(dot[h][i], u0,
                                                          _mm256_sign_epi8(alo[i], v0)),
                                                 u1, _mm256_sign_epi8(ahi[i], v1));
                        continue;
                    }
                    if (mx) {
                        u0 = _mm256_shuffle_epi8(mxu, u0);
                        u1 = _mm256_shuffle_epi8(mxu, u1);
                    } else if (q5) {
                        add_fifth_bits(qh[h], j, &u0, &u1);
                    }
                    for (int i = 0; i < m; ++i) {
#if ISA == 2
                        dot[h][i] = DOT_U8S8(DOT_U8S8(dot[h][i], u0, alo[i]), u1, ahi[i]);
#else
                        s16[h][i] = _mm256_add_epi16(
                            s16[h][i], _mm256_add_epi16(_mm256_maddubs_epi16(u0, alo[i]),
                                                        _mm256_maddubs_epi16(u1, ahi[i])));
#endif
                    }
                }
#if ISA != 2
                if (j % 2 == 1 && (mx || q5 || j == 3))
                    for (int h = 0; h < 2; ++h)
                        for (int i = 0; i < m; ++i) {
                            dot[h][i] = _mm256_add_epi32(dot[h][i],
                                                         _mm256_madd_epi16(s16[h][i], ones));
                            s16[h][i] = _mm256_setzero_si256();
                        }
#endif
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 d =
                mx ? e8m0_half8(t + 8 * h)
                   : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
            /* Q8_0 and IQ4_NL here: u = |level| with its sign on a, c = 0 */
            __m256 c = _mm256_setzero_ps();
            if (type == QT_Q4_1 || type == QT_Q5_1)
                c = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * h)));
            else if (type == QT_Q4_0 || type == QT_Q5_0 || mx)
                c = _mm256_mul_ps(d, cd);
            for (int i = 0; i < m; ++i) {
                acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][i]),
                                            _mm256_mul_ps(d, _mm256_set1_ps(sa[i * nb + b])),
                                            acc[h][i]);
                if (type != QT_Q8_0 && !nl)
                    acc[h][i] = _mm256_fmadd_ps(c, _mm256_set1_ps(ssa[i * nb + b]), acc[h][i]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[h][i]);
}

#else
#define ISA 0
static void group_rows(int64_t type, const uint8_t *tiles, int64_t nb, const int8_t *qa,
                       const float *sa, const float *ssa, int64_t k, int64_t m,
                       float out[MAXM][GR]) {
    const int64_t tb = GR * block_bytes(type), hdr = tile_header(type);
    for (int64_t i = 0; i < m; ++i)
        for (int r = 0; r < GR; ++r) out[i][r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *t = tiles + b * tb, *lines = t + hdr;
        for (int r = 0; r < GR; ++r) {
            const int mx = type == QT_MXFP4, nl = type == QT_IQ4_NL;
            const int q5 = type == QT_Q5_0 || type == QT_Q5_1;
            const float d = mx ? e8m0_half(t[r]) : fp16_to_f32(t + 2 * r);
            const float c = type == QT_Q4_1 || type == QT_Q5_1 ? fp16_to_f32(t + 32 + 2 * r)
                            : type == QT_Q4_0 ? -8.f * d
                            : type == QT_Q5_0 ? -16.f * d
                            : mx ? -MXFP4_OFFSET * d
                            : nl ? -IQ4NL_OFFSET * d : 0.f;
            int32_t u[QK];
            if (type == QT_Q8_0) {
                for (int j = 0; j < QK; ++j) u[j] = (int8_t)lines[64 * (j / 4) + 4 * r + j % 4];
            } else {
                const uint8_t *qs = q5 ? lines + 64 : lines;
                uint32_t qh = 0;
                if (q5) memcpy(&qh, lines + 4 * r, sizeof qh);
                const uint8_t *lut = mx ? MXFP4_U : nl ? IQ4NL_U : NULL;
                for (int j = 0; j < 16; ++j) {
                    const uint8_t byte = qs[64 * (j / 4) + 4 * r + j % 4];
                    u[j] = lut ? lut[byte & 0x0f] : (byte & 0x0f) | ((qh >> j) & 1) << 4;
                    u[j + 16] = lut ? lut[byte >> 4] : (byte >> 4) | ((qh >> (j + 16)) & 1) << 4;
                }
            }
            for (int64_t i = 0; i < m; ++i) {
                const int8_t *a = qa + i * k + b * QK;
                int32_t dot = 0;
                for (int j = 0; j < QK; ++j) dot += u[j] * a[j];
                out[i][r] += d * sa[i * nb + b] * (float)dot + c * ssa[i * nb + b];
            }
        }
    }
}
#endif

#if ISA > 0
/* The vector bodies' row counts as compile-time constants (their sums stay in registers). */
static void group_rows(int64_t type, const uint8_t *tiles, int64_t nb, const int8_t *qa,
                       const float *sa, const float *ssa, int64_t k, int64_t m,
                       float out[MAXM_K][GR]) {
#define ROWS_CASE(M) group_rows_m(type, tiles, nb, qa, sa, ssa, k, M, out)
    FOR_ROW_COUNT(m, ROWS_CASE)
#undef ROWS_CASE
}
#endif


/* ---- Q4_K and Q5_K in tiles of 16 rows ---------------------------------------------------
 * A super-block of 256 values per row: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins
 * (8 sub-blocks of 32 values each), [Q5_K: 32 bytes qh, bit s of qh[i] the fifth bit of value
 * 32s + i,] 128 bytes of nibbles (value 32s + i = nibble s % 2 of qs[32 (s / 2) + i]);
 * w = d sc_s q - dmin m_s. A tile is one super-block of 16 rows, the same bytes regrouped
 * (16 x 144 or 16 x 176): the 16 d, the 16 dmin, the 12 scale bytes as 12 lines of 16 (byte
 * c of every row), then [qh and] the quants as lines of 64 bytes, line l holding bytes
 * 4l..4l+3 of each row's qh / qs, as the 32-value types' tiles do. Sub-blocks then run
 * across rows: a row's dot product with an activation block of 32 needs no horizontal sum,
 * and its scale and min (one per row) multiply lane by lane. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
/* All 16 rows of a line in one 512-bit vector: each activation row takes two VNNI
 * instructions per line (sub-blocks 2tp and 2tp + 1) where the 256-bit body below takes four
 * over two passes, and the nibbles are unpacked once per line for both halves. */
static inline __attribute__((always_inline)) void group_kt_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ssa,
    int64_t k, const int m, const int q5, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK, tb = KT_BYTES(q5);
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit = _mm512_set1_epi8(1);
    __m512 acc[MAXM_K];
    for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        prefetch_act(qa, k, m, (b + 1) * 256, 256);
        const uint8_t *t = tiles + b * tb;
        if (m > 1) prefetch_tile_ahead(t, tb); /* one row: the hardware's alone */
        __m128i c[12];
        for (int j = 0; j < 12; ++j) c[j] = _mm_loadu_si128((const __m128i *)(t + 64 + 16 * j));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32)));
        for (int tp = 0; tp < 4; ++tp) { /* sub-blocks 2tp (low nibbles), 2tp + 1 (high) */
            __m128i scb[2], mnb[2];
            for (int e = 0; e < 2; ++e) kt_scales(c, 2 * tp + e, &scb[e], &mnb[e]);
            __m512i sum[2][MAXM_K];
            for (int i = 0; i < m; ++i) sum[0][i] = sum[1][i] = _mm512_setzero_si512();
            for (int g = 0; g < 8; ++g) {
                const __m512i l =
                    _mm512_loadu_si512((const void *)(t + KT_QS(q5) + 64 * (8 * tp + g)));
                __m512i u0 = _mm512_and_si512(l, low4);
                __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
                if (q5) { /* bits 2tp and 2tp + 1 of qh: the fifth bits */
                    const __m512i qh = _mm512_loadu_si512((const void *)(t + 256 + 64 * g));
                    u0 = _mm512_or_si512(u0, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(qh, 2 * tp), bit), 4));
                    u1 = _mm512_or_si512(u1, _mm512_slli_epi16(_mm512_and_si512(
                        _mm512_srli_epi16(qh, 2 * tp + 1), bit), 4));
                }
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 64 * tp + 4 * g;
                    sum[0][i] = _mm512_dpbusd_epi32(sum[0][i], u0, _mm512_set1_epi32(act4(a)));
                    sum[1][i] =
                        _mm512_dpbusd_epi32(sum[1][i], u1, _mm512_set1_epi32(act4(a + 32)));
                    KEEP_IN_ZMM(sum[0][i]);
                    KEEP_IN_ZMM(sum[1][i]);
                }
            }
            for (int e = 0; e < 2; ++e) {
                const int64_t j = b * 8 + 2 * tp + e; /* activation block */
                const __m512 dsc =
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scb[e])));
                const __m512 dmn =
                    _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mnb[e])));
                for (int i = 0; i < m; ++i) {
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[e][i]),
                                             _mm512_mul_ps(dsc, _mm512_set1_ps(sa[i * nb + j])),
                                             acc[i]);
                    acc[i] = _mm512_fnmadd_ps(dmn, _mm512_set1_ps(ssa[i * nb + j]), acc[i]);
                }
            }
        }
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], acc[i]);
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4K_VNNI(acc, u, a) _mm256_dpbusd_epi32(acc, u, a)
#elif defined(__AVXVNNI__)
#define Q4K_VNNI(acc, u, a) _mm256_dpbusd_avx_epi32(acc, u, a)
#endif

/* 8 bytes of v (the low or high half) -> 8 floats. */
static inline __m256 u8x8_to_ps(__m128i v, int high) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high ? _mm_unpackhi_epi64(v, v) : v));
}

/* A group of 16 rows (as two halves of 8, rows 8h..8h+7 of each line) against m activation
 * rows; per tile and pair of sub-blocks the byte products are summed in int16 or, with VNNI,
 * in int32. */
static inline __attribute__((always_inline)) void group_kt_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ssa,
    int64_t k, const int m, const int q5, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK, tb = KT_BYTES(q5);
    const __m256i low4 = _mm256_set1_epi8(0x0f), bit = _mm256_set1_epi8(1);
#if !defined(Q4K_VNNI)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    /* Both halves of the 16 rows in one pass for up to 2 activation rows (their sums fit
     * the registers), else one half per pass (the second finds the group in cache). */
    const int hp = m <= 2 ? 2 : 1;
    for (int h0 = 0; h0 < 2; h0 += hp) {
        __m256 acc[2][MAXM];
        for (int hh = 0; hh < hp; ++hh)
            for (int i = 0; i < m; ++i) acc[hh][i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; ++b) {
            const uint8_t *t = tiles + b * tb;
            if (h0 == 0)
                for (int64_t o = 0; o < tb; o += 64)
                    _mm_prefetch((const char *)(t + tb + o), _MM_HINT_T0);
            __m128i c[12];
            for (int j = 0; j < 12; ++j)
                c[j] = _mm_loadu_si128((const __m128i *)(t + 64 + 16 * j));
            __m256 d[2], dmin[2];
            for (int hh = 0; hh < hp; ++hh) {
                const int h = h0 + hh;
                d[hh] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
                dmin[hh] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * h)));
            }
            for (int tp = 0; tp < 4; ++tp) { /* sub-blocks 2tp (low nibbles), 2tp + 1 (high) */
                __m128i scb[2], mnb[2];
                for (int e = 0; e < 2; ++e) kt_scales(c, 2 * tp + e, &scb[e], &mnb[e]);
                /* [half][sub-block][activation row]: byte products summed in int16 (or by
                 * VNNI in int32), widened into dot: for Q5_K every 4 lines, as 8 of its sums
                 * could pass 32767 (2 * 31 * 127 each). */
                __m256i sum[2][2][MAXM], dot[2][2][MAXM];
                for (int hh = 0; hh < hp; ++hh)
                    for (int e = 0; e < 2; ++e)
                        for (int i = 0; i < m; ++i)
                            sum[hh][e][i] = dot[hh][e][i] = _mm256_setzero_si256();
                for (int g = 0; g < 8; ++g) {
                    __m256i a0[MAXM], a1[MAXM];
                    for (int i = 0; i < m; ++i) {
                        const int8_t *a = qa + i * k + b * 256 + 64 * tp + 4 * g;
                        a0[i] = _mm256_set1_epi32(act4(a));
                        a1[i] = _mm256_set1_epi32(act4(a + 32));
                    }
                    for (int hh = 0; hh < hp; ++hh) {
                        const __m256i l = _mm256_loadu_si256((const __m256i *)(
                            t + KT_QS(q5) + 64 * (8 * tp + g) + 32 * (h0 + hh)));
                        __m256i u0 = _mm256_and_si256(l, low4);
                        __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
                        if (q5) { /* bits 2tp and 2tp + 1 of qh: the fifth bits */
                            const __m256i qh = _mm256_loadu_si256(
                                (const __m256i *)(t + 256 + 64 * g + 32 * (h0 + hh)));
                            u0 = _mm256_or_si256(u0, _mm256_slli_epi16(_mm256_and_si256(
                                _mm256_srli_epi16(qh, 2 * tp), bit), 4));
                            u1 = _mm256_or_si256(u1, _mm256_slli_epi16(_mm256_and_si256(
                                _mm256_srli_epi16(qh, 2 * tp + 1), bit), 4));
                        }
                        for (int i = 0; i < m; ++i) {
#if defined(Q4K_VNNI)
                            sum[hh][0][i] = Q4K_VNNI(sum[hh][0][i], u0, a0[i]);
                            sum[hh][1][i] = Q4K_VNNI(sum[hh][1][i], u1, a1[i]);
#else
                            sum[hh][0][i] = _mm256_add_epi16(sum[hh][0][i],
                                                             _mm256_maddubs_epi16(u0, a0[i]));
                            sum[hh][1][i] = _mm256_add_epi16(sum[hh][1][i],
                                                             _mm256_maddubs_epi16(u1, a1[i]));
#endif
                            KEEP_IN_REG(sum[hh][0][i]);
                            KEEP_IN_REG(sum[hh][1][i]);
                        }
                    }
#if !defined(Q4K_VNNI)
                    if (g == 7 || (q5 && g == 3))
                        for (int hh = 0; hh < hp; ++hh)
                            for (int e = 0; e < 2; ++e)
                                for (int i = 0; i < m; ++i) {
                                    dot[hh][e][i] = _mm256_add_epi32(
                                        dot[hh][e][i], _mm256_madd_epi16(sum[hh][e][i], ones));
                                    sum[hh][e][i] = _mm256_setzero_si256();
                                }
#endif
                }
                for (int hh = 0; hh < hp; ++hh)
                    for (int e = 0; e < 2; ++e) {
                        const int64_t j = b * 8 + 2 * tp + e; /* activation block */
                        const __m256 dsc = _mm256_mul_ps(d[hh], u8x8_to_ps(scb[e], h0 + hh));
                        const __m256 dmn = _mm256_mul_ps(dmin[hh], u8x8_to_ps(mnb[e], h0 + hh));
                        for (int i = 0; i < m; ++i) {
#if defined(Q4K_VNNI)
                            dot[hh][e][i] = sum[hh][e][i];
#endif
                            acc[hh][i] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(dot[hh][e][i]),
                                _mm256_mul_ps(dsc, _mm256_set1_ps(sa[i * nb + j])), acc[hh][i]);
                            acc[hh][i] = _mm256_fnmadd_ps(dmn, _mm256_set1_ps(ssa[i * nb + j]),
                                                          acc[hh][i]);
                        }
                    }
            }
        }
        for (int hh = 0; hh < hp; ++hh)
            for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * (h0 + hh), acc[hh][i]);
    }
}
#else
/* Plain C: the same function, row by row. */
static inline void group_kt_m(const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                              const float *sa, const float *ssa, int64_t k, const int m,
                              const int q5, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK;
    for (int i = 0; i < m; ++i)
        for (int r = 0; r < GR; ++r) out[i][r] = 0.f;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * KT_BYTES(q5), *c = t + 64, *lines = t + KT_QS(q5);
        for (int r = 0; r < GR; ++r) {
            const float d = fp16_to_f32(t + 2 * r), dmin = fp16_to_f32(t + 32 + 2 * r);
            for (int j = 0; j < 8; ++j) {
                const int sc = j < 4 ? c[16 * j + r] & 63
                                     : (c[16 * (j + 4) + r] & 0x0f) |
                                           ((c[16 * (j - 4) + r] >> 6) << 4);
                const int mn = j < 4 ? c[16 * (j + 4) + r] & 63
                                     : (c[16 * (j + 4) + r] >> 4) | ((c[16 * j + r] >> 6) << 4);
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * j;
                    int32_t dot = 0;
                    for (int v = 0; v < 32; ++v) {
                        const int q = 32 * (j / 2) + v; /* byte of qs */
                        const uint8_t byte = lines[64 * (q / 4) + 4 * r + q % 4];
                        int u = (byte >> (4 * (j % 2))) & 0x0f;
                        if (q5) u |= ((t[256 + 64 * (v / 4) + 4 * r + v % 4] >> j) & 1) << 4;
                        dot += u * a[v];
                    }
                    out[i][r] += d * (float)sc * sa[i * nb + b * 8 + j] * (float)dot -
                                 dmin * (float)mn * ssa[i * nb + b * 8 + j];
                }
            }
        }
    }
}
#endif

/* Q4_K / Q5_K tiles (q5) of a group against m activation rows, m a constant per instance. */
static void group_kt(int q5, const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                     const float *sa, const float *ssa, int64_t k, int64_t m,
                     float out[MAXM_K][GR]) {
#define KT_CASE(M)                                                                              \
    (q5 ? group_kt_m(tiles, nsb, qa, sa, ssa, k, M, 1, out)                                     \
        : group_kt_m(tiles, nsb, qa, sa, ssa, k, M, 0, out))
    FOR_ROW_COUNT(m, KT_CASE)
#undef KT_CASE
}

/* ---- IQ4_XS in tiles of 16 rows --------------------------------------------------------
 * A super-block of 256 values per row: fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes
 * of nibbles; sub-block s (32 values) has the 6-bit scale ls = nibble s % 2 of scales_l[s / 2]
 * | bits 2s..2s+1 of scales_h << 4, and w = d (ls - 32) level[nibble], its value j the low
 * nibble of qs[16 s + j] and value 16 + j the high one (IQ4_NL's block, eight to a
 * super-block). A tile is one super-block of 16 rows regrouped (16 x 136 bytes): the 16 d,
 * the 16 scales_h, the 4 scales_l bytes as 4 lines of 16 (byte c of every row), then the
 * quants as lines of 64 bytes as the 32-value types' tiles hold them, so a sub-block is
 * IQ4_NL's four lines with a scale per row computed from the header. */
#define IQ4XS_TILE 2176 /* 16 x 136 */
#define IQ4XS_QS 128    /* offset of the quant lines in a tile */

#if ISA == 3
static inline __attribute__((always_inline)) void group_iq4xs_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ssa,
    int64_t k, const int m, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi32(3);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4NL_U));
    __m512 acc[MAXM_K];
    for (int i = 0; i < m; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * IQ4XS_TILE;
        if (m > 1) prefetch_tile_ahead(t, IQ4XS_TILE); /* one row: the hardware's alone */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(t + 32)));
        for (int s = 0; s < 8; ++s) {
            const __m512i sl = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(t + 64 + 16 * (s / 2))));
            const __m512i ls = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32(sl, 4 * (s % 2)), _mm512_set1_epi32(15)),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * s), three), 4));
            const __m512 dl =
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32))));
            const __m512 c = _mm512_mul_ps(dl, _mm512_set1_ps(-IQ4NL_OFFSET));
            __m512i sum[MAXM_K];
            for (int i = 0; i < m; ++i) sum[i] = _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j) {
                const __m512i l =
                    _mm512_loadu_si512((const void *)(t + IQ4XS_QS + 64 * (4 * s + j)));
                const __m512i u0 = _mm512_shuffle_epi8(lut, _mm512_and_si512(l, low4));
                const __m512i u1 =
                    _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(l, 4), low4));
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * s;
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u0, _mm512_set1_epi32(act4(a + 4 * j)));
                    sum[i] = _mm512_dpbusd_epi32(sum[i], u1,
                                                 _mm512_set1_epi32(act4(a + 16 + 4 * j)));
                    KEEP_IN_ZMM(sum[i]);
                }
            }
            const int64_t blk = b * 8 + s; /* activation block */
            for (int i = 0; i < m; ++i) {
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                         _mm512_mul_ps(dl, _mm512_set1_ps(sa[i * nb + blk])),
                                         acc[i]);
                acc[i] = _mm512_fmadd_ps(c, _mm512_set1_ps(ssa[i * nb + blk]), acc[i]);
            }
        }
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], acc[i]);
}
#elif ISA > 0
/* Eight rows per 256-bit vector (half h of a line: rows 8h..8h+7), IQ4_NL's signed levels
 * with their sign moved onto the activations, as the 32-value AVX2 body does. */
static inline __attribute__((always_inline)) void group_iq4xs_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ssa,
    int64_t k, const int m, float out[MAXM][GR]) {
    (void)ssa; /* signed levels: no offset term */
    const int64_t nb = k / QK;
    const __m256i low4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi32(3);
    const __m256i lv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4NL_LEVELS));
    __m256 acc[2][MAXM];
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < m; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * IQ4XS_TILE;
        for (int64_t o = 0; o < IQ4XS_TILE; o += 64)
            _mm_prefetch((const char *)(t + IQ4XS_TILE + o), _MM_HINT_T0);
        for (int s = 0; s < 8; ++s) {
            __m256i dot[2][MAXM];
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < m; ++i) dot[h][i] = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                __m256i alo[MAXM], ahi[MAXM];
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * s;
                    alo[i] = _mm256_set1_epi32(act4(a + 4 * j));
                    ahi[i] = _mm256_set1_epi32(act4(a + 16 + 4 * j));
                }
                for (int h = 0; h < 2; ++h) {
                    const __m256i l = _mm256_loadu_si256(
                        (const __m256i *)(t + IQ4XS_QS + 64 * (4 * s + j) + 32 * h));
                    const __m256i v0 = _mm256_shuffle_epi8(lv, _mm256_and_si256(l, low4));
                    const __m256i v1 = _mm256_shuffle_epi8(
                        lv, _mm256_and_si256(_mm256_srli_epi16(l, 4), low4));
                    const __m256i u0 = _mm256_sign_epi8(v0, v0), u1 = _mm256_sign_epi8(v1, v1);
                    for (int i = 0; i < m; ++i)
                        dot[h][i] = DOT_U8S8(DOT_U8S8(dot[h][i], u0, _mm256_sign_epi8(alo[i], v0)),
                                             u1, _mm256_sign_epi8(ahi[i], v1));
                }
            }
            const int64_t blk = b * 8 + s;
            for (int h = 0; h < 2; ++h) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
                const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * h)));
                const __m256i sl = _mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(t + 64 + 16 * (s / 2) + 8 * h)));
                const __m256i ls = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi32(sl, 4 * (s % 2)), _mm256_set1_epi32(15)),
                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * s), three), 4));
                const __m256 dl = _mm256_mul_ps(
                    d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
                for (int i = 0; i < m; ++i)
                    acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][i]),
                                                _mm256_mul_ps(dl, _mm256_set1_ps(sa[i * nb + blk])),
                                                acc[h][i]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * h, acc[h][i]);
}
#else
static void group_iq4xs_m(const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                          const float *sa, const float *ssa, int64_t k, int64_t m,
                          float out[MAXM][GR]) {
    (void)ssa;
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < m; ++i)
        for (int r = 0; r < GR; ++r) out[i][r] = 0.f;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * IQ4XS_TILE;
        for (int r = 0; r < GR; ++r) {
            const float d = fp16_to_f32(t + 2 * r);
            const int sh = t[32 + 2 * r] | t[33 + 2 * r] << 8;
            for (int s = 0; s < 8; ++s) {
                const int ls = ((t[64 + 16 * (s / 2) + r] >> (4 * (s % 2))) & 15) |
                               ((sh >> (2 * s)) & 3) << 4;
                const float dl = d * (float)(ls - 32);
                int32_t u[QK];
                for (int j = 0; j < 16; ++j) {
                    const uint8_t byte = t[IQ4XS_QS + 64 * (4 * s + j / 4) + 4 * r + j % 4];
                    u[j] = IQ4NL_LEVELS[byte & 0x0f];
                    u[j + 16] = IQ4NL_LEVELS[byte >> 4];
                }
                for (int64_t i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * s;
                    int32_t dot = 0;
                    for (int j = 0; j < QK; ++j) dot += u[j] * a[j];
                    out[i][r] += dl * sa[i * nb + b * 8 + s] * (float)dot;
                }
            }
        }
    }
}
#endif

/* IQ4_XS tiles of a group against m activation rows, m a constant per vector instance. */
static void group_iq4xs(const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa,
                        const float *ssa, int64_t k, int64_t m, float out[MAXM_K][GR]) {
#if ISA > 0
#define IQ4XS_CASE(M) group_iq4xs_m(tiles, nsb, qa, sa, ssa, k, M, out)
    FOR_ROW_COUNT(m, IQ4XS_CASE)
#undef IQ4XS_CASE
#else
    group_iq4xs_m(tiles, nsb, qa, sa, ssa, k, m, out);
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* dot + scale * (16 rows' 16 values u[0..3], 4 per lane each, . the 16 activation bytes at
 * a): the sub-blocks of 16 values of Q6_K, Q3_K and Q2_K, each weighted by its integer scale
 * (per row lane) before the block's float FMA. */
static inline __attribute__((always_inline)) __m512i scaled_dot16(__m512i dot, const __m512i u[4],
                                                                  const int8_t *a, __m512i scale) {
    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(act4(a)));
    p = _mm512_dpbusd_epi32(p, u[1], _mm512_set1_epi32(act4(a + 4)));
    p = _mm512_dpbusd_epi32(p, u[2], _mm512_set1_epi32(act4(a + 8)));
    p = _mm512_dpbusd_epi32(p, u[3], _mm512_set1_epi32(act4(a + 12)));
    return _mm512_add_epi32(dot, _mm512_mullo_epi32(p, scale));
}
#endif

/* ---- Q3_K and Q2_K in tiles of 16 rows ------------------------------------------------
 * Super-blocks of 256 values per row. Q3_K: hmask[32], qs[64], 12 bytes of 6-bit scales
 * (one per 16 values, minus 32), fp16 d; value 128h + 32g + i (h < 2, g < 4, i < 32) is bits
 * 2g..2g+1 of qs[32h + i] plus 4 * bit (4h + g) of hmask[i], minus 4; w = d sc q. Q2_K:
 * scales[16] (per 16 values: a 4-bit scale, then a 4-bit min), qs[64] as Q3_K's, fp16 d and
 * dmin; w = d sc q - dmin m. A tile (16 rows, regrouped) holds the 16 d [Q2_K: and the 16
 * dmin], the scale bytes as lines of 16 (byte c of every row: Q3_K 12, Q2_K 16), then [Q3_K:
 * hmask and] qs as lines of 64 bytes (bytes 4l..4l+3 of each row). As for Q6_K, the byte
 * products of 16 values are weighted by their integer scale, one float FMA per block of 32,
 * and the offset (Q3_K's 4 d sc, Q2_K's dmin m) is taken back from the activations' sums per
 * 16. q2 is a compile-time constant in each instance. */
#define Q2T_BYTES 1344 /* 16 x 84 */
#define Q2T_SC 64
#define Q2T_QS 320
#define LOWT_BYTES(q2) ((q2) ? Q2T_BYTES : Q3T_BYTES)
#define LOWT_QS(q2) ((q2) ? Q2T_QS : Q3T_QS)

#if ISA == 3
/* The 16 rows' scale of sub-block c (of 16 values) and the factor of its offset term: Q3_K
 * the scale minus 32 (its offset 4 d sc is taken back as 4 d times it), Q2_K the low nibble
 * and the min (times dmin). */
static inline void low_scales16(const uint8_t *t, int c, int q2, __m512i *sc, __m512i *off) {
    if (q2) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + Q2T_SC + 16 * c)));
        *sc = _mm512_and_si512(v, _mm512_set1_epi32(15));
        *off = _mm512_srli_epi32(v, 4);
        return;
    }
    *sc = q3k_scales16(t, c);
    *off = *sc;
}

static inline __attribute__((always_inline)) void group_lowk_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ss16,
    int64_t k, const int m, const int q2, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK, tb = LOWT_BYTES(q2);
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    __m512 acc[MAXM_K], fix[MAXM_K];
    for (int i = 0; i < m; ++i) acc[i] = fix[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * tb;
        if (m > 1) prefetch_tile_ahead(t, tb); /* one row: the hardware's alone */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        /* Q3_K: 4 d per unit of the offset factor; Q2_K: dmin */
        const __m512 dfix = q2 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + 32)))
                               : _mm512_mul_ps(d, _mm512_set1_ps(4.f));
        __m512i sc[16];
        __m512 corr[MAXM_K];
        for (int i = 0; i < m; ++i) corr[i] = _mm512_setzero_ps();
        for (int c = 0; c < 16; ++c) {
            __m512i off;
            low_scales16(t, c, q2, &sc[c], &off);
            const __m512 offf = _mm512_cvtepi32_ps(off);
            for (int i = 0; i < m; ++i)
                corr[i] = _mm512_fmadd_ps(offf, _mm512_set1_ps(ss16[2 * i * nb + 16 * b + c]),
                                          corr[i]);
        }
        for (int i = 0; i < m; ++i) fix[i] = _mm512_fmadd_ps(corr[i], dfix, fix[i]);
        for (int j = 0; j < 8; ++j) { /* block of 32: half h, group g */
            const int h = j / 4, g = j % 4;
            __m512i dot[MAXM_K];
            for (int i = 0; i < m; ++i) dot[i] = _mm512_setzero_si512();
            for (int hs = 0; hs < 2; ++hs) { /* 16 values: 4 lines, one scale */
                __m512i u[4];
                for (int e = 0; e < 4; ++e) {
                    const int l = 4 * hs + e; /* values 4l..4l+3 of the block */
                    const __m512i q = _mm512_loadu_si512((const void *)(t + LOWT_QS(q2) + 64 * (8 * h + l)));
                    u[e] = _mm512_and_si512(_mm512_srli_epi16(q, 2 * g), three);
                    if (!q2) {
                        const __m512i hm = _mm512_loadu_si512((const void *)(t + Q3T_HM + 64 * l));
                        const __m512i hb = j <= 2 ? _mm512_slli_epi16(hm, 2 - j)
                                                  : _mm512_srli_epi16(hm, j - 2);
                        u[e] = _mm512_or_si512(u[e], _mm512_and_si512(hb, four));
                    }
                }
                const __m512i scale = sc[2 * j + hs];
                for (int i = 0; i < m; ++i) {
                    dot[i] = scaled_dot16(dot[i], u, qa + i * k + b * 256 + 32 * j + 16 * hs,
                                          scale);
                    KEEP_IN_ZMM(dot[i]);
                }
            }
            for (int i = 0; i < m; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]),
                                         _mm512_mul_ps(d, _mm512_set1_ps(sa[i * nb + b * 8 + j])),
                                         acc[i]);
        }
    }
    for (int i = 0; i < m; ++i) _mm512_storeu_ps(out[i], _mm512_sub_ps(acc[i], fix[i]));
}
#elif ISA > 0
/* low_scales16 for the 8 rows of half hf. */
static inline void low_scales8(const uint8_t *t, int c, int hf, int q2, __m256i *sc,
                               __m256i *off) {
    if (q2) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(t + Q2T_SC + 16 * c + 8 * hf)));
        *sc = _mm256_and_si256(v, _mm256_set1_epi32(15));
        *off = _mm256_srli_epi32(v, 4);
        return;
    }
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(t + Q3T_SC + 16 * (c % 8) + 8 * hf)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(t + Q3T_SC + 16 * (8 + c % 4) + 8 * hf)));
    const __m256i low4 = c < 8 ? _mm256_and_si256(lo, _mm256_set1_epi32(15)) : _mm256_srli_epi32(lo, 4);
    const __m256i high2 = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * (c / 4)), _mm256_set1_epi32(3));
    *sc = _mm256_sub_epi32(_mm256_or_si256(low4, _mm256_slli_epi32(high2, 4)), _mm256_set1_epi32(32));
    *off = *sc;
}

/* Eight rows per 256-bit vector, one half of the 16 rows per pass (the second finds the tile
 * in cache). */
static inline __attribute__((always_inline)) void group_lowk_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ss16,
    int64_t k, const int m, const int q2, float out[MAXM][GR]) {
    const int64_t nb = k / QK, tb = LOWT_BYTES(q2);
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int hf = 0; hf < 2; ++hf) {
        __m256 acc[MAXM], fix[MAXM];
        for (int i = 0; i < m; ++i) acc[i] = fix[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; ++b) {
            const uint8_t *t = tiles + b * tb;
            if (hf == 0)
                for (int64_t o = 0; o < tb; o += 64)
                    _mm_prefetch((const char *)(t + tb + o), _MM_HINT_T0);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * hf)));
            const __m256 dfix =
                q2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * hf)))
                   : _mm256_mul_ps(d, _mm256_set1_ps(4.f));
            __m256i sc[16];
            __m256 corr[MAXM];
            for (int i = 0; i < m; ++i) corr[i] = _mm256_setzero_ps();
            for (int c = 0; c < 16; ++c) {
                __m256i off;
                low_scales8(t, c, hf, q2, &sc[c], &off);
                const __m256 offf = _mm256_cvtepi32_ps(off);
                for (int i = 0; i < m; ++i)
                    corr[i] = _mm256_fmadd_ps(offf, _mm256_set1_ps(ss16[2 * i * nb + 16 * b + c]),
                                              corr[i]);
            }
            for (int i = 0; i < m; ++i) fix[i] = _mm256_fmadd_ps(corr[i], dfix, fix[i]);
            for (int j = 0; j < 8; ++j) {
                const int h = j / 4, g = j % 4;
                __m256i dot[MAXM];
                for (int i = 0; i < m; ++i) dot[i] = _mm256_setzero_si256();
                for (int hs = 0; hs < 2; ++hs) {
                    __m256i u[4];
                    for (int e = 0; e < 4; ++e) {
                        const int l = 4 * hs + e;
                        const __m256i q = _mm256_loadu_si256(
                            (const __m256i *)(t + LOWT_QS(q2) + 64 * (8 * h + l) + 32 * hf));
                        u[e] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), three);
                        if (!q2) {
                            const __m256i hm = _mm256_loadu_si256(
                                (const __m256i *)(t + Q3T_HM + 64 * l + 32 * hf));
                            const __m256i hb = j <= 2 ? _mm256_slli_epi16(hm, 2 - j)
                                                      : _mm256_srli_epi16(hm, j - 2);
                            u[e] = _mm256_or_si256(u[e], _mm256_and_si256(hb, four));
                        }
                    }
                    const __m256i scale = sc[2 * j + hs];
                    for (int i = 0; i < m; ++i) {
                        const int8_t *a = qa + i * k + b * 256 + 32 * j + 16 * hs;
                        __m256i p = _mm256_setzero_si256();
                        for (int e = 0; e < 4; ++e)
                            p = DOT_U8S8(p, u[e], _mm256_set1_epi32(act4(a + 4 * e)));
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_mullo_epi32(p, scale));
                    }
                }
                for (int i = 0; i < m; ++i)
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]),
                                             _mm256_mul_ps(d, _mm256_set1_ps(sa[i * nb + b * 8 + j])),
                                             acc[i]);
            }
        }
        for (int i = 0; i < m; ++i) _mm256_storeu_ps(out[i] + 8 * hf, _mm256_sub_ps(acc[i], fix[i]));
    }
}
#else
static void group_lowk_m(const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa,
                         const float *ss16, int64_t k, int64_t m, int q2, float out[MAXM][GR]) {
    (void)ss16;
    const int64_t nb = k / QK, tb = LOWT_BYTES(q2);
    for (int64_t i = 0; i < m; ++i)
        for (int r = 0; r < GR; ++r) out[i][r] = 0.f;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * tb;
        for (int r = 0; r < GR; ++r) {
            const float d = fp16_to_f32(t + 2 * r), dmin = q2 ? fp16_to_f32(t + 32 + 2 * r) : 0.f;
            for (int c = 0; c < 16; ++c) { /* 16 values: 128h + 32g + 16 (c % 2) + i */
                int sc, mn = 0;
                if (q2) {
                    sc = t[Q2T_SC + 16 * c + r] & 15;
                    mn = t[Q2T_SC + 16 * c + r] >> 4;
                } else {
                    const uint8_t s_lo = t[Q3T_SC + 16 * (c % 8) + r];
                    const uint8_t s_hi = t[Q3T_SC + 16 * (8 + c % 4) + r];
                    sc = ((c < 8 ? s_lo & 15 : s_lo >> 4) | ((s_hi >> (2 * (c / 4))) & 3) << 4) - 32;
                }
                const int j = c / 2, h = j / 4, g = j % 4;
                for (int64_t i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 16 * c;
                    int32_t dot = 0, asum = 0;
                    for (int v = 0; v < 16; ++v) {
                        const int x = 16 * (c % 2) + v; /* i of the block */
                        const uint8_t qb = t[LOWT_QS(q2) + 64 * (8 * h + x / 4) + 4 * r + x % 4];
                        int q = (qb >> (2 * g)) & 3;
                        if (!q2) q = (q | ((t[Q3T_HM + 64 * (x / 4) + 4 * r + x % 4] >> j) & 1) << 2) - 4;
                        dot += q * a[v];
                        asum += a[v];
                    }
                    const float s = sa[i * nb + b * 8 + j];
                    out[i][r] += d * (float)sc * s * (float)dot - dmin * (float)mn * s * (float)asum;
                }
            }
        }
    }
}
#endif

/* Q3_K (q2 = 0) or Q2_K tiles of a group against m activation rows, m a constant per vector
 * instance. */
static void group_lowk(int q2, const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                       const float *sa, const float *ss16, int64_t k, int64_t m,
                       float out[MAXM_K][GR]) {
#if ISA > 0
#define LOWK_CASE(M)                                                                              \
    (q2 ? group_lowk_m(tiles, nsb, qa, sa, ss16, k, M, 1, out)                                  \
        : group_lowk_m(tiles, nsb, qa, sa, ss16, k, M, 0, out))
    FOR_ROW_COUNT(m, LOWK_CASE)
#undef LOWK_CASE
#else
    group_lowk_m(tiles, nsb, qa, sa, ss16, k, m, q2, out);
#endif
}

/* ---- Q6_K in tiles of 16 rows, for matmuls of many rows -----------------------------------
 * A super-block of 256 values per row: ql[128], qh[64], 16 int8 scales (one per 16 values),
 * fp16 d; in half f (128 values) value 32g + l (g < 4, l < 32) is nibble g / 2 of
 * ql[64f + 32 (g % 2) + l] plus 16 * bits 2g..2g+1 of qh[32f + l], minus 32, with scale
 * sc[8f + 2g + l / 16]; w = d sc q. A tile (16 x 210 bytes, regrouped) holds the 16 d, the
 * 16 scale bytes as 16 lines of 16, then ql and qh as lines of 64 bytes (bytes 4l..4l+3 of
 * each row). The byte products are weighted by the row's sub-block scale in the madd that
 * widens them, so a block of 32 needs one float multiply per row; the offset 32 is taken
 * back from the activations' sums per 16. Q6_K weights are held in these tiles from load
 * (forerun/model/quant/gguf_blocks.py), for one row as for many: with the 512-bit body the
 * tiles beat the row kernel it ran in before at every row count (one core, 2048 x 8192:
 * 1.2-1.4x at one row, 2.6-3.3x at eight). */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
/* All 16 rows of a line in one 512-bit vector, against m activation rows: per 16 values
 * (four lines, one scale) each row's four VNNI byte dot products are summed in int32 and
 * weighted by the scale in one integer multiply; per block of 32 one float FMA (d s_j). The
 * offset 32 is taken back from the activations' sums per 16, as in the 256-bit body below. */
static inline __attribute__((always_inline)) void group_q6k_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ss16,
    int64_t k, const int m, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0f), hi2 = _mm512_set1_epi8(0x30);
    __m512 acc[MAXM_K], fix[MAXM_K];
    for (int i = 0; i < m; ++i) acc[i] = fix[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * Q6T_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        __m512i sc[16];
        for (int c = 0; c < 16; ++c)
            sc[c] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + 32 + 16 * c)));
        __m512 corr[MAXM_K];
        for (int i = 0; i < m; ++i) corr[i] = _mm512_setzero_ps();
        for (int c = 0; c < 16; ++c) {
            const __m512 scf = _mm512_cvtepi32_ps(sc[c]);
            for (int i = 0; i < m; ++i)
                corr[i] = _mm512_fmadd_ps(scf, _mm512_set1_ps(ss16[2 * i * nb + 16 * b + c]),
                                          corr[i]);
        }
        for (int i = 0; i < m; ++i) fix[i] = _mm512_fmadd_ps(corr[i], d, fix[i]);
        for (int j = 0; j < 8; ++j) { /* block of 32: half f, block q of the half */
            const int f = j / 4, q = j % 4;
            for (int64_t o = 448 * j; o < 448 * (j + 1) && o < Q6T_BYTES; o += 64) /* 7 lines */
                _mm_prefetch((const char *)(t + PF_BYTES + o), _MM_HINT_T1);
            __m512i dot[MAXM_K];
            for (int i = 0; i < m; ++i) dot[i] = _mm512_setzero_si512();
            for (int hs = 0; hs < 2; ++hs) { /* 16 values: lines 4hs..4hs+3, one scale */
                __m512i u[4];
                for (int e = 0; e < 4; ++e) {
                    const int g = 4 * hs + e;
                    const __m512i l = _mm512_loadu_si512(
                        (const void *)(t + Q6T_QL + 64 * (16 * f + 8 * (q % 2) + g)));
                    const __m512i qh =
                        _mm512_loadu_si512((const void *)(t + Q6T_QH + 64 * (8 * f + g)));
                    const __m512i lo = q / 2 ? _mm512_and_si512(_mm512_srli_epi16(l, 4), low4)
                                             : _mm512_and_si512(l, low4);
                    const __m512i hb = q == 0   ? _mm512_slli_epi16(qh, 4)
                                       : q == 1 ? _mm512_slli_epi16(qh, 2)
                                       : q == 2 ? qh
                                                : _mm512_srli_epi16(qh, 2);
                    u[e] = _mm512_or_si512(lo, _mm512_and_si512(hb, hi2));
                }
                const __m512i s = sc[2 * j + hs];
                for (int i = 0; i < m; ++i) {
                    dot[i] = scaled_dot16(dot[i], u, qa + i * k + b * 256 + 32 * j + 16 * hs, s);
                    KEEP_IN_ZMM(dot[i]);
                }
            }
            for (int i = 0; i < m; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]),
                                         _mm512_mul_ps(d, _mm512_set1_ps(sa[i * nb + b * 8 + j])),
                                         acc[i]);
        }
    }
    for (int i = 0; i < m; ++i)
        _mm512_storeu_ps(out[i], _mm512_fnmadd_ps(fix[i], _mm512_set1_ps(32.f), acc[i]));
}
/* One activation row (a decode step's GEMV): per 4 values of a half-super-block the two ql
 * lines and the qh line are read once and give the values of all four of its blocks (the
 * body above reads the ql line twice and the qh line four times), four independent VNNI
 * chains, one per block (one core, 8192 x 2048 in L3: 1.23x the body above). The body
 * above keeps its block-by-block order because four blocks' sums per activation row would
 * not fit the registers at 8 rows. The same integer sums and float terms in the same order
 * as the body above. */
#define Q6K_ONE 1
static inline void group_q6k_one(const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                                 const float *sa, const float *ss16, float out[MAXM_K][GR]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), hi2 = _mm512_set1_epi8(0x30);
    __m512 acc = _mm512_setzero_ps(), fix = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * Q6T_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t));
        __m512 corr = _mm512_setzero_ps();
        for (int c = 0; c < 16; ++c)
            corr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128((const __m128i *)(t + 32 + 16 * c)))),
                                   _mm512_set1_ps(ss16[16 * b + c]), corr);
        fix = _mm512_fmadd_ps(corr, d, fix);
        for (int f = 0; f < 2; ++f) {
            __m512i dot[4];
            for (int q = 0; q < 4; ++q) dot[q] = _mm512_setzero_si512();
            for (int hs = 0; hs < 2; ++hs) { /* 16 values, one scale per block */
                __m512i p[4];
                for (int e = 0; e < 4; ++e) {
                    const int g = 4 * hs + e;
                    for (int64_t o = 256 * (8 * f + g); o < 256 * (8 * f + g + 1) && o < Q6T_BYTES;
                         o += 64)
                        _mm_prefetch((const char *)(t + PF_BYTES + o), _MM_HINT_T1);
                    const __m512i l0 =
                        _mm512_loadu_si512((const void *)(t + Q6T_QL + 64 * (16 * f + g)));
                    const __m512i l1 =
                        _mm512_loadu_si512((const void *)(t + Q6T_QL + 64 * (16 * f + 8 + g)));
                    const __m512i qh =
                        _mm512_loadu_si512((const void *)(t + Q6T_QH + 64 * (8 * f + g)));
                    /* Block q takes bits 2q..2q+1 of qh as its bits 4-5. */
                    const __m512i u[4] = {
                        _mm512_or_si512(_mm512_and_si512(l0, low4),
                                        _mm512_and_si512(_mm512_slli_epi16(qh, 4), hi2)),
                        _mm512_or_si512(_mm512_and_si512(l1, low4),
                                        _mm512_and_si512(_mm512_slli_epi16(qh, 2), hi2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4),
                                        _mm512_and_si512(qh, hi2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                                        _mm512_and_si512(_mm512_srli_epi16(qh, 2), hi2))};
                    const int8_t *a = qa + b * 256 + 128 * f + 4 * g;
                    for (int q = 0; q < 4; ++q)
                        p[q] = _mm512_dpbusd_epi32(e ? p[q] : _mm512_setzero_si512(), u[q],
                                                   _mm512_set1_epi32(act4(a + 32 * q)));
                }
                for (int q = 0; q < 4; ++q) {
                    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                        (const __m128i *)(t + 32 + 16 * (2 * (4 * f + q) + hs))));
                    dot[q] = _mm512_add_epi32(dot[q], _mm512_mullo_epi32(p[q], s));
                    KEEP_IN_ZMM(dot[q]);
                }
            }
            for (int q = 0; q < 4; ++q)
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[q]),
                                      _mm512_mul_ps(d, _mm512_set1_ps(sa[b * 8 + 4 * f + q])), acc);
        }
    }
    _mm512_storeu_ps(out[0], _mm512_fnmadd_ps(fix, _mm512_set1_ps(32.f), acc));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* The int8 scale bytes of rows 8h..8h+7 as int32 lanes (for the float correction); pair16
 * makes each lane the int16 pair (s, s) that madd takes. */
static inline __m256i q6_scales(const uint8_t *line, int h) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(line + 8 * h)));
}
static inline __m256i pair16(__m256i s) {
    return _mm256_blend_epi16(s, _mm256_slli_epi32(s, 16), 0xaa);
}

/* One half of the 16 rows (8 lanes) against m activation rows, block of 32 by block of 32:
 * a line of ql and one of qh give the block's 4 values of 8 rows (4 ops, shared by the m
 * rows); each activation row takes one maddubs per line, two lines summed in int16
 * (2 * 2 * 63 * 127 < 32767) and weighted by their sub-block's scale in the madd that widens
 * them, the block's int32 sum then one float FMA (d s_j). Per activation row that is one
 * int32 and one float accumulator, so m = 4 keeps every sum in a register (the former body
 * held 16 int16 sums per half, 4 blocks at once, which spilled: this one is 1.02-1.08x as
 * fast at 64 and 512 rows, one core). */
static inline __attribute__((always_inline)) void group_q6k_m(
    const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa, const float *ss16,
    int64_t k, const int m, float out[MAXM_K][GR]) {
    const int64_t nb = k / QK;
    const __m256i low4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
    /* One half of the 16 rows per pass (the second finds the tile in cache); one activation
     * row takes group_q6k_one, which reads both halves of a tile in turn. */
    const int hp = 1;
    for (int h0 = 0; h0 < 2; h0 += hp) {
        __m256 acc[2][MAXM], fix[2][MAXM];
        for (int hh = 0; hh < hp; ++hh)
            for (int i = 0; i < m; ++i) acc[hh][i] = fix[hh][i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; ++b) {
            const uint8_t *t = tiles + b * Q6T_BYTES;
            if (h0 == 0)
                for (int64_t o = 0; o < Q6T_BYTES; o += 64)
                    _mm_prefetch((const char *)(t + Q6T_BYTES + o), _MM_HINT_T0);
            for (int hh = 0; hh < hp; ++hh) {
                const int h = h0 + hh;
                const __m256 d =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
                /* The offset: the sum over sub-blocks c of sc_c * (s * sum of the 16 q),
                 * times 32 d (taken back at the end). */
                __m256 corr[MAXM];
                for (int i = 0; i < m; ++i) corr[i] = _mm256_setzero_ps();
                for (int c = 0; c < 16; ++c) {
                    const __m256 scf = _mm256_cvtepi32_ps(q6_scales(t + 32 + 16 * c, h));
                    for (int i = 0; i < m; ++i)
                        corr[i] = _mm256_fmadd_ps(
                            scf, _mm256_set1_ps(ss16[2 * i * nb + 16 * b + c]), corr[i]);
                }
                for (int i = 0; i < m; ++i)
                    fix[hh][i] = _mm256_fmadd_ps(corr[i], d, fix[hh][i]);
            }
            /* Unrolled, each block's shifts of qh are constants (its bits 2q..2q+1): 2-8 rows
             * on 2 cores went 1.2-1.3x (4 x 8192 x 2048, from DRAM). */
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) { /* block of 32: half f, block q of the half */
                const int f = j / 4, q = j % 4;
                __m256i dot[2][MAXM];
                for (int hh = 0; hh < hp; ++hh)
                    for (int i = 0; i < m; ++i) dot[hh][i] = _mm256_setzero_si256();
                for (int gg = 0; gg < 4; ++gg) { /* lines 2gg, 2gg + 1: 8 values, one scale */
                    for (int hh = 0; hh < hp; ++hh) {
                        const int h = h0 + hh;
                        const __m256i sc =
                            pair16(q6_scales(t + 32 + 16 * (2 * j + gg / 2), h));
                        __m256i u[2];
                        for (int e = 0; e < 2; ++e) {
                            const int g = 2 * gg + e;
                            const __m256i l = _mm256_loadu_si256((const __m256i *)(
                                t + Q6T_QL + 64 * (16 * f + 8 * (q % 2) + g) + 32 * h));
                            const __m256i qh = _mm256_loadu_si256(
                                (const __m256i *)(t + Q6T_QH + 64 * (8 * f + g) + 32 * h));
                            const __m256i lo =
                                q / 2 ? _mm256_and_si256(_mm256_srli_epi16(l, 4), low4)
                                      : _mm256_and_si256(l, low4);
                            /* Block q takes bits 2q..2q+1 of qh as its bits 4-5. */
                            const __m256i hb = q == 0   ? _mm256_slli_epi16(qh, 4)
                                               : q == 1 ? _mm256_slli_epi16(qh, 2)
                                               : q == 2 ? qh
                                                        : _mm256_srli_epi16(qh, 2);
                            u[e] = _mm256_or_si256(lo, _mm256_and_si256(hb, hi2));
                        }
                        for (int i = 0; i < m; ++i) {
                            const int8_t *a = qa + i * k + b * 256 + 32 * j + 8 * gg;
                            const __m256i s16 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(act4(a))),
                                _mm256_maddubs_epi16(u[1], _mm256_set1_epi32(act4(a + 4))));
                            dot[hh][i] = _mm256_add_epi32(dot[hh][i], _mm256_madd_epi16(s16, sc));
                            KEEP_IN_REG(dot[hh][i]);
                        }
                    }
                }
                for (int hh = 0; hh < hp; ++hh) {
                    const __m256 d =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * (h0 + hh))));
                    for (int i = 0; i < m; ++i)
                        acc[hh][i] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(dot[hh][i]),
                            _mm256_mul_ps(d, _mm256_set1_ps(sa[i * nb + b * 8 + j])),
                            acc[hh][i]);
                }
            }
        }
        for (int hh = 0; hh < hp; ++hh)
            for (int i = 0; i < m; ++i)
                _mm256_storeu_ps(out[i] + 8 * (h0 + hh),
                                 _mm256_fnmadd_ps(fix[hh][i], _mm256_set1_ps(32.f), acc[hh][i]));
    }
}

/* One activation row (a decode step's GEMV), half of the rows at a time: per 8 values of
 * the half-super-block f, the two ql lines and the qh line are read once and give the values
 * of all four of its blocks (the body above reads and unpacks them once per block); each
 * block's two lines of products summed in int16 and weighted by their scale in the madd that
 * widens them, the scales made once per super-block, both halves of a tile in turn (the
 * second reads it from cache), the tiles ahead prefetched a line group per step
 * (prefetch_spread). The same integer sums and float terms in the same order as the body
 * above, which now takes 2 rows and more. */
#define Q6K_ONE 1
static inline void group_q6k_one(const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                                 const float *sa, const float *ss16, float out[MAXM_K][GR]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
    __m256 acc[2], fix[2];
    for (int h = 0; h < 2; ++h) acc[h] = fix[h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * Q6T_BYTES;
        for (int h = 0; h < 2; ++h) { /* the second half finds the tile in cache */
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + 16 * h)));
            __m256i scp[16];
            __m256 corr = _mm256_setzero_ps();
            for (int c = 0; c < 16; ++c) {
                const __m256i s32 = q6_scales(t + 32 + 16 * c, h);
                scp[c] = pair16(s32);
                corr = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32),
                                       _mm256_set1_ps(ss16[16 * b + c]), corr);
            }
            fix[h] = _mm256_fmadd_ps(corr, d, fix[h]);
            for (int f = 0; f < 2; ++f) {
                __m256i dot[4];
                for (int q = 0; q < 4; ++q) dot[q] = _mm256_setzero_si256();
                for (int gg = 0; gg < 4; ++gg) {
                    prefetch_spread(t + PF_AHEAD * Q6T_BYTES, 8 * h + 4 * f + gg, 4, Q6T_BYTES);
                    __m256i p[4];
                    for (int e = 0; e < 2; ++e) {
                        const int g = 2 * gg + e;
                        const __m256i l0 = _mm256_loadu_si256(
                            (const __m256i *)(t + Q6T_QL + 64 * (16 * f + g) + 32 * h));
                        const __m256i l1 = _mm256_loadu_si256(
                            (const __m256i *)(t + Q6T_QL + 64 * (16 * f + 8 + g) + 32 * h));
                        const __m256i qh = _mm256_loadu_si256(
                            (const __m256i *)(t + Q6T_QH + 64 * (8 * f + g) + 32 * h));
                        /* Block q takes bits 2q..2q+1 of qh as its bits 4-5. */
                        const __m256i u[4] = {
                            _mm256_or_si256(_mm256_and_si256(l0, low4),
                                            _mm256_and_si256(_mm256_slli_epi16(qh, 4), hi2)),
                            _mm256_or_si256(_mm256_and_si256(l1, low4),
                                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), hi2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                            _mm256_and_si256(qh, hi2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), hi2))};
                        const int8_t *a = qa + b * 256 + 128 * f + 4 * g;
                        for (int q = 0; q < 4; ++q) {
                            const __m256i pr =
                                _mm256_maddubs_epi16(u[q], _mm256_set1_epi32(act4(a + 32 * q)));
                            p[q] = e ? _mm256_add_epi16(p[q], pr) : pr;
                        }
                    }
                    for (int q = 0; q < 4; ++q) {
                        dot[q] = _mm256_add_epi32(
                            dot[q], _mm256_madd_epi16(p[q], scp[2 * (4 * f + q) + gg / 2]));
                        KEEP_IN_REG(dot[q]);
                    }
                }
                for (int q = 0; q < 4; ++q)
                    acc[h] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot[q]),
                        _mm256_mul_ps(d, _mm256_set1_ps(sa[b * 8 + 4 * f + q])), acc[h]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(out[0] + 8 * h, _mm256_fnmadd_ps(fix[h], _mm256_set1_ps(32.f), acc[h]));
}
#else
static inline void group_q6k_m(const uint8_t *tiles, int64_t nsb, const int8_t *qa,
                               const float *sa, const float *ss16, int64_t k, const int m,
                               float out[MAXM_K][GR]) {
    const int64_t nb = k / QK;
    (void)ss16;
    for (int i = 0; i < m; ++i)
        for (int r = 0; r < GR; ++r) out[i][r] = 0.f;
    for (int64_t b = 0; b < nsb; ++b) {
        const uint8_t *t = tiles + b * Q6T_BYTES;
        for (int r = 0; r < GR; ++r) {
            const float d = fp16_to_f32(t + 2 * r);
            for (int j = 0; j < 8; ++j) { /* block of 32: half f, group g */
                const int f = j / 4, g = j % 4;
                for (int i = 0; i < m; ++i) {
                    const int8_t *a = qa + i * k + b * 256 + 32 * j;
                    float sum = 0.f;
                    for (int half = 0; half < 2; ++half) {
                        const int sc = (int8_t)t[32 + 16 * (8 * f + 2 * g + half) + r];
                        int32_t dot = 0;
                        for (int l = 16 * half; l < 16 * half + 16; ++l) {
                            const int ql = 64 * f + 32 * (g % 2) + l, qh = 32 * f + l;
                            const int low = (t[Q6T_QL + 64 * (ql / 4) + 4 * r + ql % 4] >>
                                             (4 * (g / 2))) & 0x0f;
                            const int high = (t[Q6T_QH + 64 * (qh / 4) + 4 * r + qh % 4] >>
                                              (2 * g)) & 3;
                            dot += ((low | (high << 4)) - 32) * a[l];
                        }
                        sum += (float)(sc * dot);
                    }
                    out[i][r] += d * sa[i * nb + b * 8 + j] * sum;
                }
            }
        }
    }
}
#endif

static void group_q6k(const uint8_t *tiles, int64_t nsb, const int8_t *qa, const float *sa,
                      const float *ss16, int64_t k, int64_t m, float out[MAXM_K][GR]) {
    switch (m) {
#ifdef Q6K_ONE
    case 1: group_q6k_one(tiles, nsb, qa, sa, ss16, out); return;
#else
    case 1: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 1, out); return;
#endif
    case 2: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 2, out); return;
    case 3: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 3, out); return;
#if MAXM_K > 4
    case 4: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 4, out); return;
    case 5: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 5, out); return;
    case 6: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 6, out); return;
    case 7: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 7, out); return;
    default: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 8, out); return;
#else
    default: group_q6k_m(tiles, nsb, qa, sa, ss16, k, 4, out); return;
#endif
    }
}

/* 3: AVX512-VNNI, 2: AVX-VNNI (256-bit), 1: AVX2, 0: plain C (for tests and logs). */
int quant_matmul_isa(void) { return ISA; }

/* A grow-only scratch buffer per calling thread: a prefill step's activations, quantized,
 * are megabytes, and fresh pages for them on every call cost page faults (a 2048-token
 * step's gate/up took 257 ms through a malloc'd float copy in and out against 182 ms here). */
static void *thread_scratch(size_t bytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        cap = bytes + bytes / 4;
        buf = aligned_alloc(64, (cap + 63) & ~(size_t)63);
        if (!buf) cap = 0;
    }
    return buf;
}

#ifdef KTILE_EXPANDED
/* A grow-only buffer per worker thread for a group's expanded tiles (ktile_gemm.c): up to
 * 200 KB for a row of 8192 values, filled once per group and call. */
static uint8_t *expand_scratch(size_t bytes) {
    static __thread uint8_t *buf = NULL;
    static __thread size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 63) & ~(size_t)63;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}
#endif

/* Row t of a group's results into y (float32 or bfloat16, row stride ldy), plus the bias
 * (y's type) of those columns. */
static inline void store_row(const float *v, int64_t rows, void *y, int y_bf16, int64_t off,
                             const void *bias, int64_t col) {
    if (y_bf16) {
        uint16_t *dst = (uint16_t *)y + off;
        const uint16_t *b = bias ? (const uint16_t *)bias + col : NULL;
#if defined(__AVX512BF16__)
        if (rows == GR) { /* a whole group: one vector */
            __m512 f = _mm512_loadu_ps(v);
            if (b) f = _mm512_add_ps(f, bf16x16_load(b));
            _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(f));
            return;
        }
#elif defined(__AVX2__)
        if (rows == GR) { /* a whole group: two vectors (the scalar loop cost 25% of a GEMV) */
            for (int h = 0; h < 2; ++h) {
                __m256 f = _mm256_loadu_ps(v + 8 * h);
                if (b) f = _mm256_add_ps(f, bf16x8_load(b + 8 * h));
                _mm_storeu_si128((__m128i *)(dst + 8 * h), f32x8_to_bf16(f));
            }
            return;
        }
#endif
        for (int64_t r = 0; r < rows; ++r)
            dst[r] = f32_to_bf16(v[r] + (b ? bf16_to_f32(b[r]) : 0.f));
    } else {
        float *dst = (float *)y + off;
        const float *b = bias ? (const float *)bias + col : NULL;
        for (int64_t r = 0; r < rows; ++r) dst[r] = v[r] + (b ? b[r] : 0.f);
    }
}

/* See qweight.h; gguf_matmul.c is the entry point that calls this. */
int quant_matmul_rows(const float *xf, const qweight_t *w, float *y, int64_t ldy, int64_t m,
                      int64_t k) {
    return quant_matmul_rows_io(xf, 0, w, y, 0, NULL, ldy, m, k);
}

int quant_matmul_rows_io(const void *x, int x_bf16, const qweight_t *w, void *y, int y_bf16,
                         const void *bias, int64_t ldy, int64_t m, int64_t k) {
    if (k % QK || w->nparts < 1 || w->nparts > QW_MAXPARTS) return -2;
    int64_t total = 0, groups = 0;
    int64_t first_group[QW_MAXPARTS + 1], first_row[QW_MAXPARTS];
    for (int64_t p = 0; p < w->nparts; ++p) {
        if (!block_bytes(w->type[p]) || w->rows[p] < 1 || k % block_values(w->type[p]))
            return -2;
        first_group[p] = groups;
        first_row[p] = total;
        groups += (w->rows[p] + GR - 1) / GR;
        total += w->rows[p];
    }
    first_group[w->nparts] = groups;
    if (x_bf16 && m >= QAMX_MIN_ROWS) {
        const int rc = quant_matmul_amx(x, w, y, y_bf16, bias, ldy, m, k);
        if (rc != -2) return rc;
    }
    const int64_t nb = k / QK;
    int with16 = 0, plus128 = 0; /* the sums per 16 (Q6_K, Q3_K, Q2_K); see ubytes */
    for (int64_t p = 0; p < w->nparts; ++p) {
        const int64_t t = w->type[p];
        with16 |= t == QT_Q6_K || t == QT_Q3_K || t == QT_Q2_K;
#ifdef KTILE_512 /* its expanded Q6_K body (Q3_K's too) multiplies the activations plus 128 */
        plus128 |= (t == QT_Q6_K || t == QT_Q3_K) && m >= ktile_min_rows(t);
#endif
    }
    /* One allocation: quantized rows, [the same plus 128 for the expanded Q6_K body,] then
     * scales and scaled sums (per 32, [per 16]). */
    const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    const size_t ubytes = plus128 ? qbytes : 0;
    char *scratch = thread_scratch(qbytes + ubytes +
                                   sizeof(float) * (size_t)((with16 ? 4 : 2) * m * nb));
    if (!scratch) return -1;
    int8_t *qa = (int8_t *)scratch, *qu = ubytes ? (int8_t *)scratch + qbytes : NULL;
    float *sa = (float *)(scratch + qbytes + ubytes), *ssa = sa + m * nb;
    float *ss16 = with16 ? ssa + m * nb : NULL;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) {
            quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + i * k)
                                : (const void *)((const float *)x + i * k),
                         x_bf16, k, qa + i * k, sa + i * nb, ssa + i * nb,
                         with16 ? ss16 + 2 * i * nb : NULL);
            if (qu)
                for (int64_t j = 0; j < k; ++j) qu[i * k + j] = (int8_t)(qa[i * k + j] ^ 0x80);
        }
        for (int64_t i0 = 0; i0 < m; i0 += MCHUNK) {
            const int64_t mc = i0 + MCHUNK <= m ? MCHUNK : m - i0;
            /* Guided, not static: the engine's other threads (the scheduler planning the next
             * step) share these cores, and equal static shares left one thread waiting at
             * the barrier (1B Q4_K_M decode ~49 -> ~42 ms/token on 2 cores). */
#pragma omp for schedule(guided, 2)
            for (int64_t g = 0; g < groups; ++g) {
                int64_t p = 0;
                while (g >= first_group[p + 1]) ++p;
                const int64_t type = w->type[p], gl = g - first_group[p];
                const int64_t nt = k / block_values(type); /* tiles per group */
                const uint8_t *tiles = w->data[p] + gl * nt * GR * block_bytes(type);
                const int64_t r0 = gl * GR;
                const int64_t rows = w->rows[p] - r0 < GR ? w->rows[p] - r0 : GR;
                const int64_t col = first_row[p] + r0;
#ifdef KTILE_EXPANDED
#ifdef KTILE_Q3K
                const int expands = type == QT_Q3_K;
#else
                const int expands = 0;
#endif
                if (mc >= ktile_min_rows(type) &&
                    (expands || type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K)) {
                    uint8_t *xt = expand_scratch((size_t)ktile_expanded_bytes(type, nt));
                    if (xt) {
                        ktile_expand(type, tiles, nt, xt);
                        const int64_t step = ktile_rows_per_call(type);
#ifdef KTILE_512
                        /* The passes share out the prefetching of the part's next group. */
                        const int64_t glines = nt * GR * block_bytes(type) / 64;
                        const int64_t passes = (mc + step - 1) / step;
                        const int64_t per_pass = (glines + passes - 1) / passes;
                        const int64_t cap = ktile_prefetch_lines(nt);
                        const int last = (gl + 1) * GR >= w->rows[p];
#endif
                        for (int64_t i = i0; i < i0 + mc; i += step) {
                            const int64_t mi = i + step <= i0 + mc ? step : i0 + mc - i;
                            float out[KTILE_MAX_ROWS][GR];
#ifdef KTILE_512
                            const int8_t *rows_q =
                                (type == QT_Q6_K || type == QT_Q3_K ? qu : qa) + i * k;
                            const int64_t done = (i - i0) / step * per_pass;
                            const int64_t todo = last || done >= glines ? 0
                                               : glines - done < per_pass ? glines - done
                                                                          : per_pass;
                            ktile_expanded_rows(type, xt, nt, rows_q, sa + i * nb, ssa + i * nb,
                                                k, mi, out, tiles + 64 * (glines + done),
                                                todo < cap ? todo : cap);
#else
                            ktile_expanded_rows(type, xt, nt, qa + i * k, sa + i * nb,
                                                ssa + i * nb, k, mi, out);
#endif
                            for (int64_t t = 0; t < mi; ++t)
                                store_row(out[t], rows, y, y_bf16, (i + t) * ldy + col, bias,
                                          col);
                        }
                        continue;
                    }
                }
#endif
                /* All tiled types take MAXM_K rows per pass in the 512-bit build (= MAXM
                 * elsewhere). */
                const int64_t step = MAXM_K;
                for (int64_t i = i0; i < i0 + mc; i += step) {
                    const int64_t mi = i + step <= i0 + mc ? step : i0 + mc - i;
                    float out[MAXM_K][GR];
                    if (type == QT_Q6_K)
                        group_q6k(tiles, nt, qa + i * k, sa + i * nb, ss16 + 2 * i * nb, k, mi,
                                  out);
                    else if (type == QT_Q4_K || type == QT_Q5_K)
                        group_kt(type == QT_Q5_K, tiles, nt, qa + i * k, sa + i * nb,
                                 ssa + i * nb, k, mi, out);
                    else if (type == QT_IQ4_XS)
                        group_iq4xs(tiles, nt, qa + i * k, sa + i * nb, ssa + i * nb, k, mi,
                                    out);
                    else if (type == QT_Q3_K || type == QT_Q2_K)
                        group_lowk(type == QT_Q2_K, tiles, nt, qa + i * k, sa + i * nb,
                                   ss16 + 2 * i * nb, k, mi, out);
                    else
                        group_rows(type, tiles, nt, qa + i * k, sa + i * nb, ssa + i * nb, k, mi,
                                   out);
                    for (int64_t t = 0; t < mi; ++t)
                        store_row(out[t], rows, y, y_bf16, (i + t) * ldy + col, bias, col);
                }
            }
        }
    }
    return 0;
}

/* ---- quantization="int8": the elementwise ends of an int8 x int8 -> int32 GEMM ------------
 * Per-token (row) dynamic quantization of activations, and the int32 -> float epilogue with
 * the row and per-output-channel scales, each one pass over memory (in torch each is several
 * passes over tensors as large as the GEMM's output, which would eat its speed-up). A decode
 * step's few rows stay on the calling thread: a thread team's wake-up costs more than they
 * do, three times per linear (rows are independent, so the result is the same either way). */
#define DEFINE_INT8_ENDS(T, SFX, LOAD, STORE)                                                   \
    int int8_quantize_rows_##SFX(const T *x, int8_t *q, float *s, int64_t m, int64_t k) {       \
        _Pragma("omp parallel for schedule(static) if (m * k > 32768)")                         \
        for (int64_t i = 0; i < m; ++i) {                                                       \
            const T *xi = x + i * k;                                                            \
            float amax = 0.f;                                                                   \
            for (int64_t j = 0; j < k; ++j) amax = fmaxf(amax, fabsf(LOAD(xi[j])));             \
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;                        \
            for (int64_t j = 0; j < k; ++j) q[i * k + j] = (int8_t)nearbyintf(LOAD(xi[j]) * inv); \
            s[i] = d;                                                                           \
        }                                                                                       \
        return 0;                                                                               \
    }                                                                                           \
    int int8_dequant_##SFX(const int32_t *acc, const float *sx, const float *sw, const T *bias, \
                           T *y, int64_t m, int64_t n) {                                        \
        _Pragma("omp parallel for schedule(static) if (m * n > 32768)")                         \
        for (int64_t i = 0; i < m; ++i) {                                                       \
            const float si = sx[i];                                                             \
            for (int64_t j = 0; j < n; ++j) {                                                   \
                const float v = (float)acc[i * n + j] * si * sw[j];                             \
                y[i * n + j] = STORE(bias ? v + LOAD(bias[j]) : v);                             \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

#define ID(v) (v)
DEFINE_INT8_ENDS(float, f32, ID, ID)
DEFINE_INT8_ENDS(uint16_t, bf16, bf16_to_f32, f32_to_bf16)
