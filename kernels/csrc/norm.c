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

#ifdef __AVX512F__
/* h + x for sixteen lanes of a bf16 row, rounded and stored back into h (as the torch add rounds it); returned
 * widened. Without x, h's lanes. */
static inline __m512 add16_bf16(uint16_t *h, const uint16_t *x) {
    if (!x) return widen16_bf16(h);
    const __m256i bits = narrow16_bf16(_mm512_add_ps(widen16_bf16(h), widen16_bf16(x)));
    _mm256_storeu_si256((__m256i *)h, bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* One bf16 row sixteen lanes at a time (a last dim % 16 of eight in eight lanes), two chains of sums of squares:
 * the eight-lane loop below, one chain long, cost as many instructions again per element and was a few percent of
 * a 32-concurrent bf16 pass on an AMX Xeon (norms of 32 rows run on one thread). The same roundings. */
static void norm_row_bf16(uint16_t *hr, const uint16_t *xr, const uint16_t *w, uint16_t *o, int64_t dim, float eps,
                          int64_t offset) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= dim; i += 32) {
        const __m512 a = add16_bf16(hr + i, xr ? xr + i : 0), b = add16_bf16(hr + i + 16, xr ? xr + i + 16 : 0);
        s0 = _mm512_fmadd_ps(a, a, s0);
        s1 = _mm512_fmadd_ps(b, b, s1);
    }
    for (; i + 16 <= dim; i += 16) {
        const __m512 a = add16_bf16(hr + i, xr ? xr + i : 0);
        s0 = _mm512_fmadd_ps(a, a, s0);
    }
    __m256 tail = _mm256_setzero_ps();
    if (i < dim) { /* dim % 16 == 8 */
        __m256 v = widen8_bf16(hr + i);
        if (xr) {
            const __m128i bits = narrow8_bf16(_mm256_add_ps(v, widen8_bf16(xr + i)));
            _mm_storeu_si128((__m128i *)(hr + i), bits);
            v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
        }
        tail = _mm256_mul_ps(v, v);
    }
    const float inv = 1.f / sqrtf((_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + hsum(tail)) / (float)dim + eps);
    const __m512 inv16 = _mm512_set1_ps(inv), one16 = _mm512_set1_ps(1.f);
    for (i = 0; i + 16 <= dim; i += 16) {
        const __m512 normed = _mm512_mul_ps(widen16_bf16(hr + i), inv16);
        const __m512 y = offset ? _mm512_mul_ps(normed, _mm512_add_ps(widen16_bf16(w + i), one16))
                                : _mm512_mul_ps(widen16_bf16(w + i), round16_bf16(normed));
        _mm256_storeu_si256((__m256i *)(o + i), narrow16_bf16(y));
    }
    if (i < dim) {
        const __m256 normed = _mm256_mul_ps(widen8_bf16(hr + i), _mm256_set1_ps(inv));
        const __m256 y = offset ? _mm256_mul_ps(normed, _mm256_add_ps(widen8_bf16(w + i), _mm256_set1_ps(1.f)))
                                : _mm256_mul_ps(widen8_bf16(w + i), round8_bf16(normed));
        _mm_storeu_si128((__m128i *)(o + i), narrow8_bf16(y));
    }
}
#endif

/* As hearth_add_rms_norm_f32 for bf16 h, x, w and out; sums of squares in fp32. */
void hearth_add_rms_norm_bf16(uint16_t *h, const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows,
                              int64_t dim, float eps, int64_t offset, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(rows * dim >= 65536 && threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * dim, *o = out + r * dim;
        const uint16_t *xr = x ? x + r * dim : 0;
#ifdef __AVX512F__
        norm_row_bf16(hr, xr, w, o, dim, eps, offset);
#else
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
#endif
    }
}
