/* y = x @ W.T (+ bias) for a weight in GGUF blocks of any type forerun runs natively (the
 * entry point of quantization="gguf": GGUFLinear, and the one-call decoder stack).
 *
 * The weight's parts (qweight.h) are taken in runs of one kernel family, each run computed
 * by its kernel into its own columns of y: the types held in row-interleaved tiles (the
 * 32-value types, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) by quant_matmul.c, Q2_K by
 * kquant_matmul.c, which reads the file's rows. A fused
 * projection whose parts come from both families (rare: some files keep one tensor in
 * Q8_0) quantizes the activations once per run. The tiled runs read bfloat16 activations
 * and write bfloat16 results (bias added in float32) as they are; the row runs take a
 * float32 copy.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "qweight.h"

enum { QT_Q2_K = 10 }; /* ggml's type id */

/* Whether kquant_matmul.c takes a part of this type (as the file's rows): Q2_K. The rest are
 * held in tiles, quant_matmul.c's. */
static int is_kquant(int64_t type) { return type == QT_Q2_K; }

/* y [m, n] = x [m, k] @ W.T (+ bias), run by run; x bfloat16 where x_bf16, y and the bias
 * bfloat16 where y_bf16, else float32. The tiled runs read x and write y as they are; a
 * K-quant run takes a float32 copy of bfloat16 x (made once) and, for bfloat16 y, writes
 * float32 columns that are then narrowed. */
static int gguf_matmul_core(const void *x, int x_bf16, const qweight_t *w, const void *bias,
                            void *y, int y_bf16, int64_t m, int64_t n, int64_t k) {
    if (w->nparts < 1 || w->nparts > QW_MAXPARTS) return -2;
    int64_t total = 0;
    for (int64_t p = 0; p < w->nparts; ++p) total += w->rows[p];
    if (total != n) return -2;
    const size_t esz = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    float *xf = x_bf16 ? NULL : (float *)x, *yf = NULL, *free_later = NULL;
    int64_t col = 0;
    int rc = 0;
    for (int64_t p = 0; p < w->nparts && rc == 0;) {
        const int kq = is_kquant(w->type[p]);
        qweight_t run = {0};
        int64_t rows = 0;
        for (; p < w->nparts && is_kquant(w->type[p]) == kq; ++p) {
            run.type[run.nparts] = w->type[p];
            run.rows[run.nparts] = w->rows[p];
            run.data[run.nparts++] = w->data[p];
            rows += w->rows[p];
        }
        const void *bcol = bias ? (const char *)bias + esz * (size_t)col : NULL;
        if (!kq) {
            rc = quant_matmul_rows_io(x, x_bf16, &run, (char *)y + esz * (size_t)col, y_bf16,
                                      bcol, n, m, k);
            col += rows;
            continue;
        }
        if (!xf || (y_bf16 && !yf)) {
            const size_t xn = x_bf16 && !xf ? (size_t)(m * k) : 0;
            float *buf = malloc(sizeof(float) * (xn + (y_bf16 ? (size_t)(m * n) : 0)));
            if (!buf) { rc = -1; break; }
            if (xn) {
                xf = buf;
                for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
            }
            if (y_bf16) yf = buf + xn;
            free_later = buf; /* made once: a later run finds xf (and yf) set */
        }
        if (!y_bf16) {
            rc = kquant_matmul_rows(xf, &run, (float *)y + col, n, m, k);
            if (rc == 0 && bias)
                for (int64_t i = 0; i < m; ++i)
                    for (int64_t j = 0; j < rows; ++j)
                        ((float *)y)[i * n + col + j] += ((const float *)bcol)[j];
        } else {
            rc = kquant_matmul_rows(xf, &run, yf, rows, m, k);
            if (rc == 0)
                for (int64_t i = 0; i < m; ++i)
                    for (int64_t j = 0; j < rows; ++j)
                        ((uint16_t *)y)[i * n + col + j] = f32_to_bf16(
                            yf[i * rows + j] + (bcol ? bf16_to_f32(((const uint16_t *)bcol)[j]) : 0.f));
        }
        col += rows;
    }
    free(free_later);
    return rc;
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
