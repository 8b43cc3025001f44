/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] (+ b[n]): products with weight-only int8 weights (one scale per
 * output column of y, i.e. per row of w), x, b and y in fp32 (_f32) or bf16 (_bf16), sums in fp32, each output
 * rounded once.
 *
 * Weight-only int8 reads a quarter of fp32's bytes per weight, and decode is the speed at which weights stream.
 * The weights are packed once (kernels/cpu_int8.pack) into column blocks of BW outputs: block c holds, for each
 * k in turn, the BW weights of outputs [c * BW, c * BW + BW), so a block is one sequential stream. A tile of MR
 * rows of x against one block keeps MR x BW fp32 sums in registers: each step of k widens the block's BW weights
 * int8 -> int32 -> fp32 once (exact: every int8 is an fp32) and multiplies them by each of the MR rows' x[k],
 * broadcast, so the widening is shared by the tile's rows and there is no horizontal sum at the end. One row
 * (decode) is the same loop with MR = 1: a GEMV streaming the block. With AVX-512 a block is 32 outputs and a
 * tile 12 rows (24 of 32 registers hold sums); with AVX2 16 outputs and 6 rows (12 of 16). Threads split the
 * blocks; a block stays in L2 while every tile of x passes over it. bf16 x is widened to fp32 once per call into
 * a buffer the caller passes, except with AVX-512 BF16: there the weights of a bf16 model are packed in pairs of
 * k ([k / 2][BW][2]) and each step widens a pair of int8 weights to a pair of bf16 (exact: int8 fits bf16's
 * 8-bit significand) for the dot product, which multiplies it by a pair of bf16 x into one fp32 lane. That does
 * twice the multiply-adds per instruction of the fp32 path, which is what past a few rows (prefill, batches)
 * decides: oneDNN's bf16 products use the same instruction, and int8 weights lost to them without it.
 * Where the build has AMX tiles, gemv_i8_amx.h takes those products instead: on an AMX Xeon these dot products
 * ran 6-13x slower than tiles at 32-1,024 rows, and one or two rows' slower than fp32 multiply-adds.
 * Built by kernels/cpu_build (-fopenmp: torch's OpenMP runtime and thread pool).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* VL int8 weights widened to fp32 (exact); tiles of MR rows keep 2 * MR of the build's vector registers. */
#ifdef __AVX512F__
#define MR 12
static inline vec load_w(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
#define MR 6
static inline vec load_w(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif
#define NB 2             /* vectors per block */
#define BW (NB * VL)     /* outputs per block */

#ifdef __AVX512BF16__
/* The VL outputs' pairs of int8 weights at p ([VL][2]) as VL pairs of bf16, in the same order. */
static inline __m512bh load_w_pairs(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + VL))));
    return _mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 values in the low half: pair j is still output j */
}
#endif

#ifdef __AMX_BF16__
#include "gemv_i8_amx.h"
#endif

/* The packed layout this build reads: the block width, and whether a bf16 model's blocks hold pairs of k. */
int64_t hearth_i8_block_width(void) { return BW; }

/* Whether bf16 products of int8 weights in pairs run on AMX tiles here (gemv_i8_amx.h; k a multiple of 32). */
int64_t hearth_i8_amx(void) {
#ifdef __AMX_BF16__
    return i8_amx_permitted;
#else
    return 0;
#endif
}

int64_t hearth_i8_bf16_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* acc[j][v] += (vector v of step i of the block) * (step i of row j of xr), for a tile's M rows: one step is one
 * k of fp32 x, or a pair of k of bf16 x (pairs, a constant where inlined). The step's weights widen once. */
static inline __attribute__((always_inline)) void step(int pairs, vec acc[MR][NB], const int8_t *block, int64_t i,
                                                        const void *xr, int64_t k, int M) {
#ifdef __AVX512BF16__
    if (pairs) {
        __m512bh w[NB];
        for (int v = 0; v < NB; v++) w[v] = load_w_pairs(block + (i * BW + v * VL) * 2);
        for (int j = 0; j < M; j++) {
            const __m512bh xb = vbcast_pair_bf16((const uint16_t *)xr + j * k + 2 * i);
            for (int v = 0; v < NB; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], w[v], xb);
        }
        return;
    }
#endif
    vec w[NB];
    for (int v = 0; v < NB; v++) w[v] = load_w(block + i * BW + v * VL);
    for (int j = 0; j < M; j++) {
        const vec xb = vbcast((const float *)xr + j * k + i);
        for (int v = 0; v < NB; v++) acc[j][v] = vfma(w[v], xb, acc[j][v]);
    }
}

/* sums[j][c] = sum_k x[m0 + j, k] * block[k][c] for M rows of x (a constant where inlined: the sums live in
 * registers). Each sum is a chain of dependent multiply-adds, and with one or two rows there are too few chains
 * to hide an instruction's latency: those tiles keep U = 4 / M sets of sums over interleaved steps, added at the
 * end. x is fp32, or bf16 with pairs. */
static inline __attribute__((always_inline)) void tile(int pairs, const void *x, const int8_t *block, int64_t k,
                                                        int64_t m0, int M, float sums[MR][BW]) {
    enum { UMAX = 4 };
    const int U = M == 1 ? 4 : M == 2 ? 2 : 1;
    vec acc[UMAX][MR][NB];
    for (int u = 0; u < U; u++)
        for (int j = 0; j < M; j++)
            for (int v = 0; v < NB; v++) acc[u][j][v] = vzero();
    const void *xr = (const char *)x + m0 * k * (pairs ? 2 : 4);
    const int64_t steps = pairs ? k / 2 : k;
    int64_t i = 0;
    for (; i + U <= steps; i += U)
        for (int u = 0; u < U; u++) step(pairs, acc[u], block, i + u, xr, k, M);
    for (; i < steps; i++) step(pairs, acc[0], block, i, xr, k, M); /* steps % U left */
    for (int j = 0; j < M; j++)
        for (int v = 0; v < NB; v++) {
            vec total = acc[0][j][v];
            for (int u = 1; u < U; u++) total = vadd(total, acc[u][j][v]);
            vstore(sums[j] + v * VL, total);
        }
}

/* One block of outputs for every row of x, tile by tile: scaled, the bias added, stored as fp32 or rounded once
 * to bf16 (pairs and bf16 constants where inlined). */
static inline __attribute__((always_inline)) void block_rows(int pairs, const void *x, const int8_t *packed,
                                                              const float *scale, const void *b, void *y, int64_t m,
                                                              int64_t n, int64_t k, int64_t blk, int bf16) {
    float sums[MR][BW];
    const int8_t *block = packed + blk * k * BW;
    const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const int64_t mc = m - m0 < MR ? m - m0 : MR;
        switch (mc) { /* one copy per tile height */
#if MR == 12
            case 12: tile(pairs, x, block, k, m0, 12, sums); break;
            case 11: tile(pairs, x, block, k, m0, 11, sums); break;
            case 10: tile(pairs, x, block, k, m0, 10, sums); break;
            case 9: tile(pairs, x, block, k, m0, 9, sums); break;
            case 8: tile(pairs, x, block, k, m0, 8, sums); break;
            case 7: tile(pairs, x, block, k, m0, 7, sums); break;
#endif
            case 6: tile(pairs, x, block, k, m0, 6, sums); break;
            case 5: tile(pairs, x, block, k, m0, 5, sums); break;
            case 4: tile(pairs, x, block, k, m0, 4, sums); break;
            case 3: tile(pairs, x, block, k, m0, 3, sums); break;
            case 2: tile(pairs, x, block, k, m0, 2, sums); break;
            default: tile(pairs, x, block, k, m0, 1, sums); break;
        }
        for (int64_t j = 0; j < mc; j++)
            for (int64_t c = 0; c < width; c++) {
                const int64_t at = (m0 + j) * n + c0 + c;
                if (bf16) {
                    const float bias = b ? widen1_bf16(((const uint16_t *)b)[c0 + c]) : 0.f;
                    ((uint16_t *)y)[at] = narrow1_bf16(sums[j][c] * scale[c0 + c] + bias);
                } else {
                    ((float *)y)[at] = sums[j][c] * scale[c0 + c] + (b ? ((const float *)b)[c0 + c] : 0.f);
                }
            }
    }
}

/* A static split: OpenMP's guided schedule, which gemv.c's products take, measured no different here (int8 engine
 * runs in one process, alternating the two builds on a Zen 4 VM: SmolLM2 single stream 1.007x in bf16 and 1.004x
 * in fp32, Qwen2.5-0.5B bf16 0.984x, SmolLM2 bf16 at 32 concurrent 1.007x; docs/benchmarks.md). */
#define PRODUCT(PAIRS, X, BF16)                                                                                 \
    do {                                                                                                       \
        const int64_t blocks = (n + BW - 1) / BW;                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)")                    \
        for (int64_t blk = 0; blk < blocks; blk++) block_rows(PAIRS, X, packed, scale, b, y, m, n, k, blk, BF16); \
    } while (0)

/* x [m, k] fp32; packed: ceil(n / BW) blocks of [k][BW] int8 (outputs past n zero); scale [n] fp32; b [n] fp32
 * or NULL; y [m, n] fp32. threads: torch's count (omp_set_num_threads only set it for the thread that called
 * torch.set_num_threads). */
void hearth_gemv_i8_f32(const float *x, const int8_t *packed, const float *scale, const float *b, float *y,
                        int64_t m, int64_t n, int64_t k, int64_t threads) {
    PRODUCT(0, x, 0);
}

/* The same with x, b and y in bf16. xf: a buffer of m * k floats, which receives x widened. */
void hearth_gemv_i8_bf16(const uint16_t *xb, const int8_t *packed, const float *scale, const uint16_t *b,
                         uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t threads, float *xf) {
    for (int64_t i = 0; i < m * k; i++) xf[i] = widen1_bf16(xb[i]);
    PRODUCT(0, xf, 1);
}

/* The same with blocks of [k / 2][BW][2] int8 (k even) and x used as it is: builds where hearth_i8_bf16_pairs()
 * is 1 (elsewhere it does nothing). */
void hearth_gemv_i8_bf16_pairs(const uint16_t *x, const int8_t *packed, const float *scale, const uint16_t *b,
                               uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
#ifdef __AVX512BF16__
#ifdef __AMX_BF16__
    if (m >= I8_AMX_MIN_ROWS && i8_amx_permitted && k % I8_AMX_K == 0
        && i8_amx_product(x, packed, scale, b, y, m, n, k, threads) == 0)
        return;
    if (m < I8_AMX_MIN_ROWS && i8_pairs_fma(x, packed, scale, b, y, m, n, k, threads) == 0) return;
#endif
    PRODUCT(1, x, 1);
#else
    (void)x, (void)packed, (void)scale, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads;
#endif
}
