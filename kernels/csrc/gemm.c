/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) in fp32 for many rows of x: the products of a step of many tokens
 * (32 decoding sequences, a prompt), on the same packed weights as the one- and two-row products of gemv.c.
 *
 * Those weights are packed once (kernels/cpu_gemv.pack) into column blocks of BW outputs, k-major: for each k in
 * turn, the BW weights of outputs [c * BW, c * BW + BW). A register tile of MR rows of x by one block (MR x NB
 * vectors of sums) walks the whole of k: each step loads the block's NB weight vectors once and multiplies them
 * by MR broadcast values of x, so a weight load feeds MR multiply-adds and no sum leaves its register until k
 * ends. On AVX2 that is 6 x 2 vectors of sums, two weight vectors and one broadcast: 15 of the 16 registers. The
 * MR x NB chains of sums are independent, enough to keep both FMA pipes busy through their latency.
 *
 * A thread takes whole blocks and sweeps them over CHUNK_ROWS rows at a time: each block of weights is read from
 * memory once per chunk and then from L1/L2 for every tile of the chunk's rows, whose x (221 KB at k = 576)
 * stays in the caches meanwhile. Measured on the AVX2 EPYC of docs/benchmarks.md: chunks sized to keep x within
 * 256 KB (12 rows at Qwen's k = 4864) re-read the weights too often there (down projection 106-123 GFLOP/s
 * against 122-143 for 48-96 rows), and blocking k as well gained nothing (the extra passes over y cost what
 * the smaller weight panels saved).
 *
 * Built by kernels/cpu_build (-fopenmp: torch's OpenMP runtime and thread pool).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

#define NB 2         /* vectors per block: the layout of gemv.c */
#define BW (NB * VL) /* outputs per block */
#define MR 6         /* rows per register tile */
#define CHUNK_ROWS 96 /* 16 tiles */

/* Rows [0, M) of x (row stride k) times one block over all k: y's rows (stride n) get the sums plus the bias;
 * width is how many of the block's outputs exist (the last block may be partial). M is a constant once inlined,
 * so the tile's sums live in registers. */
static inline __attribute__((always_inline)) void tile(int M, const float *x, int64_t k, const float *block,
                                                        const float *b, float *y, int64_t n, int64_t width) {
    vec acc[MR][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        acc[r][0] = vzero();
        acc[r][1] = vzero();
    }
    for (int64_t i = 0; i < k; i++) {
        const vec w0 = vload_f32(block + i * BW), w1 = vload_f32(block + i * BW + VL);
        _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
            const vec xr = vbcast(x + r * k + i);
            acc[r][0] = vfma(w0, xr, acc[r][0]);
            acc[r][1] = vfma(w1, xr, acc[r][1]);
        }
    }
    if (width == BW) {
        const vec b0 = b ? vload_f32(b) : vzero(), b1 = b ? vload_f32(b + VL) : vzero();
        _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
            vstore(y + r * n, vadd(acc[r][0], b0));
            vstore(y + r * n + VL, vadd(acc[r][1], b1));
        }
        return;
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < M; r++) {
        float sums[BW];
        vstore(sums, acc[r][0]);
        vstore(sums + VL, acc[r][1]);
        for (int64_t c = 0; c < width; c++) y[r * n + c] = sums[c] + (b ? b[c] : 0.f);
    }
}

/* m rows of x times one block: full tiles of MR rows, then one tile of the rows left. */
static void block_rows(const float *x, int64_t m, int64_t k, const float *block, const float *b, float *y,
                       int64_t n, int64_t width) {
    int64_t r = 0;
    for (; r + MR <= m; r += MR) tile(MR, x + r * k, k, block, b, y + r * n, n, width);
    x += r * k;
    y += r * n;
    switch (m - r) {
    case 1: tile(1, x, k, block, b, y, n, width); break;
    case 2: tile(2, x, k, block, b, y, n, width); break;
    case 3: tile(3, x, k, block, b, y, n, width); break;
    case 4: tile(4, x, k, block, b, y, n, width); break;
    case 5: tile(5, x, k, block, b, y, n, width); break;
    default: break;
    }
}

/* The rows per chunk (tests walk across its boundaries). */
int64_t hearth_gemm_chunk_rows(void) { return CHUNK_ROWS; }

/* x [m, k] fp32; packed: ceil(n / BW) blocks of [k][BW] fp32 (outputs past n zero); b [n] or NULL; y [m, n].
 * threads: torch's count (omp_set_num_threads only set it for the thread that called torch.set_num_threads). */
void hearth_gemm_f32(const float *x, const float *packed, const float *b, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
    const int64_t blocks = (n + BW - 1) / BW, chunk = CHUNK_ROWS;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t rows = m - r0 < chunk ? m - r0 : chunk;
        /* static and nowait: a thread takes the same blocks in every chunk, so no thread waits on another */
#pragma omp for schedule(static) nowait
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
            block_rows(x + r0 * k, rows, k, packed + blk * k * BW, b ? b + c0 : NULL, y + r0 * n + c0, n, width);
        }
    }
}
