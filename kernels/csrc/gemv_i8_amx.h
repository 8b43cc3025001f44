/* gemv_i8.c's products of int8 weights in pairs with bf16 x on AMX tiles (Intel Sapphire Rapids and later),
 * where the build has them and Linux lets the process use them: included by gemv_i8.c, whose pairs entry point
 * comes here for k a multiple of 32.
 *
 * Why: on an AMX Xeon the AVX-512 BF16 path above ran a 32-row product of SmolLM2's shapes 10x slower than the
 * bf16 weights' own product on tiles (gemm_amx.h; 320 against 31 us at 1536 x 576), so int8 weights made a
 * model's batches and prompts 3-4x slower, and even one row's dot products ran at 0.7x the fp32 path's there.
 * Here each block of int8 weights is widened once to bf16 (exact: an int8 fits bf16's significand) into a buffer
 * of the thread's, in the order it already has, [k / 2][BW = 32][2], which is what a weight tile reads (rows of
 * k-pairs, 64 bytes for 16 outputs), and the tiles multiply every 32 rows of x by it. The sums are those of the
 * int8 weights themselves, in fp32; the scale and the bias come after, and each output is rounded once, as in
 * the path above (the sums' order differs, so the two agree closely, not bit for bit).
 *
 * One or two rows (decode of one or two sequences) take neither the tiles (a block's widening is then all of the
 * work, and ran at half the rate of the dot products' own) nor those dot products, which ran at 0.7x the fp32
 * path's rate on that Xeon: i8_pairs_fma widens the weights to fp32 in place, multiplies each lane by its k's x
 * (a pair of k broadcast) and adds the two k of each output at the end, the fp32 path's instructions per weight
 * on the same packed pairs.
 *
 * Rows are taken in chunks of I8_AMX_CHUNK: x of a chunk stays in L2 while the blocks pass over it (512 rows of
 * k = 1536 are 1.5 MB). A chunk of more than 32 rows widens each block once, for all its units of 32 rows; one of
 * at most 32 (a decode step of up to 32 sequences) widens it a step of k at a time, into a ring of four steps
 * that stays in L1, just before the tiles read it. Widening is what the tiles wait on at few rows (1536 x 576 on
 * that Xeon, 2 threads, the block widened whole: 3 to 32 rows all ~55 us, 96 rows 98, 256 rows 209; the dot
 * products took 45, 316, 948 and 2,591 us, bf16 weights on tiles 31, 29, 78 and 212); widened step by step,
 * whole 32-concurrent passes of int8 SmolLM2 and Qwen2.5-0.5B ran 1.10x and 1.15x faster (docs/benchmarks.md).
 */
#include <stdlib.h>

#include "amx.h"

#define I8_AMX_ROWS 16   /* rows of an x tile */
#define I8_AMX_K 32      /* k per tile multiply */
#define I8_AMX_CHUNK 512 /* rows of x a block is widened for */
#ifndef I8_AMX_MIN_ROWS
#define I8_AMX_MIN_ROWS 3 /* fewest rows taken on tiles; fewer take i8_pairs_fma */
#endif

static int i8_amx_permitted;

__attribute__((constructor)) static void i8_amx_request(void) { i8_amx_permitted = amx_request_permission(); }

/* 16 int8 weights (e.g. 8 outputs times a pair of k) widened to fp32 (exact). */
static inline __m512 i8_widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* count (a multiple of 32) int8 weights as bf16, in the same order (exact: an int8 fits bf16's significand). */
static inline void i8_amx_widen(const int8_t *q, uint16_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i += 32)
        _mm512_storeu_si512((void *)(out + i), (__m512i)_mm512_cvtne2ps_pbh(i8_widen16(q + i + 16), i8_widen16(q + i)));
}

/* y [M, n] for M = 1 or 2 rows of bf16 x (xf: them widened, M * k floats) on blocks of [k / 2][BW][2]: per
 * block, four vectors of sums per row and per set of U interleaved steps, lane 2j + p holding output j's sums
 * over the k of parity p; the two parities are added at the end. */
static inline __attribute__((always_inline)) void i8_pairs_fma_block(int M, const float *xf, const int8_t *block,
                                                                     const float *scale, const uint16_t *b,
                                                                     uint16_t *y, int64_t n, int64_t k, int64_t c0,
                                                                     int64_t width) {
    enum { U = 2 };
    __m512 acc[U][2][4];
    for (int u = 0; u < U; u++)
        for (int j = 0; j < M; j++)
            for (int v = 0; v < 4; v++) acc[u][j][v] = _mm512_setzero_ps();
    const int64_t steps = k / 2;
    int64_t i = 0;
    for (; i + U <= steps; i += U)
        for (int u = 0; u < U; u++) {
            const int8_t *w = block + (i + u) * BW * 2;
            const __m512 w0 = i8_widen16(w), w1 = i8_widen16(w + 16), w2 = i8_widen16(w + 32), w3 = i8_widen16(w + 48);
            for (int j = 0; j < M; j++) {
                double pair;
                memcpy(&pair, xf + j * k + 2 * (i + u), sizeof pair);
                const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
                acc[u][j][0] = _mm512_fmadd_ps(w0, xb, acc[u][j][0]);
                acc[u][j][1] = _mm512_fmadd_ps(w1, xb, acc[u][j][1]);
                acc[u][j][2] = _mm512_fmadd_ps(w2, xb, acc[u][j][2]);
                acc[u][j][3] = _mm512_fmadd_ps(w3, xb, acc[u][j][3]);
            }
        }
    for (; i < steps; i++) { /* steps % U left */
        const int8_t *w = block + i * BW * 2;
        const __m512 w0 = i8_widen16(w), w1 = i8_widen16(w + 16), w2 = i8_widen16(w + 32), w3 = i8_widen16(w + 48);
        for (int j = 0; j < M; j++) {
            double pair;
            memcpy(&pair, xf + j * k + 2 * i, sizeof pair);
            const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
            acc[0][j][0] = _mm512_fmadd_ps(w0, xb, acc[0][j][0]);
            acc[0][j][1] = _mm512_fmadd_ps(w1, xb, acc[0][j][1]);
            acc[0][j][2] = _mm512_fmadd_ps(w2, xb, acc[0][j][2]);
            acc[0][j][3] = _mm512_fmadd_ps(w3, xb, acc[0][j][3]);
        }
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int j = 0; j < M; j++) {
        float sums[BW];
        for (int h = 0; h < 2; h++) { /* outputs [16h, 16h + 16): vectors 2h and 2h + 1 */
            __m512 a = acc[0][j][2 * h], c = acc[0][j][2 * h + 1];
            for (int u = 1; u < U; u++) {
                a = _mm512_add_ps(a, acc[u][j][2 * h]);
                c = _mm512_add_ps(c, acc[u][j][2 * h + 1]);
            }
            _mm512_storeu_ps(sums + 16 * h, _mm512_add_ps(_mm512_permutex2var_ps(a, even, c),
                                                          _mm512_permutex2var_ps(a, odd, c)));
        }
        for (int64_t c = 0; c < width; c++) {
            const float bias = b ? widen1_bf16(b[c0 + c]) : 0.f;
            y[j * n + c0 + c] = narrow1_bf16(sums[c] * scale[c0 + c] + bias);
        }
    }
}

/* gemv_i8.c's pairs product of m = 1 or 2 rows as i8_pairs_fma_block computes it: 0, or -1 out of memory. */
static int i8_pairs_fma(const uint16_t *x, const int8_t *packed, const float *scale, const uint16_t *b, uint16_t *y,
                        int64_t m, int64_t n, int64_t k, int64_t threads) {
    float *xf = malloc((size_t)(m * k) * sizeof *xf);
    if (!xf) return -1;
    for (int64_t i = 0; i < m * k; i++) xf[i] = widen1_bf16(x[i]);
    const int64_t blocks = (n + BW - 1) / BW;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
        if (m == 2) i8_pairs_fma_block(2, xf, packed + blk * k * BW, scale, b, y, n, k, c0, width);
        else i8_pairs_fma_block(1, xf, packed + blk * k * BW, scale, b, y, n, k, c0, width);
    }
    free(xf);
    return 0;
}

/* Rows [r, r + 16 * groups) of x (group g's rows at x[g], 2k bytes apart) times one block over all k: tiles 0-1
 * hold the first group's sums for the block's two halves of 16 outputs, 2-3 the second's. The block is w, widened
 * whole already; or, with q (its int8 pairs; a step of 32 k is 1,024 of them), widened here a step at a time into
 * a ring of four 2 KB steps that stays in L1, just before the tiles read it. */
static inline __attribute__((always_inline)) void i8_amx_unit(int groups, const uint16_t *x0, const uint16_t *x1,
                                                              const uint16_t *w, const int8_t *q,
                                                              uint16_t ring[4][1024], int64_t k,
                                                              float sums[32][BW]) {
    const int64_t stride = 2 * k, steps = k / I8_AMX_K;
    amx_tiles_zero();
    for (int64_t j = 0; j < steps; j++) {
        const char *wb;
        if (q) {
            i8_amx_widen(q + j * 1024, ring[j & 3], 1024);
            TILE_LOADS_SEE_STORES();
            wb = (const char *)ring[j & 3];
        } else {
            wb = (const char *)(w + j * 1024); /* a step is 2 KB */
        }
        amx_tiles_weights(wb);
        amx_tiles_rows(0, x0 + j * I8_AMX_K, stride);
        if (groups == 2) amx_tiles_rows(1, x1 + j * I8_AMX_K, stride);
    }
    amx_tiles_store(groups, sums[0], BW);
}

/* y[m, n] (bf16) = scale * (x [m, k] bf16 times packed: blocks of [k / 2][BW][2] int8) + b: 0, or -1 where it
 * did nothing (out of memory; the caller takes the path above). */
static int i8_amx_product(const uint16_t *x, const int8_t *packed, const float *scale, const uint16_t *b,
                          uint16_t *y, int64_t m, int64_t n, int64_t k, int64_t threads) {
    const int64_t blocks = (n + BW - 1) / BW, team = threads > 0 ? threads : 1;
    /* a last group of fewer than 16 rows reads them from a copy padded with zero rows */
    const int64_t tail_from = m - m % I8_AMX_ROWS;
    uint16_t *tail = NULL;
    if (m % I8_AMX_ROWS) {
        tail = calloc((size_t)(I8_AMX_ROWS * k), sizeof *tail);
        if (!tail) return -1;
        memcpy(tail, x + tail_from * k, (size_t)((m - tail_from) * k) * sizeof *tail);
    }
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        /* the whole block's buffer only where a chunk has more than one unit of 32 rows */
        uint16_t *w = m > 32 ? aligned_alloc(64, (size_t)(k * BW) * sizeof *w) : NULL; /* k * BW: 32 * k */
        float sums[32][BW];
        _Alignas(64) uint16_t ring[4][1024];
        if (m > 32 && !w) failed = 1;
        else amx_configure();
        for (int64_t c = 0; c < m; c += I8_AMX_CHUNK) {
            const int64_t end = m - c < I8_AMX_CHUNK ? m : c + I8_AMX_CHUNK;
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < blocks; blk++) {
                if (failed) continue;
                const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
                float sc[BW] = {0}, bias[BW] = {0}; /* zero past the last output */
                for (int64_t o = 0; o < width; o++) {
                    sc[o] = scale[c0 + o];
                    bias[o] = b ? widen1_bf16(b[c0 + o]) : 0.f;
                }
                const vec s0 = vload_f32(sc), s1 = vload_f32(sc + 16), b0 = vload_f32(bias), b1 = vload_f32(bias + 16);
                const int8_t *q = packed + blk * k * BW;
                const int stepwise = end - c <= 32;
                if (!stepwise) {
                    i8_amx_widen(q, w, k * BW);
                    TILE_LOADS_SEE_STORES();
                }
                for (int64_t r = c; r < end; r += 32) {
                    const int64_t here = end - r < 32 ? end - r : 32, groups = here > I8_AMX_ROWS ? 2 : 1;
                    const uint16_t *x0 = tail && r >= tail_from ? tail : x + r * k;
                    const uint16_t *x1 = tail && r + I8_AMX_ROWS >= tail_from ? tail : x + (r + I8_AMX_ROWS) * k;
                    if (stepwise) {
                        if (groups == 2) i8_amx_unit(2, x0, x1, NULL, q, ring, k, sums);
                        else i8_amx_unit(1, x0, x0, NULL, q, ring, k, sums);
                    } else if (groups == 2) i8_amx_unit(2, x0, x1, w, NULL, ring, k, sums);
                    else i8_amx_unit(1, x0, x0, w, NULL, ring, k, sums);
                    for (int64_t i = 0; i < here; i++) {
                        uint16_t *out = y + (r + i) * n + c0, row[BW];
                        const vec v0 = vadd(vmul(vload_f32(sums[i]), s0), b0); /* as the path above rounds */
                        const vec v1 = vadd(vmul(vload_f32(sums[i] + 16), s1), b1);
                        uint16_t *to = width == BW ? out : row;
                        _mm256_storeu_si256((__m256i *)to, narrow16_bf16(v0));
                        _mm256_storeu_si256((__m256i *)(to + 16), narrow16_bf16(v1));
                        if (to == row) memcpy(out, row, (size_t)width * sizeof *row);
                    }
                }
            }
        }
        if (!failed) _tile_release();
        free(w);
    }
    free(tail);
    return failed ? -1 : 0;
}
