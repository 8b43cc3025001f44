/* What the AMX kernels share (gemm_amx.h, causal_attention_amx.h): the process's permission to use the tiles and
 * the one tile configuration they all run with. Included only by builds with -mamx-tile -mamx-bf16.
 */
#ifndef HEARTH_AMX_H
#define HEARTH_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

/* Linux hands out the tiles' 8 KB of register state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); a process that uses them without it is killed. oneDNN asks the same; asking again is
 * harmless. Each library asks from a constructor of its own and keeps the answer. */
static inline int amx_request_permission(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* palette 1: eight tiles of 16 rows of 64 bytes (the layout ldtilecfg reads). Loading a configuration zeroes the
 * tiles, so each thread loads it once, before its products. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static inline void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    TILE_LOADS_SEE_STORES(); /* its asm says it reads only the first 8 bytes of c */
    _tile_loadconfig(&c);
}
#endif /* HEARTH_AMX_H */
