/* bfloat16 <-> float32 for the CPU kernels: widening is exact; narrowing rounds to nearest
 * even and keeps NaN a NaN, as torch does. */
#ifndef FORERUN_BF16_H
#define FORERUN_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values widened to float32 lanes (exact). */
static inline __m512 bf16x16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 bf16x16_load(const uint16_t *p) {
    return bf16x16_widen(_mm256_loadu_si256((const __m256i *)p));
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 bfloat16 values widened to float32 lanes (exact). */
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 float32 lanes narrowed to bfloat16 as f32_to_bf16 does (nearest even, NaN kept). */
static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                           nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif
#endif
