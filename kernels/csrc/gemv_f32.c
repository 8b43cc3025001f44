/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for a few rows of x: decode's matrix-vector products in fp32.
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

/* Rows [n0, n0 + 4) of w against rows [m0, m0 + mc) of x, mc <= 2. k is a multiple of 8. */
static inline void block4(const float *x, const float *w, float *y, int64_t k, int64_t n, int64_t n0,
                          int64_t m0, int64_t mc, const float *b) {
    const float *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *xa = x + m0 * k, *xb = xa + (mc > 1 ? k : 0);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int64_t i = 0; i < k; i += 8) {
        __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        __m256 v2 = _mm256_loadu_ps(w2 + i), v3 = _mm256_loadu_ps(w3 + i);
        __m256 p = _mm256_loadu_ps(xa + i);
        a0 = _mm256_fmadd_ps(v0, p, a0);
        a1 = _mm256_fmadd_ps(v1, p, a1);
        a2 = _mm256_fmadd_ps(v2, p, a2);
        a3 = _mm256_fmadd_ps(v3, p, a3);
        if (mc > 1) {
            __m256 q = _mm256_loadu_ps(xb + i);
            c0 = _mm256_fmadd_ps(v0, q, c0);
            c1 = _mm256_fmadd_ps(v1, q, c1);
            c2 = _mm256_fmadd_ps(v2, q, c2);
            c3 = _mm256_fmadd_ps(v3, q, c3);
        }
    }
    float b0 = b ? b[n0] : 0.f, b1 = b ? b[n0 + 1] : 0.f, b2 = b ? b[n0 + 2] : 0.f, b3 = b ? b[n0 + 3] : 0.f;
    float *ya = y + m0 * n + n0;
    ya[0] = hsum(a0) + b0; ya[1] = hsum(a1) + b1; ya[2] = hsum(a2) + b2; ya[3] = hsum(a3) + b3;
    if (mc > 1) {
        float *yb = ya + n;
        yb[0] = hsum(c0) + b0; yb[1] = hsum(c1) + b1; yb[2] = hsum(c2) + b2; yb[3] = hsum(c3) + b3;
    }
}

/* One output row, for the n % 4 rows left over. */
static inline void row1(const float *x, const float *w, float *y, int64_t k, int64_t n, int64_t row,
                        int64_t m, const float *b) {
    const float *wr = w + row * k;
    for (int64_t j = 0; j < m; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i), _mm256_loadu_ps(x + j * k + i), acc);
        y[j * n + row] = hsum(acc) + (b ? b[row] : 0.f);
    }
}

/* x [m, k], w [n, k], b [n] or NULL, y [m, n]; all contiguous fp32; k % 8 == 0. threads: torch's count, passed
 * explicitly because omp_set_num_threads only set it for the thread that called torch.set_num_threads. */
void hearth_gemv_f32(const float *x, const float *w, const float *b, float *y, int64_t m, int64_t n, int64_t k,
                     int64_t threads) {
    int64_t blocks = n / 4;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t blk = 0; blk < blocks; blk++) {
        for (int64_t m0 = 0; m0 < m; m0 += 2) block4(x, w, y, k, n, blk * 4, m0, m - m0 < 2 ? m - m0 : 2, b);
    }
    for (int64_t row = blocks * 4; row < n; row++) row1(x, w, y, k, n, row, m, b);
}
