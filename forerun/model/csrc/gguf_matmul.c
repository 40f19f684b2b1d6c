/* y = x @ W.T (+ bias) for a weight in GGUF blocks of any type forerun runs natively (the
 * entry point of quantization="gguf": GGUFLinear, and the one-call decoder stack).
 *
 * Every native type is held in row-interleaved tiles (qweight.h, quant_matmul.c), so a
 * weight of several parts of different types (a fused q/k/v or gate/up whose GGUF tensors
 * differ) runs in one quant_matmul.c call, which quantizes the activations once and reads
 * bfloat16 activations and writes bfloat16 results (bias added in float32) as they are.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <stdint.h>

#include "qweight.h"

/* y [m, n] = x [m, k] @ W.T (+ bias); x bfloat16 where x_bf16, y and the bias bfloat16
 * where y_bf16, else float32, read and written as they are. */
static int gguf_matmul_core(const void *x, int x_bf16, const qweight_t *w, const void *bias,
                            void *y, int y_bf16, int64_t m, int64_t n, int64_t k) {
    if (w->nparts < 1 || w->nparts > QW_MAXPARTS) return -2;
    int64_t total = 0;
    for (int64_t p = 0; p < w->nparts; ++p) total += w->rows[p];
    if (total != n) return -2;
    return quant_matmul_rows_io(x, x_bf16, w, y, y_bf16, bias, n, m, k);
}

/* y [m, n] = x [m, k] @ W.T (+ bias), W a qweight_t; same signature as small_matmul_*. */
int gguf_matmul_f32(const float *x, const void *w, const float *bias, float *y, int64_t m,
                    int64_t n, int64_t k) {
    return gguf_matmul_core(x, 0, w, bias, y, 0, m, n, k);
}

int gguf_matmul_bf16(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k) {
    return gguf_matmul_core(x, 1, w, bias, y, 1, m, n, k);
}

/* bfloat16 x, float32 y and bias: an output head's logits, not rounded to bfloat16. */
int gguf_matmul_bf16_f32(const uint16_t *x, const void *w, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k) {
    return gguf_matmul_core(x, 1, w, bias, y, 0, m, n, k);
}
