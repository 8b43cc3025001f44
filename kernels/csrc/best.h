/* Each row's argmax kept as a product's outputs are computed (gemm.c's hearth_gemm_argmax_*): a greedy step's
 * tokens straight from the LM head, without writing [rows, vocab] logits to memory and reading them back (Qwen2.5's
 * 151,936 fp32 logits a row: 19.4 MB at 32 rows, which the separate argmax pass then reads again).
 *
 * The result is torch.argmax(dim=-1)'s over the outputs the plain product would store: the first index of the
 * maximum, and where a row holds a NaN, the first NaN. Threads see a row's blocks in any order (deal.h hands out
 * the last ones to whichever thread is free), so the rule is applied by index, not by arrival: a later-seen
 * entry equal to the best replaces it when its index is lower.
 */
#ifndef HEARTH_BEST_H
#define HEARTH_BEST_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float value;
    int64_t index; /* -1: nothing seen yet */
} best;

/* Whether entry `i` of value v goes before the best so far. */
static inline int best_beats(float v, int64_t i, const best *b) {
    if (b->index < 0) return 1;
    if (isnan(v)) return !isnan(b->value) || i < b->index;
    if (isnan(b->value)) return 0;
    return v > b->value || (v == b->value && i < b->index);
}

/* Fold entries [base, base + width) of one row (x, fp32) into its best. Most blocks hold nothing as large as the
 * best once a row has been under way: one vector compare (>= or unordered) per eight entries says so, and only
 * blocks with a candidate, a tie or a NaN walk their entries. */
static inline void best_scan(best *b, const float *x, int64_t width, int64_t base) {
    if (b->index >= 0 && !isnan(b->value)) {
        const __m256 bv = _mm256_set1_ps(b->value);
        int hit = 0;
        int64_t c = 0;
        for (; c + 8 <= width; c += 8) hit |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + c), bv, _CMP_NLT_UQ));
        for (; c < width; c++) hit |= !(x[c] < b->value);
        if (!hit) return;
    }
    for (int64_t c = 0; c < width; c++)
        if (best_beats(x[c], base + c, b)) b->value = x[c], b->index = base + c;
}

/* Every thread's bests of m rows: [team][m], nothing seen yet; NULL when out of memory. */
static inline best *bests_open(int64_t team, int64_t m) {
    best *all = malloc((size_t)(team * m) * sizeof *all);
    for (int64_t i = 0; all && i < team * m; i++) all[i] = (best){-INFINITY, -1};
    return all;
}

/* out[r]: the best of row r over every thread's; frees the bests. */
static inline void bests_close(best *all, int64_t team, int64_t m, int64_t *out) {
    for (int64_t r = 0; r < m; r++) {
        best row = all[r];
        for (int64_t t = 1; t < team; t++) {
            const best *other = &all[t * m + r];
            if (other->index >= 0 && best_beats(other->value, other->index, &row)) row = *other;
        }
        out[r] = row.index;
    }
    free(all);
}
#endif
