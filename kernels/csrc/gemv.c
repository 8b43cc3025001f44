/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for one or two rows of x: decode's matrix-vector products, in fp32
 * or bf16 (fp32 sums, each output rounded once).
 *
 * A decode step reads every weight once and does two flops per weight, so its speed is the speed at which the
 * weights stream from memory. The weights are packed once (kernels/cpu_gemv.pack) into column blocks of BW
 * outputs, k-major: block c holds, for each k in turn, the BW weights of outputs [c * BW, c * BW + BW), so a
 * block is one sequential stream and each step of k is NB full vectors multiplied by x[k], broadcast. The BW
 * sums stay in registers for the whole of k and there is no horizontal sum at the end, which with rows of
 * 576-896 weights cost as much as the products (one output row per vector, the layout this replaced: ~23 GB/s
 * for bf16 against ~35 packed on an AVX-512 EPYC, docs/benchmarks.md). Each sum is a chain of dependent
 * multiply-adds: one row of x keeps U = 4 sets of sums over interleaved steps of k, two rows 2, added at the
 * end, so the chains hide the instruction's latency. Threads share the blocks out (PRODUCT, below).
 *
 * Per build: AVX-512 blocks are 32 outputs (two 16-lane vectors), AVX2 16. bf16 weights with AVX-512 BF16 are
 * packed in pairs of k ([k / 2][BW][2]) for its dot product, which multiplies a pair of weights by a pair of x
 * values into one fp32 lane with no widening; elsewhere bf16 weights are widened to fp32 as they load and bf16 x
 * once per call into a buffer the caller passes. Built by kernels/cpu_build (-fopenmp: torch's OpenMP runtime
 * and thread pool).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "best.h"
#include "simd.h"

/* VL-lane bf16 weights widened to fp32 (exact). */
#ifdef __AVX512F__
static inline vec vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#else
static inline vec vload_bf16(const uint16_t *p) { return widen8_bf16(p); }
#endif
#define NB 2         /* vectors per block */
#define BW (NB * VL) /* outputs per block */

/* On the Intel Xeons the weights stream faster when every line is asked for 8 KiB ahead into L2 (the build defines
 * HEARTH_PREFETCH_L2 there: kernels/cpu_build.defines). With the tiles' AVX-512 BF16 pairs the dot products left
 * the weights streaming at ~0.73x the fp32 GEMV's bytes per second: the same blocks, the same loads, only the
 * instruction differs, and its longer chains seem to hold back how many lines the core keeps in flight. The
 * prefetch brought them level: Qwen2.5-0.5B's decode shapes, 2 threads, one process per build alternated, bf16
 * 21.2-22.3 -> 27.0-29.5 GB/s (fp32 28.5-32.1 beside them), the LM head 21.9-23.8 -> 29.0-31.4; 4 KiB into L1 or
 * 16 KiB into L2 no better. fp32 gains too, on a model 207 Xeon without AVX-512 BF16: a token's products (every
 * matrix pooled on huge pages, builds alternated in one process, 12 rounds) 1.066x for Qwen2.5-0.5B (25.6 ->
 * 27.6 GB/s) and 1.044x for SmolLM2-135M; 4 and 12 KiB ahead within a percent of 8, 2 KiB into L1 1.025x
 * (docs/benchmarks.md, CPU peers). Past a block's end it fetches the next block's start, which the same thread
 * mostly takes next (guided runs of blocks), and past the matrix's end a prefetch faults nothing. Not on the AMD
 * EPYCs, which stream at 87-95% of the read rate without it and measured slower with it (Zen 4). */
#define AHEAD_BYTES 8192

/* How the weights are laid out: */
enum { F32, /* fp32 weights, fp32 x: a step is one k */
       BF16, /* bf16 weights widened as they load, x widened to fp32 beforehand: a step is one k */
       BF16_PAIRS /* bf16 weights in pairs of k, bf16 x: a step is a pair of k (AVX-512 BF16 dot products) */ };

/* The packed layout this build reads: the block width, and whether bf16 blocks hold pairs of k. */
int64_t hearth_gemv_block_width(void) { return BW; }

int64_t hearth_gemv_bf16_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* acc + (vector v of step i of the block) * (step i of x). Inlined with a constant kind: one loop per layout. */
static inline __attribute__((always_inline)) vec mac(int kind, vec acc, const void *block, int64_t i, int v,
                                                     const void *x) {
#ifdef __AVX512BF16__
    if (kind == BF16_PAIRS) {
        const __m512i w = _mm512_loadu_si512((const uint16_t *)block + (i * BW + v * VL) * 2);
        return _mm512_dpbf16_ps(acc, (__m512bh)w, vbcast_pair_bf16((const uint16_t *)x + 2 * i));
    }
#endif
    const vec w = kind == F32 ? vload_f32((const float *)block + i * BW + v * VL)
                              : vload_bf16((const uint16_t *)block + i * BW + v * VL);
    return vfma(w, vbcast((const float *)x + i), acc);
}

/* sums[j][c] = sum over the block's steps of x row j times output c, for M = 1 or 2 rows (xr[j]). */
static inline __attribute__((always_inline)) void tile(int kind, const void *const xr[2], const void *block,
                                                        int64_t steps, int M, float sums[2][BW]) {
    enum { UMAX = 4 };
    const int U = M == 1 ? 4 : 2;
    vec acc[UMAX][2][NB];
    for (int u = 0; u < U; u++)
        for (int j = 0; j < M; j++)
            for (int v = 0; v < NB; v++) acc[u][j][v] = vzero();
    int64_t i = 0;
    for (; i + U <= steps; i += U) {
#ifdef HEARTH_PREFETCH_L2
        if (kind == F32 || kind == BF16_PAIRS) /* a step of either is BW * 4 bytes: U * BW * 4 / 64 lines */
            for (int l = 0; l < U * BW * 4 / 64; l++)
                _mm_prefetch((const char *)block + i * BW * 4 + AHEAD_BYTES + 64 * l, _MM_HINT_T1);
#endif
        for (int u = 0; u < U; u++)
            for (int j = 0; j < M; j++)
                for (int v = 0; v < NB; v++) acc[u][j][v] = mac(kind, acc[u][j][v], block, i + u, v, xr[j]);
    }
    for (; i < steps; i++) /* steps % U left */
        for (int j = 0; j < M; j++)
            for (int v = 0; v < NB; v++) acc[0][j][v] = mac(kind, acc[0][j][v], block, i, v, xr[j]);
    for (int j = 0; j < M; j++)
        for (int v = 0; v < NB; v++) {
            vec total = acc[0][j][v];
            for (int u = 1; u < U; u++) total = vadd(total, acc[u][j][v]);
            vstore(sums[j] + v * VL, total);
        }
}

/* One block of outputs for every row of x: the bias added, stored as fp32 or rounded once to bf16. x holds
 * fp32 rows of k (F32, BF16) or bf16 rows of k (BF16_PAIRS); the weights and b are bf16 unless kind is F32. */
static inline __attribute__((always_inline)) void block_rows_to(int kind, const void *x, const void *packed,
                                                                 const void *b, void *y, int64_t m, int64_t n,
                                                                 int64_t k, int64_t blk, int64_t y_stride,
                                                                 int64_t y_col, int wide) {
    const int64_t steps = kind == BF16_PAIRS ? k / 2 : k;
    const int64_t wsize = kind == F32 ? 4 : 2, xsize = kind == BF16_PAIRS ? 2 : 4;
    const void *block = (const char *)packed + blk * k * BW * wsize;
    const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
    float sums[2][BW];
    for (int64_t m0 = 0; m0 < m; m0 += 2) {
        const void *const xr[2] = {(const char *)x + m0 * k * xsize, (const char *)x + (m0 + 1) * k * xsize};
        const int64_t mc = m - m0 < 2 ? m - m0 : 2;
        if (mc == 2) tile(kind, xr, block, steps, 2, sums);
        else tile(kind, xr, block, steps, 1, sums);
        for (int64_t j = 0; j < mc; j++)
            for (int64_t c = 0; c < width; c++) {
                const int64_t at = (m0 + j) * y_stride + y_col + c;
                if (kind == F32) {
                    ((float *)y)[at] = sums[j][c] + (b ? ((const float *)b)[c0 + c] : 0.f);
                } else {
                    const float bias = b ? widen1_bf16(((const uint16_t *)b)[c0 + c]) : 0.f;
                    const uint16_t out = narrow1_bf16(sums[j][c] + bias);
                    if (wide) ((float *)y)[at] = widen1_bf16(out); /* the stored value, as fp32 */
                    else ((uint16_t *)y)[at] = out;
                }
            }
    }
}

/* Block `blk` of y [m, n] (stored in y's dtype). */
static inline __attribute__((always_inline)) void block_rows(int kind, const void *x, const void *packed,
                                                              const void *b, void *y, int64_t m, int64_t n,
                                                              int64_t k, int64_t blk) {
    block_rows_to(kind, x, packed, b, y, m, n, k, blk, n, blk * BW, 0);
}

/* Guided, not static: with an even split one thread waited at the end of each product for the other (a VM's two
 * cores rarely stream at one speed for long); guided hands out shrinking runs of blocks, so whoever is free takes
 * the last ones. A SmolLM2 token's products 1.035x faster in bf16 on a Zen 4 VM, the engine's single stream 1.07x
 * in bf16 and 1.05x in fp32 (in one process, alternating). The GEMM's dealing (deal.h), tried here first, read
 * 1.06x in bf16 but 0.59x in fp32. Each block is still computed whole by one thread: results do not change. */
#define PRODUCT(KIND, X)                                                                                        \
    do {                                                                                                       \
        const int64_t blocks = (n + BW - 1) / BW;                                                              \
        _Pragma("omp parallel for schedule(guided) num_threads(threads > 0 ? threads : 1)")                    \
        for (int64_t blk = 0; blk < blocks; blk++) block_rows(KIND, X, packed, b, y, m, n, k, blk);            \
    } while (0)

/* x [m, k] fp32 with m <= 2 per tile (any m works, two rows at a time); packed: ceil(n / BW) blocks of
 * [k][BW] fp32 (outputs past n zero); b [n] or NULL; y [m, n]. threads: torch's count (omp_set_num_threads
 * only set it for the thread that called torch.set_num_threads). */
void hearth_gemv_f32(const float *x, const float *packed, const float *b, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
    PRODUCT(F32, x);
}

/* The same with x, the weights, b and y in bf16; blocks of [k / 2][BW][2] where hearth_gemv_bf16_pairs() says
 * so (k even), else [k][BW]. xf: a buffer of m * k floats for x widened (unused with pairs). */
void hearth_gemv_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *b, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t threads, float *xf) {
#ifdef __AVX512BF16__
    (void)xf;
    PRODUCT(BF16_PAIRS, x);
#else
    for (int64_t i = 0; i < m * k; i++) xf[i] = widen1_bf16(x[i]);
    PRODUCT(BF16, xf);
#endif
}

/* Each row's argmax of the y the entry points above store (the first index of the maximum; a row with a NaN: its
 * first NaN; best.h), without storing it: a greedy decode's tokens from the LM head. Each thread folds the
 * outputs of the blocks it computed into its own bests while they are in L1; reading a stored y back on one
 * thread instead found half of it in the other core's cache (72 us for SmolLM2's 49,152 outputs of a row on a
 * Zen 4 VM, against 13 us with y local). Returns 0, -1 out of memory, or -2 for more than MAX_ARGMAX_ROWS rows. */
#define MAX_ARGMAX_ROWS 2
#define PRODUCT_ARGMAX(KIND, X)                                                                                \
    do {                                                                                                       \
        if (m > MAX_ARGMAX_ROWS) return -2;                                                                    \
        const int64_t blocks = (n + BW - 1) / BW, team = threads > 0 ? threads : 1;                            \
        best *all = bests_open(team, m);                                                                       \
        if (!all) return -1;                                                                                   \
        _Pragma("omp parallel num_threads(team)")                                                              \
        {                                                                                                      \
            best *mine = all + omp_get_thread_num() * m;                                                       \
            float scratch[MAX_ARGMAX_ROWS * BW];                                                               \
            _Pragma("omp for schedule(guided)")                                                                \
            for (int64_t blk = 0; blk < blocks; blk++) {                                                       \
                const int64_t width = n - blk * BW < BW ? n - blk * BW : BW;                                  \
                block_rows_to(KIND, X, packed, b, scratch, m, n, k, blk, BW, 0, 1);                           \
                for (int64_t r = 0; r < m; r++) best_scan(&mine[r], scratch + r * BW, width, blk * BW);       \
            }                                                                                                  \
        }                                                                                                      \
        bests_close(all, team, m, out);                                                                        \
        return 0;                                                                                              \
    } while (0)

int64_t hearth_gemv_argmax_f32(const float *x, const float *packed, const float *b, int64_t *out, int64_t m,
                               int64_t n, int64_t k, int64_t threads) {
    PRODUCT_ARGMAX(F32, x);
}

/* xf: as hearth_gemv_bf16's. */
int64_t hearth_gemv_argmax_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *b, int64_t *out, int64_t m,
                                int64_t n, int64_t k, int64_t threads, float *xf) {
#ifdef __AVX512BF16__
    (void)xf;
    PRODUCT_ARGMAX(BF16_PAIRS, x);
#else
    for (int64_t i = 0; i < m * k; i++) xf[i] = widen1_bf16(x[i]);
    PRODUCT_ARGMAX(BF16, xf);
#endif
}
