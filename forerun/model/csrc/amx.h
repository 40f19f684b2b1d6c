/* What every AMX kernel needs before its first tile instruction: Linux's permission for the
 * tile state, and the one tile shape they all use (8 tiles of 16 rows x 64 bytes).
 * Built and loaded by forerun/model/cpu_kernels.py. */
#ifndef FORERUN_AMX_H
#define FORERUN_AMX_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* Set by cpu_amx_set (small_matmul.c; FORERUN_CPU_AMX=0): every AMX body then declines, as
 * on a CPU without AMX. Weak, so that every file including this shares the one variable. */
__attribute__((weak)) volatile int forerun_amx_off = 0;

/* Linux hands out the tile state only on request (once per process; idempotent). */
static inline int amx_permitted(void) {
    static volatile int state; /* 0 unknown, 1 granted, -1 refused */
    if (forerun_amx_off) return 0;
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* This thread's 8 tiles as 16 x 64 bytes (undone by _tile_release). */
static inline void amx_configure_full(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#if defined(__AMX_BF16__)
/* 16 rows of bfloat16 x from x0 (32 where rows2; rows k values apart) against one or two
 * runs of k / 32 B tiles (b1 NULL: one), each tile 16 lines of 64 bytes: line j the value
 * pair 2j, 2j + 1 of 16 weight rows. The float32 sums are stored as 16x16 tiles: c[0] and
 * c[1] the first 16 rows against b0 and b1, c[2] and c[3] the next 16. */
static inline void amx_bf16_pass(const uint16_t *x0, int64_t k, const uint16_t *b0,
                                 const uint16_t *b1, int rows2, float c[4][256]) {
    const uint16_t *x1 = x0 + 16 * k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < k / 32; ++kb) {
#ifdef AMX_PF /* the includer's: B tiles streamed from memory, prefetched AMX_PF tiles ahead */
        for (int i = 0; i < 16; ++i) {
            _mm_prefetch((const char *)(b0 + (kb + AMX_PF) * 512 + 32 * i), _MM_HINT_T0);
            if (b1) _mm_prefetch((const char *)(b1 + (kb + AMX_PF) * 512 + 32 * i), _MM_HINT_T0);
        }
#endif
        _tile_loadd(4, x0 + kb * 32, k * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (b1) {
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rows2) {
            _tile_loadd(5, x1 + kb * 32, k * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (b1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    if (b1) _tile_stored(1, c[1], 64);
    if (rows2) {
        _tile_stored(2, c[2], 64);
        if (b1) _tile_stored(3, c[3], 64);
    }
}
#endif
#endif
#endif
