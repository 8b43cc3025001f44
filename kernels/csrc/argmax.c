/* The index of each row's largest value, as torch.argmax(dim=-1) gives it: the first index of the maximum, and
 * where a row holds a NaN, the first NaN (torch ranks NaN above everything). fp32 rows.
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

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (isnan(x[j])) return j;
    return -1;
}

static int64_t row_argmax(const float *x, int64_t n) {
    int64_t j = 0, best_at = 0;
    float best = -INFINITY;
    if (n >= 8) {
        /* lane i holds the largest value among the entries it saw (those at i mod 8) and the first index of it:
         * a later entry replaces it only when strictly greater, so ties keep the earlier index */
        __m256 bv = _mm256_loadu_ps(x);
        __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i at = _mm256_add_epi32(bi, _mm256_set1_epi32(8));
        __m256 nan = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
        const __m256i step = _mm256_set1_epi32(8);
        for (j = 8; j + 8 <= n; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            const __m256 gt = _mm256_cmp_ps(v, bv, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bv = _mm256_blendv_ps(bv, v, gt);
            bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(at), gt));
            at = _mm256_add_epi32(at, step);
        }
        if (_mm256_movemask_ps(nan)) return first_nan(x, n);
        float values[8];
        int32_t index[8];
        _mm256_storeu_ps(values, bv);
        _mm256_storeu_si256((__m256i *)index, bi);
        best = values[0], best_at = index[0];
        for (int i = 1; i < 8; i++) /* across lanes: the largest value, and of equal ones the first index */
            if (values[i] > best || (values[i] == best && index[i] < best_at)) best = values[i], best_at = index[i];
    }
    for (; j < n; j++) { /* the tail's indices all come after the vector part's */
        if (isnan(x[j])) return first_nan(x, n);
        if (x[j] > best || j == 0) best = x[j], best_at = j;
    }
    return best_at;
}

/* x: rows of n fp32 values, row r at x + r * stride; out[r] its argmax. threads: torch's count. */
void hearth_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, int64_t threads) {
    const int64_t team = threads < rows ? threads : rows;
#pragma omp parallel for num_threads(team > 0 ? team : 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, n);
}
