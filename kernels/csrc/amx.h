/* What the AMX kernels share (gemm_amx.h, gemv_i8_amx.h, causal_attention_amx.h): the process's permission to use
 * the tiles, the one tile configuration they all run with, and the products' plan of tiles for a block of 32
 * outputs. Included only by builds with -mamx-tile -mamx-bf16.
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

/* The products' plan for one block of 32 outputs (gemm_amx.h's bf16 blocks, gemv_i8_amx.h's widened int8 ones):
 * tiles 0-1 hold the sums of a first group of 16 rows for the block's two halves of 16 outputs, 2-3 those of a
 * second group; 4 and 5 take the groups' rows, 6 and 7 the block's two halves of one step of 32 k. A step of the
 * block is 2 KB, k-pair-major: each tile row a pair of k for 16 outputs, rows 128 bytes apart. One weight tile
 * load serves both groups. The tile numbers must be constants, so `groups` and `second` are constants wherever
 * these are inlined. A step is amx_tiles_weights, then amx_tiles_rows for each group: written out at the call
 * site, not wrapped in a function of its own (with that one more level of inlining GCC allocated gemm.c's AMX
 * product differently, 1-2% slower at 256 rows on the AMX Xeon VM). */
static inline __attribute__((always_inline)) void amx_tiles_zero(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The step of weights at w into tiles 6-7. */
static inline __attribute__((always_inline)) void amx_tiles_weights(const char *w) {
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 64, 128);
}

/* 16 rows of 32 k at x (rows `stride` bytes apart) times tiles 6-7, into the first group's sums or the second's. */
static inline __attribute__((always_inline)) void amx_tiles_rows(int second, const void *x, int64_t stride) {
    if (second) {
        _tile_loadd(5, x, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    } else {
        _tile_loadd(4, x, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
    }
}

/* The sums into rows of 32 floats, `ld` floats apart: the first group's into rows [0, 16), the second's [16, 32). */
static inline __attribute__((always_inline)) void amx_tiles_store(int groups, float *sums, int64_t ld) {
    _tile_stored(0, sums, ld * 4);
    _tile_stored(1, sums + 16, ld * 4);
    if (groups == 2) {
        _tile_stored(2, sums + 16 * ld, ld * 4);
        _tile_stored(3, sums + 16 * ld + 16, ld * 4);
    }
}
#endif /* HEARTH_AMX_H */
