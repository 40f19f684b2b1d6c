/* A linear weight held as GGUF blocks (quantization="gguf"), as the kernels of
 * quant_matmul.c (and quant_amx.c) and gguf_matmul.c (their entry point) read it;
 * cpu_kernels.QWeightDesc in Python.
 *
 * Up to QW_MAXPARTS row ranges, rows concatenated, each in its own ggml block type: a fused
 * q/k/v or gate/up whose GGUF tensors differ in type keeps each part as it is. data[p] is
 * part p's bytes, regrouped in tiles of 16 rows (quant_matmul.c): the 32-value types (MXFP4
 * among them), the K-quants and IQ4_XS. */
#ifndef FORERUN_QWEIGHT_H
#define FORERUN_QWEIGHT_H
#include <stdint.h>

#define QW_MAXPARTS 4

typedef struct {
    int64_t nparts;
    int64_t type[QW_MAXPARTS];
    int64_t rows[QW_MAXPARTS];
    const uint8_t *data[QW_MAXPARTS];
} qweight_t;

/* y[i * ldy + r] = row r of w . xf[i], for the m rows of xf [m, k] (float32) and every row
 * r of w; 0, -1 (no memory) or -2 (a type or shape it does not take). */
int quant_matmul_rows(const float *xf, const qweight_t *w, float *y, int64_t ldy, int64_t m,
                      int64_t k);
/* The same for x and y of either type (x_bf16, y_bf16: bfloat16, else float32), with a bias
 * of y's type (NULL: none; indexed by w's rows) added: no float copy of either. */
int quant_matmul_rows_io(const void *x, int x_bf16, const qweight_t *w, void *y, int y_bf16,
                         const void *bias, int64_t ldy, int64_t m, int64_t k);
/* quant_amx.c: the same for bfloat16 x on AMX (every part a tiled type; y and the bias
 * bfloat16 where y_bf16, else float32), from QAMX_MIN_ROWS rows; -2 where it does not run (no
 * AMX, a type it does not take, turned off by quant_matmul_amx_set(0), which returns the
 * previous setting). */
#define QAMX_MIN_ROWS 16
int quant_matmul_amx(const uint16_t *x, const qweight_t *w, void *y, int y_bf16,
                     const void *bias, int64_t ldy, int64_t m, int64_t k);
int quant_matmul_amx_set(int on);

#endif
