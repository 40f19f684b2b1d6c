/* The index of the first largest value of a float32 row (torch.argmax's tie rule).
 * A vectorised max pass, then a vectorised search for its first occurrence: a scalar
 * search walks half the row on average, as long as the max pass itself. */
#ifndef FORERUN_ROW_ARGMAX_H
#define FORERUN_ROW_ARGMAX_H
#include <immintrin.h>
#include <stdint.h>

static inline int64_t row_argmax(const float *x, int64_t v, float *max_out) {
    float m = x[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < v; ++i) m = x[i] > m ? x[i] : m;
    *max_out = m;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= v; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < v; ++i)
        if (x[i] == m) return i;
    return 0; /* NaN max: no element equals it */
}
#endif
