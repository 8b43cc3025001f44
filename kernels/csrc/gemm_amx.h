/* gemm.c's bf16 products on AMX tiles (Intel Sapphire Rapids and later), where the build has them (-mamx-tile
 * -mamx-bf16) and Linux lets the process use them: included by gemm.c, whose entry points come here for k a
 * multiple of 32 and fall back to the AVX-512 BF16 register tiles otherwise.
 *
 * One tile multiply (tdpbf16ps) adds a 16 x 32 bf16 tile of x times a 32 x 16 tile of weights into 16 x 16 fp32
 * sums: 16,384 flops an instruction against 64 for an AVX-512 BF16 dot product. oneDNN's products run on the
 * tiles too, which put them 2-12x ahead of the AVX-512 GEMM on such a CPU (docs/benchmarks.md, cpu_gemm), and so
 * the engine sent bf16 steps of many rows there, through the Python forward; with the tiles here the one-call C
 * layers of csrc/decode_layer.c run those steps as well.
 *
 * No repacking: gemv.c's layout of a block, k-pair-major [k / 2][BW = 32][2], is already what a weight tile reads
 * (each of its 16 rows a pair of k for 16 outputs, 64 bytes): the tile of outputs [16h, 16h + 16) and k-pairs
 * [16j, 16j + 16) starts 2048 j + 64 h bytes into the block, rows 128 bytes apart. x tiles read 16 rows of x in
 * place (rows 2k bytes apart); the rows past m of a last partial group come from a zero-padded copy.
 *
 * Eight tiles: sums for rows [0, 16) and [16, 32) by the block's two halves (0-3), two x tiles (4, 5), two weight
 * tiles (6, 7); a weight tile is loaded once for 32 rows. Each block's sums are stored to an L1 buffer and go
 * through gemm.c's row epilogues (bias, rounding, SiLU * up), so each output is rounded once, as there.
 */
#include <stdlib.h>

#include "amx.h"

#define AMX_ROWS 16 /* rows of an x tile */
#define AMX_K 32    /* k per tile multiply */
#ifndef AMX_AHEAD
#define AMX_AHEAD 8 /* steps of k (2 KB of weights each) fetched ahead */
#endif

static int amx_permitted;

__attribute__((constructor)) static void amx_request(void) { amx_permitted = amx_request_permission(); }

static inline int amx_takes(int64_t k) { return amx_permitted && k % AMX_K == 0; }

/* The 32 lines of weights AMX_AHEAD steps on: a step's weight tiles wait on memory otherwise (the prefetchers do
 * not follow tile loads well). Past a block's end this reads the thread's next block, which follows it. */
static inline __attribute__((always_inline)) void amx_fetch(const char *w) {
#if AMX_AHEAD > 0
    _Pragma("GCC unroll 32") for (int l = 0; l < 32; l++) _mm_prefetch(w + AMX_AHEAD * 2048 + 64 * l, _MM_HINT_T0);
#else
    (void)w;
#endif
}

/* sums [32][BW] = rows [0, 16) (x0) and, with two groups, [16, 32) (x1) of x times one block over all k; x rows
 * 2k bytes apart. groups and fetch are constants once inlined: one loop each, no branch in it. */
static inline __attribute__((always_inline)) void amx_sums(int groups, int fetch, const uint16_t *x0,
                                                            const uint16_t *x1, int64_t k, const uint16_t *block,
                                                            float sums[32][BW]) {
    const int64_t stride = 2 * k, steps = k / AMX_K;
    const char *w = (const char *)block;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < steps; j++, w += 2048) {
        if (fetch) amx_fetch(w);
        _tile_loadd(6, w, 128);
        _tile_loadd(7, w + 64, 128);
        _tile_loadd(4, x0 + j * AMX_K, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (groups == 2) {
            _tile_loadd(5, x1 + j * AMX_K, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0], BW * 4);
    _tile_stored(1, sums[0] + 16, BW * 4);
    if (groups == 2) {
        _tile_stored(2, sums[16], BW * 4);
        _tile_stored(3, sums[16] + 16, BW * 4);
    }
}

/* Row r of x, or of the zero-padded copy of the last partial group (tail, which holds rows [tail_from, m)). */
static inline const uint16_t *amx_row(const uint16_t *x, const uint16_t *tail, int64_t tail_from, int64_t r,
                                      int64_t k) {
    return tail && r >= tail_from ? tail + (r - tail_from) * k : x + r * k;
}

/* Rows [r0, r0 + rows) of x times one block (width of its outputs exist) into y (row r0 first, rows n outputs
 * apart): gemm.c's block_rows on tiles. gate_up: the up block of the same outputs is `up`, and y gets
 * silu(gate) * up (tile_silu's epilogue). */
static inline __attribute__((always_inline)) void amx_block_rows(int kind, const uint16_t *x, const uint16_t *tail,
                                                                  int64_t tail_from, int64_t r0, int64_t rows,
                                                                  int64_t k, const uint16_t *block,
                                                                  const uint16_t *up, const void *b, const void *b_up,
                                                                  void *y, int64_t n, int64_t width) {
    const int64_t out = kind == BF16_PAIRS ? 2 : 4; /* bytes per output */
    float sums[32][BW], ups[32][BW];
    for (int64_t g = 0; g < rows; g += 32) {
        const int64_t r = r0 + g, here = rows - g < 32 ? rows - g : 32, groups = here > AMX_ROWS ? 2 : 1;
        const uint16_t *x0 = amx_row(x, tail, tail_from, r, k), *x1 = amx_row(x, tail, tail_from, r + AMX_ROWS, k);
        /* the first pass over a block reads it from memory: only that one fetches ahead */
        if (groups == 2)
            g == 0 ? amx_sums(2, 1, x0, x1, k, block, sums) : amx_sums(2, 0, x0, x1, k, block, sums);
        else
            g == 0 ? amx_sums(1, 1, x0, x0, k, block, sums) : amx_sums(1, 0, x0, x0, k, block, sums);
        if (up) {
            if (groups == 2)
                g == 0 ? amx_sums(2, 1, x0, x1, k, up, ups) : amx_sums(2, 0, x0, x1, k, up, ups);
            else
                g == 0 ? amx_sums(1, 1, x0, x0, k, up, ups) : amx_sums(1, 0, x0, x0, k, up, ups);
        }
        for (int64_t i = 0; i < here; i++) {
            char *row = (char *)y + (g + i) * n * out;
            if (up) {
                const vec u[NB] = {vload_f32(ups[i]), vload_f32(ups[i] + VL)};
                store_silu_row(kind, sums[i], u, b, b_up, row);
            } else {
                const vec s[NB] = {vload_f32(sums[i]), vload_f32(sums[i] + VL)};
                store_row(kind, s, b, row, width);
            }
        }
    }
}

/* gemm.c's product (silu: product_silu, n = inter outputs of silu(gate) * up from 2 * inter packed; tokens:
 * product_argmax, y unused) on tiles, for kind BF16_PAIRS or BF16_WIDE and k % AMX_K == 0: the same items of
 * blocks and chunks of rows, dealt between threads the same way (deal.h). 0, or -1 out of memory. */
static int amx_product(int kind, const uint16_t *x, const uint16_t *packed, const uint16_t *b, void *y, int64_t m,
                       int64_t n, int64_t k, int64_t threads, int silu, int64_t *tokens) {
    const int64_t blocks = (n + BW - 1) / BW, bytes = k * BW, out = kind == BF16_PAIRS ? 2 : 4;
    /* a last group of fewer than 16 rows reads them from a copy padded with zero rows */
    const int64_t tail_from = m - m % AMX_ROWS;
    uint16_t *tail = NULL;
    if (m % AMX_ROWS) {
        tail = calloc((size_t)(AMX_ROWS * k), sizeof *tail);
        if (!tail) return -1;
        memcpy(tail, x + tail_from * k, (size_t)((m - tail_from) * k) * sizeof *tail);
        TILE_LOADS_SEE_STORES();
    }
    DEAL_COUNTS(counts, threads);
    best *all = tokens ? bests_open(counts_team, m) : NULL;
    if (tokens && !all) {
        free(tail);
        return -1;
    }
#pragma omp parallel num_threads(counts_team)
    {
        deal d = deal_start(blocks, m, CHUNK_ROWS, omp_get_num_threads(), omp_get_thread_num(), counts);
        best *mine = all ? all + omp_get_thread_num() * m : NULL;
        float scratch[CHUNK_ROWS][BW]; /* tokens: a chunk's outputs of one block, scanned from L1 */
        int64_t r0, rows, after, blk;
        amx_configure();
        while ((blk = deal_next(&d, &r0, &rows, &after)) >= 0) {
            const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
            const uint16_t *bias = b ? b + c0 : NULL, *bias_up = b && silu ? b + n + c0 : NULL;
            const uint16_t *up = silu ? packed + (blk + blocks) * bytes : NULL;
            if (!mine) {
                amx_block_rows(kind, x, tail, tail_from, r0, rows, k, packed + blk * bytes, up, bias, bias_up,
                               (char *)y + (r0 * n + c0) * out, n, width);
                continue;
            }
            amx_block_rows(kind, x, tail, tail_from, r0, rows, k, packed + blk * bytes, up, bias, bias_up, scratch,
                           BW, width);
            for (int64_t i = 0; i < rows; i++) best_scan(&mine[r0 + i], scratch[i], width, c0);
        }
        _tile_release();
    }
    if (all) bests_close(all, counts_team, m, tokens);
    free(tail);
    return 0;
}

/* gemm.c's product_argmax on tiles: y [m] the argmax of each row of hearth_gemm_bf16_wide's outputs. */
static int amx_product_argmax(const uint16_t *x, const uint16_t *packed, const uint16_t *b, int64_t *y, int64_t m,
                              int64_t n, int64_t k, int64_t threads) {
    return amx_product(BF16_WIDE, x, packed, b, NULL, m, n, k, threads, 0, y);
}
