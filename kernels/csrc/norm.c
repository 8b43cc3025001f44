/* The decoder's residual add + RMSNorm, fused, for fp32 and bf16 rows.
 *
 * At decode on CPU that is eight torch ops over one row of a few hundred numbers, each costing microseconds of
 * dispatch for nanoseconds of arithmetic, twice per layer. One call does it in two passes over the row. bf16
 * rows round where the torch ops round (the sum h + x, the normalised row before a plain weight scales it, the
 * result), so they track the torch path as closely as fp32 ones do.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* h [rows, dim] += x (when x is not NULL); out = RMSNorm(h) * w, or * (1 + w) with offset (Gemma).
 * dim % 8 == 0. */
void hearth_add_rms_norm_f32(float *h, const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                             float eps, int64_t offset, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(rows * dim >= 65536 && threads > 0 ? threads : 1)
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

/* As hearth_add_rms_norm_f32 for bf16 h, x, w and out; sums of squares in fp32. */
void hearth_add_rms_norm_bf16(uint16_t *h, const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows,
                              int64_t dim, float eps, int64_t offset, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(rows * dim >= 65536 && threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim, *o = out + r * dim;
        const uint16_t *xr = x ? x + r * dim : 0;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = widen8_bf16(hr + i);
            if (xr) {
                __m128i bits = narrow8_bf16(_mm256_add_ps(v, widen8_bf16(xr + i)));
                _mm_storeu_si128((__m128i *)(hr + i), bits);
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(ss) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 normed = _mm256_mul_ps(widen8_bf16(hr + i), inv);
            __m256 y = offset ? _mm256_mul_ps(normed, _mm256_add_ps(widen8_bf16(w + i), _mm256_set1_ps(1.f)))
                              : _mm256_mul_ps(widen8_bf16(w + i), round8_bf16(normed));
            _mm_storeu_si128((__m128i *)(o + i), narrow8_bf16(y));
        }
    }
}
