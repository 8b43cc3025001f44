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

static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight fp32 lanes -> bf16 bits, round to nearest even as torch's .to(bfloat16) (NaN stays NaN). */
static inline __m128i bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* pack the low 16 bits of each lane: lanes 0-3 and 4-7 sit in the two 128-bit halves */
    __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* v rounded to bf16 and widened back. */
static inline __m256 bf16_round8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
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
            __m256 v = load8_bf16(hr + i);
            if (xr) {
                __m128i bits = bf16_bits8(_mm256_add_ps(v, load8_bf16(xr + i)));
                _mm_storeu_si128((__m128i *)(hr + i), bits);
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        __m256 inv = _mm256_set1_ps(1.f / sqrtf(hsum(ss) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 normed = _mm256_mul_ps(load8_bf16(hr + i), inv);
            __m256 y = offset ? _mm256_mul_ps(normed, _mm256_add_ps(load8_bf16(w + i), _mm256_set1_ps(1.f)))
                              : _mm256_mul_ps(load8_bf16(w + i), bf16_round8(normed));
            _mm_storeu_si128((__m128i *)(o + i), bf16_bits8(y));
        }
    }
}
