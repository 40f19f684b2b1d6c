/* y = x @ W.T (+ bias) for a weight in GGUF blocks of any type forerun runs natively (the
 * entry point of quantization="gguf": GGUFLinear, and the one-call decoder stack).
 *
 * The weight's parts (qweight.h) are taken in runs of one kernel family, each run computed
 * by its kernel into its own columns of y: the types held in row-interleaved tiles (Q4_0,
 * Q4_1, Q8_0, MXFP4, Q4_K, Q5_K) by quant_matmul.c, the other K-quants (Q2_K, Q3_K, Q6_K, IQ4_XS)
 * by kquant_matmul.c, which reads the file's rows; Q6_K for many rows (prefill, batches) is
 * regrouped into tiles for the call and runs in quant_matmul.c too. A fused
 * projection whose parts come from both families (rare: some files keep one tensor in
 * Q8_0) quantizes the activations once per run. bfloat16 activations are widened once,
 * and the bias is added, in float32.
 * Built and loaded by forerun/model/cpu_kernels.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "qweight.h"

enum { QT_Q2_K = 10, QT_Q3_K = 11, QT_Q6_K = 14, QT_IQ4_XS = 23 }; /* ggml's type ids */
/* From this many activation rows on, Q6_K parts (held as rows) are regrouped into tiles for
 * the call (2048 x 8192 on 2 cores, regrouping included: 0.5x the rows' speed at 4 rows,
 * 0.8x at 16, 1.1x at 32, 1.5x at 64). */
#define Q6K_TILE_ROWS 32

/* Whether kquant_matmul.c takes a part of this type (as the file's rows) in a matmul of m
 * rows: Q2_K, Q3_K, IQ4_XS always, Q6_K for few rows. The rest (Q4_0, Q4_1, Q8_0, MXFP4, Q4_K,
 * Q5_K, and Q6_K for many rows, in tiles) are quant_matmul.c's. */
static int is_kquant(int64_t type, int64_t m) {
    return type == QT_Q2_K || type == QT_Q3_K || type == QT_IQ4_XS ||
           (type == QT_Q6_K && m < Q6K_TILE_ROWS);
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
    uint8_t *scratch[QW_MAXPARTS] = {0}; /* Q6_K parts regrouped for this call */
    for (int64_t p = 0; p < w->nparts && rc == 0;) {
        const int kq = is_kquant(w->type[p], m);
        qweight_t run = {0};
        int64_t rows = 0;
        for (; p < w->nparts && is_kquant(w->type[p], m) == kq; ++p) {
            const uint8_t *data = w->data[p];
            if (!kq && w->type[p] == QT_Q6_K) {
                scratch[p] = malloc((size_t)q6k_tile_bytes(w->rows[p], k));
                if (!scratch[p]) {
                    rc = -1;
                    break;
                }
                if ((rc = q6k_rows_to_tiles(data, w->rows[p], k, scratch[p])) != 0) break;
                data = scratch[p];
            }
            run.type[run.nparts] = w->type[p];
            run.rows[run.nparts] = w->rows[p];
            run.data[run.nparts++] = data;
            rows += w->rows[p];
        }
        if (rc == 0)
            rc = kq ? kquant_matmul_rows(xf, &run, y + col, n, m, k)
                    : quant_matmul_rows(xf, &run, y + col, n, m, k);
        col += rows;
    }
    for (int64_t p = 0; p < w->nparts; ++p) free(scratch[p]);
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
