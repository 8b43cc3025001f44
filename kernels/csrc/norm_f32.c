/* The decoder's residual add + RMSNorm in fp32, fused.
 *
 * At decode on CPU that is eight torch ops over one row of a few hundred floats, each costing microseconds of
 * dispatch for nanoseconds of arithmetic, twice per layer. One call does it in two passes over the row.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* h [rows, dim] += x (when x is not NULL); out = RMSNorm(h) * w, or * (1 + w) with offset (Gemma).
 * dim % 8 == 0. */
void hearth_add_rms_norm_f32(float *h, const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                             float eps, int64_t offset) {
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * dim, *o = out + r * dim;
        const float *xr = x ? x + r * dim : 0;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(hr + i);
            if (xr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(xr + i));
                _mm256_storeu_ps(hr + i, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(ss) / (float)dim + eps));
        __m256 one = _mm256_set1_ps(offset ? 1.f : 0.f);
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 scale = _mm256_add_ps(_mm256_loadu_ps(w + i), one);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(hr + i), inv), scale));
        }
    }
}
