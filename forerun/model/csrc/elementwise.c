/* Fused per-token elementwise kernels of the decoder layer (CPU): residual add + RMSNorm,
 * SiLU- or GELU(tanh)-and-multiply, rotary embedding. Rows are split across threads; a single row (a
 * decode step of one sequence) runs on the calling thread without waking the team.
 *
 * Each replaces a chain of torch ops that would each read and write the whole activation
 * (and, in bf16, convert it to float32 and back) with one pass over it, computed in
 * float32 and rounded to the storage type once. Numerics follow Hugging Face's layers:
 * RMSNorm normalises in float32, rounds, then scales by the weight.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "row_argmax.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* What storing x in the tensor's dtype and reading it back gives. */
INLINE float round_to(float x, int bf16) {
    if (!bf16) return x;
    return bf16_to_f32(f32_to_bf16(x));
}

INLINE float silu(float x) {
    /* expf(-x) overflows below x = -88, where x * sigmoid(x) is 0 to float precision. */
    const float g = x / (1.f + expf(-fmaxf(x, -88.f)));
    return x < -88.f ? 0.f : g;
}

/* 2 * sqrt(2 / pi): gelu_tanh(x) = 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi) (x + 0.044715 x^3),
 * and 0.5 (1 + tanh(y)) = 1 / (1 + exp(-2y)), so GELU costs one expf, as SiLU does (tanhf
 * does not vectorise). The exponent's input is clamped to |x| <= 10, where the factor is
 * already 1 (or 0) to float precision: -ffast-math assumes no infinities (x / inf gave
 * NaN), and expf(-2y) overflows below x = -10, where the result is 0 (torch's too). */
INLINE float gelu_coef(void) { return 1.5957691216057308f; }

INLINE float gelu_tanh(float x, float c) {
    const float t = fminf(fmaxf(x, -10.f), 10.f);
    const float g = x / (1.f + expf(-c * (t + 0.044715f * t * t * t)));
    return x < -10.f ? 0.f : g;
}

INLINE void add_rms_norm_rows(void *x, void *residual, const void *weight, int64_t rows,
                              int64_t dim, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = r * dim;
        float ss = 0.f;
        if (residual) {
            for (int64_t i = 0; i < dim; ++i) {
                const float h = round_to(ld(x, base + i, bf16) + ld(residual, base + i, bf16), bf16);
                st(residual, base + i, h, bf16);
                ss += h * h;
            }
        } else {
            for (int64_t i = 0; i < dim; ++i) {
                const float h = ld(x, base + i, bf16);
                ss += h * h;
            }
        }
        const void *src = residual ? residual : x;
        const float rstd = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; ++i) {
            const float n = round_to(ld(src, base + i, bf16) * rstd, bf16);
            st(x, base + i, ld(weight, i, bf16) * n, bf16);
        }
    }
}

/* In place: with residual, residual <- x + residual and x <- norm(residual) * weight;
 * without, x <- norm(x) * weight. */
int rms_norm_f32(float *x, float *residual, const float *weight, int64_t rows, int64_t dim,
                 float eps) {
    add_rms_norm_rows(x, residual, weight, rows, dim, eps, 0);
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bfloat16 rows with the CPU's own conversion instruction (round to nearest even, as
 * f32_to_bf16; it reads subnormal floats as zero, which activations never are): the
 * bit-twiddled rounding above costs about as much as the rest of the arithmetic, and these
 * kernels run over whole prefill steps. Rows must be a multiple of 16 long. */
#define BF16_VEC 1
#define ld16 bf16x16_load
#define widen16 bf16x16_widen

INLINE __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static void add_rms_norm_rows_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight,
                                   int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *xr = x + r * dim, *rr = residual ? residual + r * dim : NULL;
        const uint16_t *src = rr ? rr : xr;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 h = ld16(xr + i);
            if (rr) {
                const __m256i hb = round16(_mm512_add_ps(h, ld16(rr + i)));
                _mm256_storeu_si256((__m256i *)(rr + i), hb);
                h = widen16(hb);
            }
            acc = _mm512_fmadd_ps(h, h, acc);
        }
        const __m512 rstd = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 n = widen16(round16(_mm512_mul_ps(ld16(src + i), rstd)));
            _mm256_storeu_si256((__m256i *)(xr + i), round16(_mm512_mul_ps(ld16(weight + i), n)));
        }
    }
}

static void act_and_mul_rows_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows,
                                  int64_t d, int gelu) {
    const float c = gelu_coef();
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate_up + r * 2 * d, *u = g + d;
        uint16_t *o = out + r * d;
        for (int64_t i = 0; i < d; i += 16) {
            float buf[16] __attribute__((aligned(64)));
            _mm512_store_ps(buf, ld16(g + i));
            if (gelu) {
#pragma omp simd
                for (int j = 0; j < 16; ++j) buf[j] = gelu_tanh(buf[j], c);
            } else {
#pragma omp simd
                for (int j = 0; j < 16; ++j) buf[j] = silu(buf[j]);
            }
            _mm256_storeu_si256((__m256i *)(o + i),
                                round16(_mm512_mul_ps(_mm512_load_ps(buf), ld16(u + i))));
        }
    }
}
#endif

int rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight, int64_t rows,
                  int64_t dim, float eps) {
#ifdef BF16_VEC
    if (dim % 16 == 0) {
        add_rms_norm_rows_bf16(x, residual, weight, rows, dim, eps);
        return 0;
    }
#endif
    add_rms_norm_rows(x, residual, weight, rows, dim, eps, 1);
    return 0;
}

INLINE void act_and_mul_rows(const void *gate_up, void *out, int64_t rows, int64_t d, int bf16,
                             int gelu) {
    const float c = gelu_coef();
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t in = r * 2 * d, o = r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
            const float g = ld(gate_up, in + i, bf16), u = ld(gate_up, in + d + i, bf16);
            const float a = gelu ? gelu_tanh(g, c) : silu(g);
            st(out, o + i, a * u, bf16);
        }
    }
}

INLINE void act_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t d,
                             int gelu) {
#ifdef BF16_VEC
    if (d % 16 == 0) {
        act_and_mul_rows_bf16(gate_up, out, rows, d, gelu);
        return;
    }
#endif
    act_and_mul_rows(gate_up, out, rows, d, 1, gelu);
}

/* out[r, :] = silu(gate_up[r, :d]) * gate_up[r, d:] */
int silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t d) {
    act_and_mul_rows(gate_up, out, rows, d, 0, 0);
    return 0;
}

int silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t d) {
    act_and_mul_bf16(gate_up, out, rows, d, 0);
    return 0;
}

/* out[r, :] = gelu_tanh(gate_up[r, :d]) * gate_up[r, d:] (Gemma's GeGLU), rounded once. */
int gelu_tanh_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t d) {
    act_and_mul_rows(gate_up, out, rows, d, 0, 1);
    return 0;
}

int gelu_tanh_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t d) {
    act_and_mul_bf16(gate_up, out, rows, d, 1);
    return 0;
}

INLINE void rotary_rows(void *x, int64_t tokens, int64_t heads, int64_t row_stride,
                        int64_t head_dim, const float *cos, const float *sin, int bf16) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t base = t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = ld(x, base + i, bf16), b = ld(x, base + half + i, bf16);
                st(x, base + i, a * c[i] - b * s[i], bf16);
                st(x, base + half + i, b * c[i] + a * s[i], bf16);
            }
        }
    }
}

/* In place, Hugging Face's rotate_half layout: x[t, h] (heads of head_dim contiguous,
 * tokens row_stride elements apart) rotated by the float32 angles cos/sin[t, head_dim / 2]. */
int rotary_f32(float *x, int64_t tokens, int64_t heads, int64_t row_stride, int64_t head_dim,
               const float *cos, const float *sin) {
    rotary_rows(x, tokens, heads, row_stride, head_dim, cos, sin, 0);
    return 0;
}

int rotary_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t row_stride,
                int64_t head_dim, const float *cos, const float *sin) {
    rotary_rows(x, tokens, heads, row_stride, head_dim, cos, sin, 1);
    return 0;
}

/* out[r] = index of the first largest value of row r (torch.argmax's tie rule); float32.
 * torch's CPU argmax walks a row one element at a time (~1.3 ms for 64 x 49k logits on a
 * 2-core CPU); row_argmax's two vectorised passes are several times faster. */
int argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float m;
        out[r] = row_argmax(x + r * cols, cols, &m);
    }
    return 0;
}
