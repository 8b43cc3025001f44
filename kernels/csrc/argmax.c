/* The index of each row's largest value, as torch.argmax(dim=-1) gives it: the first index of the maximum, and
 * where a row holds a NaN, the first NaN (torch ranks NaN above everything). fp32 or bf16 rows.
 *
 * A greedy step's sampling is this over [rows, vocab] logits. torch's CPU argmax walks each row on one thread,
 * one element at a time (1.5 ms for 32 rows of Qwen's 151,936 entries on the 2-core EPYC, more than the
 * conversion of the head's output to fp32 before it); here each lane keeps its own running best and the index
 * where it saw it, so a row is one pass of vector compares and blends at memory speed, rows split over threads.
 *
 * Built by kernels/cpu_build (-fopenmp: torch's OpenMP runtime and thread pool).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* bf16 values are fp32 values with the low 16 bits cut: widened exactly, so ranking them widened is ranking them. */
static inline float bf16_at(const uint16_t *x, int64_t j) {
    union { uint32_t u; float f; } v = {(uint32_t)x[j] << 16};
    return v.f;
}

static inline __m256 load8_f32(const void *x, int64_t j) { return _mm256_loadu_ps((const float *)x + j); }
static inline __m256 load8_bf16(const void *x, int64_t j) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float at_f32(const void *x, int64_t j) { return ((const float *)x)[j]; }
static inline float at_bf16(const void *x, int64_t j) { return bf16_at((const uint16_t *)x, j); }

static int64_t first_nan(const void *x, int64_t n, float (*at)(const void *, int64_t)) {
    for (int64_t j = 0; j < n; j++)
        if (isnan(at(x, j))) return j;
    return -1;
}

/* Always inlined with constant loaders: one copy per dtype. */
static inline __attribute__((always_inline)) int64_t row_argmax(const void *x, int64_t n,
                                                                __m256 (*load8)(const void *, int64_t),
                                                                float (*at)(const void *, int64_t)) {
    int64_t j = 0, best_at = 0;
    float best = -INFINITY;
    if (n >= 8) {
        /* lane i holds the largest value among the entries it saw (those at i mod 8) and the first index of it:
         * a later entry replaces it only when strictly greater, so ties keep the earlier index */
        __m256 bv = load8(x, 0);
        __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i at8 = _mm256_add_epi32(bi, _mm256_set1_epi32(8));
        __m256 nan = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
        const __m256i step = _mm256_set1_epi32(8);
        for (j = 8; j + 8 <= n; j += 8) {
            const __m256 v = load8(x, j);
            const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bv = _mm256_blendv_ps(bv, v, gt);
            bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(at8), gt));
            at8 = _mm256_add_epi32(at8, step);
        }
        if (_mm256_movemask_ps(nan)) return first_nan(x, n, at);
        float values[8];
        int32_t index[8];
        _mm256_storeu_ps(values, bv);
        _mm256_storeu_si256((__m256i *)index, bi);
        best = values[0], best_at = index[0];
        for (int i = 1; i < 8; i++) /* across lanes: the largest value, and of equal ones the first index */
            if (values[i] > best || (values[i] == best && index[i] < best_at)) best = values[i], best_at = index[i];
    }
    for (; j < n; j++) { /* the tail's indices all come after the vector part's */
        const float v = at(x, j);
        if (isnan(v)) return first_nan(x, n, at);
        if (v > best || j == 0) best = v, best_at = j;
    }
    return best_at;
}

/* x: rows of n fp32 values, row r at x + r * stride; out[r] its argmax. threads: torch's count. */
void hearth_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int64_t threads) {
    const int64_t team = threads < rows ? threads : rows;
#pragma omp parallel for num_threads(team > 0 ? team : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n, load8_f32, at_f32);
}

/* The same over bf16 rows (a bf16 head's output, without widening it to fp32 in memory first). */
void hearth_argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int64_t threads) {
    const int64_t team = threads < rows ? threads : rows;
#pragma omp parallel for num_threads(team > 0 ? team : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n, load8_bf16, at_bf16);
}
