/* The GGUF block types held in row-interleaved tiles of 16 rows (quant_matmul.c describes the
 * layouts; forerun/model/quant/gguf_blocks.py makes them): their ids, sizes and the MXFP4 and
 * IQ4_NL constants, shared by the integer bodies (quant_matmul.c) and the AMX path (quant_amx.c).
 * Built and loaded by forerun/model/cpu_kernels.py. */
#ifndef FORERUN_QTILE_H
#define FORERUN_QTILE_H
#include <stdint.h>
#include <string.h>

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8, QT_Q2_K = 10,
       QT_Q3_K = 11, QT_Q4_K = 12,
       QT_Q5_K = 13, QT_Q6_K = 14, QT_IQ4_NL = 20, QT_IQ4_XS = 23,
       QT_MXFP4 = 39 }; /* ggml's type ids */

/* MXFP4's levels plus 12, by nibble (the doubled E2M1 values 0 .5 1 1.5 2 3 4 6, then their
 * negatives), as the kernels' unsigned u. */
static const uint8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                    12, 11, 10, 9,  8,  6,  4,  0};
#define MXFP4_OFFSET 12.f

/* IQ4_NL's non-linear levels plus 127, by nibble (ggml's kvalues_iq4nl, -127..113), as the
 * unsigned u of the VNNI bodies; IQ4NL_LEVELS as they are, for the bodies that move each
 * level's sign onto the activations instead (maddubs would saturate on u up to 240). */
static const uint8_t IQ4NL_U[16] = {0,   23,  44,  62,  78,  92,  105, 117,
                                    128, 140, 152, 165, 180, 196, 216, 240};
static const int8_t IQ4NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};
#define IQ4NL_OFFSET 127.f

/* 2^(e - 128) (float32, exact; subnormal for e < 2): the scale of MXFP4's doubled levels. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* Bytes of one row's block (a tile holds 16 of them); 0 for a type not held in tiles. */
static inline int64_t block_bytes(int64_t type) {
    switch (type) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q5_0: return 22;
    case QT_Q5_1: return 24;
    case QT_IQ4_NL: return 18;
    case QT_Q8_0: return 34;
    case QT_MXFP4: return 17;
    case QT_Q2_K: return 84;
    case QT_Q3_K: return 110;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    case QT_Q6_K: return 210;
    case QT_IQ4_XS: return 136;
    default: return 0;
    }
}

/* Bytes before the quant lines of a tile: the d (and m) of its 16 rows. (Q5_0's and Q5_1's
 * first line after it holds the 16 rows' qh, their fifth bits.) */
static inline int64_t tile_header(int64_t type) {
    return type == QT_Q4_1 || type == QT_Q5_1 ? 64 : type == QT_MXFP4 ? 16 : 32;
}

/* Values per block: 32, or 256 for the K-quants' super-blocks. */
static inline int64_t block_values(int64_t type) {
    return type == QT_Q2_K || type == QT_Q3_K || type == QT_Q4_K || type == QT_Q5_K ||
                   type == QT_Q6_K || type == QT_IQ4_XS
               ? 256
               : 32;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The 16 rows' MXFP4 scales 2^(e - 128) from their exponent bytes: 2^(e - 127) is the float
 * with exponent field e (e = 0: the subnormal 2^-127 instead), halved exactly. */
static inline __m512 e8m0_half16(const uint8_t *e) {
    const __m512i e32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    const __m512i bits = _mm512_mask_mov_epi32(
        _mm512_slli_epi32(e32, 23), _mm512_cmpeq_epi32_mask(e32, _mm512_setzero_si512()),
        _mm512_set1_epi32(0x00400000));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
}
#endif
#endif
