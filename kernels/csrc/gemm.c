/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for many rows of x: the products of a step of many tokens (32
 * decoding sequences, a prompt), on the same packed weights as the one- and two-row products of gemv.c. fp32,
 * and bf16 where the build has AVX-512 BF16 (fp32 sums, each output rounded once, as gemv.c and oneDNN do).
 *
 * Those weights are packed once (kernels/cpu_gemv.pack) into column blocks of BW outputs, k-major: for each k in
 * turn, the BW weights of outputs [c * BW, c * BW + BW); bf16 with AVX-512 BF16 in pairs of k ([k / 2][BW][2]).
 * A register tile of MR rows of x by one block (MR x NB vectors of sums) walks the whole of k: each step loads
 * the block's NB weight vectors once and multiplies them by MR broadcast values of x (a pair of bf16 values for
 * the dot product, which multiplies each output's pair of weights into one fp32 lane: twice fp32's
 * multiply-adds per instruction), so a weight load feeds MR multiply-adds and no sum leaves its register until
 * k ends. On AVX2 that is 6 x 2 vectors of sums, two weight vectors and one broadcast: 15 of the 16 registers;
 * on AVX-512, 12 x 2 of 32. The MR x NB chains of sums are independent, enough to keep both FMA pipes busy
 * through their latency.
 *
 * A thread takes whole blocks (dealt as deal.h says: a run of its own, then what is left of the others') and
 * sweeps them over CHUNK_ROWS rows at a time: each block of weights is read from memory once per chunk and then
 * from L1/L2 for every tile of the chunk's rows, whose x (221 KB at k = 576 fp32) stays in the caches meanwhile. Measured on the AVX2 EPYC of docs/benchmarks.md: chunks sized to keep x
 * within 256 KB (12 rows at Qwen's k = 4864) re-read the weights too often there (down projection 106-123
 * GFLOP/s against 122-143 for 48-96 rows), and blocking k as well gained nothing (the extra passes over y cost
 * what the smaller weight panels saved).
 *
 * Two variants write less: a fused [gate; up] weight's products straight into silu(gate) * up (a thread takes a
 * gate block with the up block of the same outputs; the separate product wrote both halves for fused.c to read
 * back, about 3% of a 32-concurrent Qwen2.5 bf16 pass), and bf16 products stored as fp32 (the LM head's logits,
 * which sampling reads in fp32, without a conversion pass). Both give the separate steps' results bit for bit.
 *
 * The register tile (its steps, fetches ahead and epilogues) is gemm_tiles.h; AMX's tiles are gemm_amx.h's. Built
 * by kernels/cpu_build (-fopenmp: torch's OpenMP runtime and thread pool).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "best.h"
#include "deal.h"
#include "lora_side.h"
#include "simd.h"

#define NB 2         /* vectors per block: the layout of gemv.c */
#define BW (NB * VL) /* outputs per block */
#ifdef __AVX512F__
#define MR 12
#else
#define MR 6
#endif
#define CHUNK_ROWS 96 /* 8 or 16 tiles */

enum { F32, /* fp32 x, weights, bias and y: a step is one k */
       BF16_PAIRS, /* bf16 x, weights in pairs of k, bias and y: a step is a pair of k */
       BF16_WIDE /* BF16_PAIRS with each output stored widened to fp32 (the bf16 value): logits for sampling */ };

#include "gemm_tiles.h"

/* m rows of x times one block, in as few tiles as MR allows. Where the rows left after full tiles would make a
 * tile of more than MR / 2 rows, the tiles' heights are made even instead (32 rows: 11, 11 and 10 rather than
 * 12, 12 and 8, 1.1-1.15x the products); a short tile of the rest (40 rows: 12, 12, 12 and 4) measured faster
 * than even ones of 10. From the second tile on (in the only tile where there is one), while the block is read
 * again from cache, the next block the thread takes (`next`, or NULL) is prefetched, so the first tile of a
 * block finds it in cache instead of waiting on memory (32 rows: 1.1-1.4x; docs/benchmarks.md). Not for fp32
 * blocks of four tiles or more: prompt-sized fp32 products ran 5-10% slower with it on an AVX-512 EPYC (bf16 ones
 * gained). */
static inline __attribute__((always_inline)) void block_rows(int kind, const void *x, int64_t m, int64_t k,
                                                              const void *block, const void *b, void *y, int64_t n,
                                                              int64_t width, const void *next) {
    const int64_t size = kind == F32 ? 4 : 2, steps = kind == F32 ? k : k / 2, tiles = (m + MR - 1) / MR;
    /* a block's cache lines; bytes per output */
    const int64_t lines = k * BW * size / 64, out = kind == BF16_PAIRS ? 2 : 4;
    prefetch none = {0, 0, 0}, pf = none;
    if (next && (kind != F32 || tiles <= 3)) { /* one or two lines a step, over the tiles that prefetch */
        const int64_t later = tiles > 1 ? (tiles - 1) * steps : steps, per = (lines + later - 1) / later;
        pf = (prefetch){(const char *)next, (const char *)next + lines * 64, per > 1 ? 2 : 1};
    }
    const int64_t even = m % MR == 0 || m % MR > MR / 2;
    for (int64_t t = 0, r = 0; t < tiles; t++) {
        const int64_t rows = even ? m / tiles + (t < m % tiles) : t < tiles - 1 ? MR : m % MR;
        tile_of(kind, rows, (const char *)x + r * k * size, k, block, b, (char *)y + r * n * out, n, width,
                t == 0 && tiles > 1 ? &none : &pf);
        r += rows;
    }
}

/* block_rows for a gate block and the up block of the same outputs (tile_silu). The first tile's gate half
 * prefetches its up block; from the second tile on, the halves prefetch the next gate and up blocks the thread
 * takes (`next_gate`, `next_up`, or NULL). */
static inline __attribute__((always_inline)) void silu_rows(int kind, const void *x, int64_t m, int64_t k,
                                                             const void *gate, const void *up, const void *b_gate,
                                                             const void *b_up, void *y, int64_t n,
                                                             const void *next_gate, const void *next_up) {
    const int64_t size = kind == F32 ? 4 : 2, steps = kind == F32 ? k : k / 2, tiles = (m + MR - 1) / MR;
    const int64_t lines = k * BW * size / 64;
    const int64_t now_per = (lines + steps - 1) / steps;
    prefetch none = {0, 0, 0}, up_now = {(const char *)up, (const char *)up + lines * 64, now_per > 1 ? 2 : 1};
    prefetch pf_gate = none, pf_up = none;
    if (next_gate) {
        const int64_t later = tiles > 1 ? (tiles - 1) * steps : steps, per = (lines + later - 1) / later;
        pf_gate = (prefetch){(const char *)next_gate, (const char *)next_gate + lines * 64, per > 1 ? 2 : 1};
        pf_up = (prefetch){(const char *)next_up, (const char *)next_up + lines * 64, per > 1 ? 2 : 1};
    }
    const int64_t even = m % MR == 0 || m % MR > MR / 2;
    for (int64_t t = 0, r = 0; t < tiles; t++) {
        const int64_t rows = even ? m / tiles + (t < m % tiles) : t < tiles - 1 ? MR : m % MR;
        prefetch *first = t == 0 ? &up_now : &pf_gate, *second = t == 0 ? (tiles > 1 ? &none : &pf_gate) : &pf_up;
        const void *xr = (const char *)x + r * k * size;
        void *yr = (char *)y + r * n * size;
        switch (rows) {
#if MR == 12
        case 12: tile_silu(kind, 12, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 11: tile_silu(kind, 11, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 10: tile_silu(kind, 10, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 9: tile_silu(kind, 9, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 8: tile_silu(kind, 8, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 7: tile_silu(kind, 7, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
#endif
        case 6: tile_silu(kind, 6, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 5: tile_silu(kind, 5, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 4: tile_silu(kind, 4, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 3: tile_silu(kind, 3, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 2: tile_silu(kind, 2, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        case 1: tile_silu(kind, 1, xr, k, gate, up, b_gate, b_up, yr, n, first, second); break;
        default: break;
        }
        r += rows;
    }
}

/* y [m, inter] = silu(x W_gate^T) * (x W_up^T) for a weight packed as [gate; up] (2 * inter outputs, inter a
 * multiple of BW): a thread takes gate blocks and the up blocks of the same outputs, chunk by chunk of rows as
 * product does. The separate product would write 2 * inter outputs a row for the SiLU pass to read back. */
static inline __attribute__((always_inline)) void product_silu(int kind, const void *x, const void *packed,
                                                                const void *b, void *y, int64_t m, int64_t inter,
                                                                int64_t k, int64_t threads) {
    const int64_t half = inter / BW, chunk = CHUNK_ROWS, size = kind == F32 ? 4 : 2, bytes = k * BW * size;
    DEAL_COUNTS(counts, threads);
#pragma omp parallel num_threads(counts_team)
    {
        deal d = deal_start(half, m, chunk, omp_get_num_threads(), omp_get_thread_num(), counts);
        const char *base = (const char *)packed;
        int64_t r0, rows, after, blk;
        while ((blk = deal_next(&d, &r0, &rows, &after)) >= 0) {
            silu_rows(kind, (const char *)x + r0 * k * size, rows, k, base + blk * bytes, base + (blk + half) * bytes,
                      b ? (const char *)b + blk * BW * size : NULL,
                      b ? (const char *)b + (inter + blk * BW) * size : NULL,
                      (char *)y + (r0 * inter + blk * BW) * size, inter, after >= 0 ? base + after * bytes : NULL,
                      after >= 0 ? base + (after + half) * bytes : NULL);
        }
    }
}

/* Every chunk of rows times every block, the blocks dealt between threads (deal.h). */
static inline __attribute__((always_inline)) void product(int kind, const void *x, const void *packed,
                                                           const void *b, void *y, int64_t m, int64_t n, int64_t k,
                                                           int64_t threads) {
    const int64_t blocks = (n + BW - 1) / BW, chunk = CHUNK_ROWS, size = kind == F32 ? 4 : 2;
    const int64_t out = kind == BF16_PAIRS ? 2 : 4; /* bytes per output */
    DEAL_COUNTS(counts, threads);
#pragma omp parallel num_threads(counts_team)
    {
        /* A thread takes its run of blocks in every chunk (deal.h): after its last block of a chunk comes its
         * first again, for the next chunk's rows. */
        deal d = deal_start(blocks, m, chunk, omp_get_num_threads(), omp_get_thread_num(), counts);
        int64_t r0, rows, after, blk;
        while ((blk = deal_next(&d, &r0, &rows, &after)) >= 0) {
            const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
            block_rows(kind, (const char *)x + r0 * k * size, rows, k, (const char *)packed + blk * k * BW * size,
                       b ? (const char *)b + c0 * size : NULL, (char *)y + (r0 * n + c0) * out, n, width,
                       after >= 0 ? (const char *)packed + after * k * BW * size : NULL);
        }
    }
}

/* product's items with each output folded into its row's argmax (best.h) instead of stored: y is [m] indices.
 * kind F32 or BF16_WIDE, whose stored values the argmax is of. A chunk's outputs of one block go to a scratch
 * tile in L1, [rows][BW] fp32, and are scanned from there. Returns 0, or -1 out of memory. */
static inline __attribute__((always_inline)) int product_argmax(int kind, const void *x, const void *packed,
                                                                 const void *b, int64_t *y, int64_t m, int64_t n,
                                                                 int64_t k, int64_t threads) {
    const int64_t blocks = (n + BW - 1) / BW, chunk = CHUNK_ROWS, size = kind == F32 ? 4 : 2;
    DEAL_COUNTS(counts, threads);
    best *all = bests_open(counts_team, m);
    if (!all) return -1;
#pragma omp parallel num_threads(counts_team)
    {
        deal d = deal_start(blocks, m, chunk, omp_get_num_threads(), omp_get_thread_num(), counts);
        best *mine = all + omp_get_thread_num() * m;
        float scratch[CHUNK_ROWS][BW];
        int64_t r0, rows, after, blk;
        while ((blk = deal_next(&d, &r0, &rows, &after)) >= 0) {
            const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
            block_rows(kind, (const char *)x + r0 * k * size, rows, k, (const char *)packed + blk * k * BW * size,
                       b ? (const char *)b + c0 * size : NULL, scratch, BW, width,
                       after >= 0 ? (const char *)packed + after * k * BW * size : NULL);
            for (int64_t i = 0; i < rows; i++) best_scan(&mine[r0 + i], scratch[i], width, c0);
        }
    }
    bests_close(all, counts_team, m, y);
    return 0;
}

#ifdef __AMX_BF16__
#include "gemm_amx.h"
#else
static inline int amx_takes(int64_t k) {
    (void)k;
    return 0;
}
#endif

/* Whether bf16 products run on AMX tiles here (a build with them, and the process allowed to use them) where k is
 * a multiple of 32. */
int64_t hearth_gemm_amx(void) { return amx_takes(32); }

/* hearth_gemm_bf16 with y [m, n] fp32: each output the bf16 value that entry point stores, widened (the LM head's
 * logits, which sampling reads in fp32: no separate conversion pass over them). */
void hearth_gemm_bf16_wide(const uint16_t *x, const uint16_t *packed, const uint16_t *b, float *y, int64_t m,
                           int64_t n, int64_t k, int64_t threads, float *xf) {
    (void)xf;
#ifdef __AMX_BF16__
    if (amx_takes(k)) {
        amx_product(BF16_WIDE, x, packed, b, y, m, n, k, threads, 0, NULL, NULL);
        return;
    }
#endif
#ifdef __AVX512BF16__
    product(BF16_WIDE, x, packed, b, y, m, n, k, threads);
#else
    (void)x, (void)packed, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads;
#endif
}

/* Each row's argmax of hearth_gemm_f32's y (the first index of the maximum; a row with a NaN: its first NaN) into
 * y [m] int64, without storing the products: a greedy step's tokens from the LM head. 0, or -1 out of memory. */
int64_t hearth_gemm_argmax_f32(const float *x, const float *packed, const float *b, int64_t *y, int64_t m, int64_t n,
                               int64_t k, int64_t threads) {
    return product_argmax(F32, x, packed, b, y, m, n, k, threads);
}

/* The same of hearth_gemm_bf16_wide's y (each output rounded to bf16), where hearth_gemm_bf16_pairs() is 1;
 * elsewhere -1. */
int64_t hearth_gemm_argmax_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *b, int64_t *y, int64_t m,
                                int64_t n, int64_t k, int64_t threads) {
#ifdef __AMX_BF16__
    if (amx_takes(k)) return amx_product_argmax(x, packed, b, y, m, n, k, threads);
#endif
#ifdef __AVX512BF16__
    return product_argmax(BF16_WIDE, x, packed, b, y, m, n, k, threads);
#else
    (void)x, (void)packed, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return -1;
#endif
}

/* silu(gate) * up from a fused [gate; up] weight of 2 * inter outputs (inter % BW == 0, see
 * hearth_gemm_block_width): the arguments of hearth_gemm_f32 / _bf16 with n = inter, y [m, inter]. */
void hearth_gemm_silu_f32(const float *x, const float *packed, const float *b, float *y, int64_t m, int64_t inter,
                          int64_t k, int64_t threads) {
    product_silu(F32, x, packed, b, y, m, inter, k, threads);
}

void hearth_gemm_silu_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *b, uint16_t *y, int64_t m,
                           int64_t inter, int64_t k, int64_t threads, float *xf) {
    (void)xf;
#ifdef __AMX_BF16__
    if (amx_takes(k)) {
        amx_product(BF16_PAIRS, x, packed, b, y, m, inter, k, threads, 1, NULL, NULL);
        return;
    }
#endif
#ifdef __AVX512BF16__
    product_silu(BF16_PAIRS, x, packed, b, y, m, inter, k, threads);
#else
    (void)x, (void)packed, (void)b, (void)y, (void)m, (void)inter, (void)k, (void)threads;
#endif
}

/* Outputs per block: a fused gate/up weight takes the SiLU entry points where its halves are whole blocks. */
int64_t hearth_gemm_block_width(void) { return BW; }

/* The rows per chunk (tests walk across its boundaries) and per register tile. */
int64_t hearth_gemm_chunk_rows(void) { return CHUNK_ROWS; }

int64_t hearth_gemm_tile_rows(void) { return MR; }

/* Whether this build has hearth_gemm_bf16 (AVX-512 BF16: the weights in gemv.c's pairs of k). */
int64_t hearth_gemm_bf16_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* x [m, k] fp32; packed: ceil(n / BW) blocks of [k][BW] fp32 (outputs past n zero); b [n] or NULL; y [m, n].
 * threads: torch's count (omp_set_num_threads only set it for the thread that called torch.set_num_threads). */
void hearth_gemm_f32(const float *x, const float *packed, const float *b, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
    product(F32, x, packed, b, y, m, n, k, threads);
}

/* The same in bf16 on blocks of [k / 2][BW][2] (k even), where hearth_gemm_bf16_pairs() is 1 (elsewhere it does
 * nothing). xf is unused: the arguments are gemv.c's hearth_gemv_bf16's, so either serves a decode layer. */
void hearth_gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *b, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t threads, float *xf) {
    (void)xf;
#ifdef __AMX_BF16__
    if (amx_takes(k)) {
        amx_product(BF16_PAIRS, x, packed, b, y, m, n, k, threads, 0, NULL, NULL);
        return;
    }
#endif
#ifdef __AVX512BF16__
    product(BF16_PAIRS, x, packed, b, y, m, n, k, threads);
#else
    (void)x, (void)packed, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads;
#endif
}

/* hearth_gemm_bf16 (silu 0; n outputs) or hearth_gemm_silu_bf16 (silu 1; n = inter) with LoRA adapters' expands
 * added to each row's sums before its epilogue (lora_side.h). 1 when done; 0 where the product is not on AMX tiles
 * (this build or process, or k), and y is untouched: the caller adds the adapters apart. */
int64_t hearth_gemm_bf16_lora(const uint16_t *x, const uint16_t *packed, const uint16_t *b, uint16_t *y, int64_t m,
                              int64_t n, int64_t k, int64_t threads, int64_t silu, const lora_side *lora) {
#ifdef __AMX_BF16__
    if (amx_takes(k)) return amx_product(BF16_PAIRS, x, packed, b, y, m, n, k, threads, (int)silu, NULL, lora) == 0;
#endif
    (void)x, (void)packed, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads, (void)silu, (void)lora;
    return 0;
}

/* The shrinks of a projection's adapters (lora_side.h: count jobs, each rows of x times an adapter's stacked A, all
 * of one k) in one call on AMX tiles (gemm_amx.h's amx_shrinks). 1 when done; 0 where the products are not on
 * tiles (this build or process, or k) or out of memory: the caller runs them one at a time. */
int64_t hearth_gemm_bf16_shrinks(const lora_job *jobs, int64_t count, int64_t k, int64_t threads) {
#ifdef __AMX_BF16__
    if (amx_takes(k)) return amx_shrinks(jobs, count, k, threads) == 0;
#endif
    (void)jobs, (void)count, (void)k, (void)threads;
    return 0;
}
