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

/* Linux hands out the tile state only on request (once per process; idempotent). */
static inline int amx_permitted(void) {
    static volatile int state; /* 0 unknown, 1 granted, -1 refused */
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
#endif
#endif
