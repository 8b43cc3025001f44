/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for a few rows of x: decode's matrix-vector products, in fp32
 * or bf16 (bf16 operands widened to fp32 as they are loaded, fp32 sums, each output rounded once).
 *
 * A decode step reads every weight once and does two flops per weight, so its speed is the speed at which the
 * weights stream from memory. Each thread walks its own contiguous band of output rows, four rows at a time:
 * four sequential read streams (what hardware prefetchers follow best), eight-wide FMAs, and every row of x
 * applied while the four weight rows are still in L1, so a weight is read from memory once per call whatever
 * the number of x rows. Built by kernels/cpu_gemv.py with -mavx2 -mfma -fopenmp, linked at run time against the
 * OpenMP runtime torch already loaded (one thread pool for both).
 */
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

static inline __m256 load8_f32(const void *p, int64_t i) { return _mm256_loadu_ps((const float *)p + i); }

static inline __m256 load8_bf16(const void *p, int64_t i) { return widen8_bf16((const uint16_t *)p + i); }

static inline float load1_f32(const void *p, int64_t i) { return p ? ((const float *)p)[i] : 0.f; }

static inline float load1_bf16(const void *p, int64_t i) { return p ? widen1_bf16(((const uint16_t *)p)[i]) : 0.f; }

static inline void store1_f32(void *p, int64_t i, float x) { ((float *)p)[i] = x; }

static inline void store1_bf16(void *p, int64_t i, float x) { ((uint16_t *)p)[i] = narrow1_bf16(x); }

typedef __m256 (*load8_fn)(const void *, int64_t);
typedef float (*load1_fn)(const void *, int64_t);
typedef void (*store1_fn)(void *, int64_t, float);

/* Rows [n0, n0 + 4) of w against rows [m0, m0 + mc) of x, mc <= 2. k is a multiple of 8. Always inlined with
 * constant loaders: one copy per dtype. */
static inline __attribute__((always_inline)) void block4(const void *x, const void *w, void *y, int64_t k,
                                                          int64_t n, int64_t n0, int64_t m0, int64_t mc,
                                                          const void *b, load8_fn load8, load1_fn load1,
                                                          store1_fn store1) {
    const int64_t r0 = n0 * k, r1 = r0 + k, r2 = r1 + k, r3 = r2 + k;
    const int64_t xa = m0 * k, xb = xa + (mc > 1 ? k : 0);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int64_t i = 0; i < k; i += 8) {
        __m256 v0 = load8(w, r0 + i), v1 = load8(w, r1 + i);
        __m256 v2 = load8(w, r2 + i), v3 = load8(w, r3 + i);
        __m256 p = load8(x, xa + i);
        a0 = _mm256_fmadd_ps(v0, p, a0);
        a1 = _mm256_fmadd_ps(v1, p, a1);
        a2 = _mm256_fmadd_ps(v2, p, a2);
        a3 = _mm256_fmadd_ps(v3, p, a3);
        if (mc > 1) {
            __m256 q = load8(x, xb + i);
            c0 = _mm256_fmadd_ps(v0, q, c0);
            c1 = _mm256_fmadd_ps(v1, q, c1);
            c2 = _mm256_fmadd_ps(v2, q, c2);
            c3 = _mm256_fmadd_ps(v3, q, c3);
        }
    }
    const float b0 = load1(b, n0), b1 = load1(b, n0 + 1), b2 = load1(b, n0 + 2), b3 = load1(b, n0 + 3);
    const int64_t ya = m0 * n + n0;
    store1(y, ya, hsum(a0) + b0); store1(y, ya + 1, hsum(a1) + b1);
    store1(y, ya + 2, hsum(a2) + b2); store1(y, ya + 3, hsum(a3) + b3);
    if (mc > 1) {
        const int64_t yb = ya + n;
        store1(y, yb, hsum(c0) + b0); store1(y, yb + 1, hsum(c1) + b1);
        store1(y, yb + 2, hsum(c2) + b2); store1(y, yb + 3, hsum(c3) + b3);
    }
}


/* One output row, for the n % 4 rows left over. */
static inline __attribute__((always_inline)) void row1(const void *x, const void *w, void *y, int64_t k,
                                                        int64_t n, int64_t row, int64_t m, const void *b,
                                                        load8_fn load8, load1_fn load1, store1_fn store1) {
    for (int64_t j = 0; j < m; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) acc = _mm256_fmadd_ps(load8(w, row * k + i), load8(x, j * k + i), acc);
        store1(y, j * n + row, hsum(acc) + load1(b, row));
    }
}

#ifdef __AVX512BF16__
/* bf16 rows [n0, n0 + 4) against rows [m0, m0 + mc) of x with AVX-512 BF16 dot products: 32 weights per
 * instruction and no widening, where the AVX2 path spends more instructions widening than multiplying (it
 * streams bf16 weights at ~30 GB/s, fp32 ones at ~45). The first k32 = k - k % 32 columns; the rest by AVX2. */
static inline void block4_dp(const uint16_t *x, const uint16_t *w, float sums[2][4], int64_t k, int64_t k32,
                             int64_t n0, int64_t m0, int64_t mc) {
    const uint16_t *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const uint16_t *xa = x + m0 * k, *xb = xa + (mc > 1 ? k : 0);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int64_t i = 0; i < k32; i += 32) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + i), v1 = (__m512bh)_mm512_loadu_si512(w1 + i);
        __m512bh v2 = (__m512bh)_mm512_loadu_si512(w2 + i), v3 = (__m512bh)_mm512_loadu_si512(w3 + i);
        __m512bh p = (__m512bh)_mm512_loadu_si512(xa + i);
        a0 = _mm512_dpbf16_ps(a0, v0, p);
        a1 = _mm512_dpbf16_ps(a1, v1, p);
        a2 = _mm512_dpbf16_ps(a2, v2, p);
        a3 = _mm512_dpbf16_ps(a3, v3, p);
        if (mc > 1) {
            __m512bh q = (__m512bh)_mm512_loadu_si512(xb + i);
            c0 = _mm512_dpbf16_ps(c0, v0, q);
            c1 = _mm512_dpbf16_ps(c1, v1, q);
            c2 = _mm512_dpbf16_ps(c2, v2, q);
            c3 = _mm512_dpbf16_ps(c3, v3, q);
        }
    }
    sums[0][0] = _mm512_reduce_add_ps(a0); sums[0][1] = _mm512_reduce_add_ps(a1);
    sums[0][2] = _mm512_reduce_add_ps(a2); sums[0][3] = _mm512_reduce_add_ps(a3);
    sums[1][0] = _mm512_reduce_add_ps(c0); sums[1][1] = _mm512_reduce_add_ps(c1);
    sums[1][2] = _mm512_reduce_add_ps(c2); sums[1][3] = _mm512_reduce_add_ps(c3);
    for (int64_t i = k32; i < k; i += 8) { /* k % 32 columns left, eight at a time */
        __m256 p = load8_bf16(xa, i), q = load8_bf16(xb, i);
        const uint16_t *rows[4] = {w0, w1, w2, w3};
        for (int r = 0; r < 4; r++) {
            __m256 v = load8_bf16(rows[r], i);
            sums[0][r] += hsum(_mm256_mul_ps(v, p));
            if (mc > 1) sums[1][r] += hsum(_mm256_mul_ps(v, q));
        }
    }
}

static void gemv_bf16_dp(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m,
                         int64_t n, int64_t k, int64_t threads) {
    const int64_t blocks = n / 4, k32 = k - k % 32;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t blk = 0; blk < blocks; blk++) {
        for (int64_t m0 = 0; m0 < m; m0 += 2) {
            const int64_t mc = m - m0 < 2 ? m - m0 : 2;
            float sums[2][4];
            block4_dp(x, w, sums, k, k32, blk * 4, m0, mc);
            for (int64_t j = 0; j < mc; j++)
                for (int r = 0; r < 4; r++)
                    store1_bf16(y, (m0 + j) * n + blk * 4 + r, sums[j][r] + load1_bf16(b, blk * 4 + r));
        }
    }
    for (int64_t row = blocks * 4; row < n; row++)
        row1(x, w, y, k, n, row, m, b, load8_bf16, load1_bf16, store1_bf16);
}
#endif

#define GEMV(LOAD8, LOAD1, STORE1)                                                                              \
    do {                                                                                                       \
        const int64_t blocks = n / 4;                                                                          \
        _Pragma("omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)")                    \
        for (int64_t blk = 0; blk < blocks; blk++)                                                             \
            for (int64_t m0 = 0; m0 < m; m0 += 2)                                                              \
                block4(x, w, y, k, n, blk * 4, m0, m - m0 < 2 ? m - m0 : 2, b, LOAD8, LOAD1, STORE1);          \
        for (int64_t row = blocks * 4; row < n; row++) row1(x, w, y, k, n, row, m, b, LOAD8, LOAD1, STORE1);   \
    } while (0)

/* x [m, k], w [n, k], b [n] or NULL, y [m, n]; all contiguous, all fp32 (_f32) or all bf16 (_bf16);
 * k % 8 == 0. threads: torch's count, passed explicitly because omp_set_num_threads only set it for the thread
 * that called torch.set_num_threads. */
void hearth_gemv_f32(const float *x, const float *w, const float *b, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
    GEMV(load8_f32, load1_f32, store1_f32);
}

void hearth_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t m, int64_t n,
                      int64_t k, int64_t threads) {
#ifdef __AVX512BF16__
    gemv_bf16_dp(x, w, b, y, m, n, k, threads);
#else
    GEMV(load8_bf16, load1_bf16, store1_bf16);
#endif
}
