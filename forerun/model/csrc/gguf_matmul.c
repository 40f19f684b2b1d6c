/* y = x @ W.T (+ bias) for a weight in GGUF blocks of any type forerun runs natively (the
 * entry point of quantization="gguf": GGUFLinear, and the one-call decoder stack).
 *
 * The weight's parts (qweight.h) are taken in runs of one kernel family, each run computed
 * by its kernel into its own columns of y: the types held in row-interleaved tiles (Q4_0,
 * Q4_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K) by quant_matmul.c, the other K-quants (Q2_K, Q3_K,
 * IQ4_XS) by kquant_matmul.c, which reads the file's rows. A fused
 * projection whose parts come from both families (rare: some files keep one tensor in
 * Q8_0) quantizes the activations once per run. bfloat16 activations are widened once,
 * and the bias is added, in float32.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "qweight.h"

enum { QT_Q2_K = 10, QT_Q3_K = 11, QT_IQ4_XS = 23 }; /* ggml's type ids */

/* Whether kquant_matmul.c takes a part of this type (as the file's rows): Q2_K, Q3_K, IQ4_XS.
 * The rest (Q4_0, Q4_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K) are held in tiles, quant_matmul.c's. */
static int is_kquant(int64_t type) {
    return type == QT_Q2_K || type == QT_Q3_K || type == QT_IQ4_XS;
}

/* y [m, n] (float32, row stride n) = xf [m, k] @ W.T, run by run. */
static int gguf_matmul_core(const float *xf, const qweight_t *w, float *y, int64_t m,
                            int64_t n, int64_t k) {
    if (w->nparts < 1 || w->nparts > QW_MAXPARTS) return -2;
    int64_t total = 0;
    for (int64_t p = 0; p < w->nparts; ++p) total += w->rows[p];
    if (total != n) return -2;
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
        rc = kq ? kquant_matmul_rows(xf, &run, y + col, n, m, k)
                : quant_matmul_rows(xf, &run, y + col, n, m, k);
        col += rows;
    }
    return rc;
}

/* y [m, n] = x [m, k] @ W.T (+ bias), W a qweight_t; same signature as small_matmul_*. */
int gguf_matmul_f32(const float *x, const void *w, const float *bias, float *y, int64_t m,
                    int64_t n, int64_t k) {
    const int rc = gguf_matmul_core(x, w, y, m, n, k);
    if (rc == 0 && bias)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
    return rc;
}

int gguf_matmul_bf16(const uint16_t *x, const void *w, const uint16_t *bias, uint16_t *y,
                     int64_t m, int64_t n, int64_t k) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k + m * n));
    if (!xf) return -1;
    float *yf = xf + m * k;
    for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_f32(x[i]);
    const int rc = gguf_matmul_core(xf, w, yf, m, n, k);
    if (rc == 0) {
#pragma omp parallel for schedule(static) if (m * n > 65536)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j)
                y[i * n + j] = f32_to_bf16(yf[i * n + j] + (bias ? bf16_to_f32(bias[j]) : 0.f));
    }
    free(xf);
    return rc;
}
