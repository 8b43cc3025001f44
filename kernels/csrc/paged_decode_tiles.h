/* The pieces of kernels/csrc/paged_decode.c that work on one chunk of a (sequence, kv head) pair: the register
 * tiles for scores and values in each build's widths (eight lanes; sixteen on AVX-512; bf16 rows 32 entries a
 * load), and the prefetcher the value tiles move on. Included by paged_decode.c only; kept apart so that file
 * reads as the algorithm (chunk, score, softmax, accumulate) and this one as the arithmetic.
 */
#ifndef HEARTH_PAGED_DECODE_TILES_H
#define HEARTH_PAGED_DECODE_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define CHUNK 64 /* visible entries scored together (>= the largest block, 64: a chunk holds at least one block) */
#define TILE_GROUPS 3
#define TILE_VECS 4
#define PAIR_GROUPS 4 /* query heads per value tile of bf16 pairs: 16 sums of 16 lanes at 64 channels */
#define MAX_HEAD_DIM 256 /* the largest head the transposed scores take */
#define MAX_GROUPS 64 /* query heads per kv head */

/* Lane i of the result is the sum of v[i]'s eight lanes. */
static inline __m256 hsum8(const __m256 *v) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* each holds the low-half sums in its low 128 bits and the high-half sums in its high 128 bits */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline __m256 load8_f32(const void *p, int64_t i) { return _mm256_loadu_ps((const float *)p + i); }

static inline __m256 load8_bf16(const void *p, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void store8_f32(void *p, int64_t i, __m256 v) { _mm256_storeu_ps((float *)p + i, v); }

/* fp32 -> bf16, round to nearest even (as torch's .to(bfloat16)); NaN stays NaN. */
static inline void store8_bf16(void *p, int64_t i, __m256 v) {
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), narrow8_bf16(v));
}

/* Software prefetch that keeps pace with the arithmetic. Blocks lie scattered over the pool, so the hardware
 * prefetchers cannot see the next one coming; requesting whole blocks ahead in bursts (the previous design) stalled
 * the core once its few outstanding-miss slots were full, so memory and arithmetic took turns. Instead a cursor
 * walks this thread's future entries (the rest of its pair's blocks, then its next pair's: pairs are dealt round
 * robin) a fixed lead ahead, and each entry the value loop consumes moves it on by one entry's key and value
 * bytes: a steady trickle of requests, each issued while the arithmetic runs. Into L2: the L1 is kept for the
 * demand loads. */
typedef struct {
    const char *k, *v;
    const int32_t *pos;
    const int64_t *tables;
    const int32_t *kv_lens;
    int64_t width, block_size, row_bytes, pairs, stride;
    int64_t pair, blk, blocks, off, debt; /* where the next request goes; bytes owed */
} prefetcher;

/* Always inlined: GCC finds a function that only prefetches free of effects and deletes calls to it. */
static inline __attribute__((always_inline)) void pf_advance(prefetcher *p, int64_t entries) {
    p->debt += entries * p->row_bytes;
    const int64_t block_bytes = p->block_size * p->row_bytes;
    while (p->debt >= 64) {
        if (p->blk >= p->blocks) { /* this pair's blocks are all requested: on to the thread's next pair */
            p->pair += p->stride;
            if (p->pair >= p->pairs) { p->debt = 0; return; }
            p->blk = p->off = 0;
            p->blocks = (p->kv_lens[p->pair] + p->block_size - 1) / p->block_size;
            continue;
        }
        const int64_t at = p->tables[p->pair * p->width + p->blk] * block_bytes + p->off;
        if (p->off == 0) _mm_prefetch((const char *)(p->pos + at / p->row_bytes), _MM_HINT_T1);
        _mm_prefetch(p->k + at, _MM_HINT_T1);
        _mm_prefetch(p->v + at, _MM_HINT_T1);
        p->debt -= 64;
        p->off += 64;
        if (p->off >= block_bytes) { p->off = 0; p->blk++; }
    }
}

typedef __m256 (*load8_fn)(const void *, int64_t);

/* The value tiles' prefetcher: the first tile of a chunk moves it on, the others pass none. */
#define FIRST_TILE_PF (g0 == 0 && d0 == 0 ? pf : (prefetcher *)0)

/* acc[g][d0 : d0 + 8 * nv] for the `gc` query heads from g0 = shrink * acc + sum_j s[g][j] * v[rows[j]].
 * Always inlined with constant gc and nv, so the tile lives in registers. */
static inline __attribute__((always_inline)) void value_tile(float *acc, const float *scores, const float *shrink,
                                                              const void *vb, const int64_t *rows, int64_t kept,
                                                              prefetcher *pf,
                                                              int64_t head_dim, int64_t g0, int64_t d0, int gc,
                                                              int nv, load8_fn load8) {
    __m256 o[TILE_GROUPS][TILE_VECS];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++)
            o[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (g0 + g) * head_dim + d0 + 8 * c),
                                    _mm256_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        if (pf) pf_advance(pf, 1);
        const int64_t row = rows[j] + d0;
        __m256 w[TILE_GROUPS];
        for (int g = 0; g < gc; g++) w[g] = _mm256_set1_ps(scores[(g0 + g) * CHUNK + j]);
        for (int c = 0; c < nv; c++) {
            __m256 v = load8(vb, row + 8 * c);
            for (int g = 0; g < gc; g++) o[g][c] = _mm256_fmadd_ps(w[g], v, o[g][c]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(acc + (g0 + g) * head_dim + d0 + 8 * c, o[g][c]);
}

#define VALUE_TILE(D0, GC, NV) \
    value_tile(acc, scores, shrink, vb, rows, kept, FIRST_TILE_PF, head_dim, g0, D0, GC, NV, load8)

static inline __attribute__((always_inline)) void values(float *acc, const float *scores, const float *shrink,
                                                         const void *vb, const int64_t *rows, int64_t kept,
                                                         prefetcher *pf,
                                                         int64_t head_dim, int64_t groups, load8_fn load8) {
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        int64_t d0 = 0;
        for (; d0 + 8 * TILE_VECS <= head_dim; d0 += 8 * TILE_VECS) {
            if (gc == 3) VALUE_TILE(d0, 3, 4); else if (gc == 2) VALUE_TILE(d0, 2, 4); else VALUE_TILE(d0, 1, 4);
        }
        for (; d0 < head_dim; d0 += 8) { /* head_dim % 32 channels left, eight at a time */
            if (gc == 3) VALUE_TILE(d0, 3, 1); else if (gc == 2) VALUE_TILE(d0, 2, 1); else VALUE_TILE(d0, 1, 1);
        }
    }
}

/* Scores of the `kept` entries of one block for one query head (q already scaled, fp32). */
static inline __attribute__((always_inline)) void block_scores(const float *qg, const void *kb, const int64_t *rows,
                                                               int64_t kept, int64_t head_dim, float *s,
                                                               load8_fn load8) {
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 q = _mm256_loadu_ps(qg + d);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(load8(kb, rows[j + i] + d), q, a[i]);
        }
        _mm256_storeu_ps(s + j, hsum8(a));
    }
    for (; j < kept; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(load8(kb, rows[j] + d),
                                                                       _mm256_loadu_ps(qg + d), a);
        s[j] = hsum(a);
    }
}

#ifdef __AVX512F__
/* The same two loops sixteen lanes wide where the CPU has AVX-512 (and head_dim % 16 == 0): half the
 * instructions per key, which matters because the loops, not memory, set the pace once blocks are in cache. */
static inline __m512 load16_f32(const void *p, int64_t i) { return _mm512_loadu_ps((const float *)p + i); }

static inline __m512 load16_bf16(const void *p, int64_t i) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int64_t elem) {
    return elem == 4 ? load16_f32(p, i) : load16_bf16(p, i);
}

static inline __attribute__((always_inline)) void value_tile16(float *acc, const float *scores,
                                                                const float *shrink, const void *vb,
                                                                const int64_t *rows, int64_t kept,
                                                                prefetcher *pf, int64_t head_dim,
                                                                int64_t g0, int64_t d0, int gc, int nv, int64_t elem) {
    __m512 o[TILE_GROUPS][TILE_VECS];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c),
                                    _mm512_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        if (pf) pf_advance(pf, 1);
        const int64_t row = rows[j] + d0;
        __m512 w[TILE_GROUPS];
        for (int g = 0; g < gc; g++) w[g] = _mm512_set1_ps(scores[(g0 + g) * CHUNK + j]);
        for (int c = 0; c < nv; c++) {
            __m512 v = load16(vb, row + 16 * c, elem);
            for (int g = 0; g < gc; g++) o[g][c] = _mm512_fmadd_ps(w[g], v, o[g][c]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c, o[g][c]);
}

#define VALUE_TILE16(D0, GC, NV) \
    value_tile16(acc, scores, shrink, vb, rows, kept, FIRST_TILE_PF, head_dim, g0, D0, GC, NV, elem)

static inline __attribute__((always_inline)) void values16(float *acc, const float *scores, const float *shrink,
                                                           const void *vb, const int64_t *rows, int64_t kept,
                                                           prefetcher *pf,
                                                           int64_t head_dim, int64_t groups, int64_t elem) {
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        int64_t d0 = 0;
        for (; d0 + 16 * TILE_VECS <= head_dim; d0 += 16 * TILE_VECS) {
            if (gc == 3) VALUE_TILE16(d0, 3, 4); else if (gc == 2) VALUE_TILE16(d0, 2, 4); else VALUE_TILE16(d0, 1, 4);
        }
        for (; d0 < head_dim; d0 += 16) {
            if (gc == 3) VALUE_TILE16(d0, 3, 1); else if (gc == 2) VALUE_TILE16(d0, 2, 1); else VALUE_TILE16(d0, 1, 1);
        }
    }
}

/* The low and high halves of a 16-lane vector added: eight lanes with the same total. */
static inline __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Scores of up to three query heads of the group at once (gc, a constant after inlining): each key row is
 * loaded and widened once for all of them, and each score is still one chain over d in order, as before. */
static inline __attribute__((always_inline)) void block_scores16(const float *qg, const void *kb, const int64_t *rows,
                                                                 int64_t kept, int64_t head_dim, float *s, int gc,
                                                                 int64_t elem) {
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) {
        __m512 a[TILE_GROUPS][8];
        for (int g = 0; g < gc; g++)
            for (int i = 0; i < 8; i++) a[g][i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 q[TILE_GROUPS];
            for (int g = 0; g < gc; g++) q[g] = _mm512_loadu_ps(qg + g * head_dim + d);
            for (int i = 0; i < 8; i++) {
                const __m512 k = load16(kb, rows[j + i] + d, elem);
                for (int g = 0; g < gc; g++) a[g][i] = _mm512_fmadd_ps(k, q[g], a[g][i]);
            }
        }
        for (int g = 0; g < gc; g++) {
            __m256 h[8];
            for (int i = 0; i < 8; i++) h[i] = fold16(a[g][i]);
            _mm256_storeu_ps(s + g * CHUNK + j, hsum8(h));
        }
    }
    for (; j < kept; j++) {
        for (int g = 0; g < gc; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16)
                a = _mm512_fmadd_ps(load16(kb, rows[j] + d, elem), _mm512_loadu_ps(qg + g * head_dim + d),
                                    a);
            s[g * CHUNK + j] = _mm512_reduce_add_ps(a);
        }
    }
}

/* Every query head's scores of one block, in tiles of up to three heads: scores[g * CHUNK + j]. */
static inline __attribute__((always_inline)) void scores16(const float *qf, const void *kb, const int64_t *rows,
                                                           int64_t kept, int64_t head_dim, int64_t groups,
                                                           float *scores, int64_t elem) {
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const float *qg = qf + g0 * head_dim;
        float *s = scores + g0 * CHUNK;
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        if (gc == 3) block_scores16(qg, kb, rows, kept, head_dim, s, 3, elem);
        else if (gc == 2) block_scores16(qg, kb, rows, kept, head_dim, s, 2, elem);
        else block_scores16(qg, kb, rows, kept, head_dim, s, 1, elem);
    }
}
/* bf16 pools with head_dim % 32 == 0 (PAIRS mode): one 512-bit load holds 32 entries of a row.
 * Values: the even entries widen with one shift and the odd ones with one mask (no widening shuffle), so
 * the accumulators hold each 32 channels as 16 even then 16 odd ones; the output is put back in order once at the
 * end (decode_pair in paged_decode.c). */

static inline __attribute__((always_inline)) void value_tile_pairs(float *acc, const float *scores,
                                                                    const float *shrink, const uint16_t *vc,
                                                                    const int64_t *rows, int64_t kept, prefetcher *pf,
                                                                    int64_t head_dim, int64_t g0, int64_t d0, int gc,
                                                                    int nv) {
    __m512 o[PAIR_GROUPS][4];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 2 * nv; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c),
                                    _mm512_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        if (pf) pf_advance(pf, 1);
        __m512 w[PAIR_GROUPS];
        for (int g = 0; g < gc; g++) w[g] = _mm512_set1_ps(scores[(g0 + g) * CHUNK + j]);
        for (int c = 0; c < nv; c++) {
            const __m512i x = _mm512_loadu_si512(vc + rows[j] + d0 + 32 * c);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
            for (int g = 0; g < gc; g++) {
                o[g][2 * c] = _mm512_fmadd_ps(w[g], even, o[g][2 * c]);
                o[g][2 * c + 1] = _mm512_fmadd_ps(w[g], odd, o[g][2 * c + 1]);
            }
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 2 * nv; c++) _mm512_storeu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c, o[g][c]);
}

#define VALUE_TILE_PAIRS(D0, GC, NV) \
    value_tile_pairs(acc, scores, shrink, vc, rows, kept, FIRST_TILE_PF, head_dim, g0, D0, GC, NV)

static inline __attribute__((always_inline)) void values_pairs(float *acc, const float *scores, const float *shrink,
                                                               const uint16_t *vc, const int64_t *rows, int64_t kept,
                                                               prefetcher *pf,
                                                               int64_t head_dim, int64_t groups) {
    for (int64_t g0 = 0; g0 < groups; g0 += PAIR_GROUPS) {
        const int64_t gc = groups - g0 >= PAIR_GROUPS ? PAIR_GROUPS : groups - g0;
        int64_t d0 = 0;
        for (; d0 + 64 <= head_dim; d0 += 64) {
            if (gc == 4) VALUE_TILE_PAIRS(d0, 4, 2); else if (gc == 3) VALUE_TILE_PAIRS(d0, 3, 2);
            else if (gc == 2) VALUE_TILE_PAIRS(d0, 2, 2); else VALUE_TILE_PAIRS(d0, 1, 2);
        }
        if (d0 < head_dim) { /* 32 channels left */
            if (gc == 4) VALUE_TILE_PAIRS(d0, 4, 1); else if (gc == 3) VALUE_TILE_PAIRS(d0, 3, 1);
            else if (gc == 2) VALUE_TILE_PAIRS(d0, 2, 1); else VALUE_TILE_PAIRS(d0, 1, 1);
        }
    }
}

#ifdef __AVX512BF16__
/* Values by AVX-512 BF16 dot products where the build has them: the chunk's probabilities rounded to bf16 (`pb`,
 * [groups][CHUNK], as torch's bf16 attention and the prompt kernels round them), and each lane multiplying a pair
 * of entries (j, j + 1) of one channel: half the multiply-adds of widening the values, and no widening. A pair's
 * two rows are interleaved in registers (unpacklo/hi of 16-bit elements), so each 32 channels accumulate as 16
 * "lo" lanes (channels 8L + 0..3 of each 128-bit lane L) and 16 "hi" ones (8L + 4..7), put back in order once at
 * the end (decode_pair). An odd chunk's last entry pairs with itself at probability zero. */
static inline __attribute__((always_inline)) void value_tile_dot(float *acc, const uint16_t *pb, const float *shrink,
                                                                  const uint16_t *vc, const int64_t *rows,
                                                                  int64_t kept, prefetcher *pf, int64_t head_dim,
                                                                  int64_t g0, int64_t d0, int gc, int nv) {
    __m512 o[PAIR_GROUPS][4];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 2 * nv; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c),
                                    _mm512_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j += 2) {
        if (pf) pf_advance(pf, kept - j >= 2 ? 2 : 1);
        __m512bh w[PAIR_GROUPS];
        for (int g = 0; g < gc; g++)
            w[g] = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(pb + (g0 + g) * CHUNK))[j / 2]);
        for (int c = 0; c < nv; c++) {
            const __m512i a = _mm512_loadu_si512(vc + rows[j] + d0 + 32 * c);
            const __m512i b = _mm512_loadu_si512(vc + rows[j + 1] + d0 + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < gc; g++) {
                o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], w[g], lo);
                o[g][2 * c + 1] = _mm512_dpbf16_ps(o[g][2 * c + 1], w[g], hi);
            }
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 2 * nv; c++) _mm512_storeu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c, o[g][c]);
}

#define VALUE_TILE_DOT(D0, GC, NV) \
    value_tile_dot(acc, pb, shrink, vc, rows, kept, FIRST_TILE_PF, head_dim, g0, D0, GC, NV)

/* Every query head's values of one chunk by dot products; scores [groups][CHUNK] hold the chunk's probabilities
 * (fp32), and rows[kept] may be written (a copy of the last row, for an odd chunk's pair). */
static inline __attribute__((always_inline)) void values_dot(float *acc, const float *scores, const float *shrink,
                                                             const uint16_t *vc, int64_t *rows, int64_t kept,
                                                             prefetcher *pf, int64_t head_dim, int64_t groups) {
    _Alignas(64) uint16_t pb[MAX_GROUPS * CHUNK];
    for (int64_t g = 0; g < groups; g++) /* lanes past kept load as zero: an odd chunk's partner weighs nothing */
        for (int64_t j = 0; j < kept; j += 16) {
            const __mmask16 in = kept - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (kept - j)) - 1u);
            _mm256_storeu_si256((__m256i *)(pb + g * CHUNK + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, scores + g * CHUNK + j)));
        }
    if (kept & 1) rows[kept] = rows[kept - 1];
    for (int64_t g0 = 0; g0 < groups; g0 += PAIR_GROUPS) {
        const int64_t gc = groups - g0 >= PAIR_GROUPS ? PAIR_GROUPS : groups - g0;
        int64_t d0 = 0;
        for (; d0 + 64 <= head_dim; d0 += 64) {
            if (gc == 4) VALUE_TILE_DOT(d0, 4, 2); else if (gc == 3) VALUE_TILE_DOT(d0, 3, 2);
            else if (gc == 2) VALUE_TILE_DOT(d0, 2, 2); else VALUE_TILE_DOT(d0, 1, 2);
        }
        if (d0 < head_dim) { /* 32 channels left */
            if (gc == 4) VALUE_TILE_DOT(d0, 4, 1); else if (gc == 3) VALUE_TILE_DOT(d0, 3, 1);
            else if (gc == 2) VALUE_TILE_DOT(d0, 2, 1); else VALUE_TILE_DOT(d0, 1, 1);
        }
    }
}

/* Scores from the bf16 query and keys as they are, by AVX-512 BF16 dot products: each lane multiplies a pair
 * of channels (products of bf16 values are exact in fp32) and adds them to its fp32 sum, so nothing is widened;
 * the sum is scaled afterwards. Tiles of up to three query heads x eight keys, as block_scores16. */
static inline __attribute__((always_inline)) void block_scores_dot(const uint16_t *qg, const uint16_t *kc,
                                                                   const int64_t *rows, int64_t kept,
                                                                   int64_t head_dim, float scale, float *s, int gc) {
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) {
        __m512 a[TILE_GROUPS][8];
        for (int g = 0; g < gc; g++)
            for (int i = 0; i < 8; i++) a[g][i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 32) {
            __m512bh q[TILE_GROUPS];
            for (int g = 0; g < gc; g++) q[g] = (__m512bh)_mm512_loadu_si512(qg + g * head_dim + d);
            for (int i = 0; i < 8; i++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kc + rows[j + i] + d);
                for (int g = 0; g < gc; g++) a[g][i] = _mm512_dpbf16_ps(a[g][i], k, q[g]);
            }
        }
        for (int g = 0; g < gc; g++) {
            __m256 h[8];
            for (int i = 0; i < 8; i++) h[i] = fold16(a[g][i]);
            _mm256_storeu_ps(s + g * CHUNK + j, _mm256_mul_ps(hsum8(h), _mm256_set1_ps(scale)));
        }
    }
    for (; j < kept; j++)
        for (int g = 0; g < gc; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(kc + rows[j] + d),
                                     (__m512bh)_mm512_loadu_si512(qg + g * head_dim + d));
            s[g * CHUNK + j] = _mm512_reduce_add_ps(a) * scale;
        }
}

/* Scores through keys turned on their side: up to 64 keys of a chunk are transposed once, in 16 x 16 blocks of
 * 32-bit channel pairs (kt[p][j]: pair p of key j), and then every query head's scores come out sixteen keys to a
 * vector: sum over p of pair p of the keys times pair p of the query, broadcast. No horizontal sums: with
 * head_dim 64 those cost as much as the dot products (block_scores_dot), more so the more query heads share a
 * kv head (Qwen2.5: seven), while the transpose is paid once per key whatever the number of heads. */
static inline __attribute__((always_inline)) void transpose16(const __m512i r[16], uint32_t *kt, int64_t stride) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], 128-bit lane L: channel 4L + c of keys 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i s0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i s1 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512i s2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512i s3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        _mm512_storeu_si512(kt + (0 + c) * stride, _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(kt + (8 + c) * stride, _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_storeu_si512(kt + (4 + c) * stride, _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(kt + (12 + c) * stride, _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

/* gc query heads (from qg, bf16) x nj groups of sixteen keys from kt: gc * nj independent chains of sums. */
static inline __attribute__((always_inline)) void scores_kt_tile(const uint16_t *qg, const uint32_t *kt,
                                                                 int64_t head_dim, float scale, float *s, int gc,
                                                                 int nj) {
    __m512 a[4][4];
    for (int g = 0; g < gc; g++)
        for (int j = 0; j < nj; j++) a[g][j] = _mm512_setzero_ps();
    const uint32_t *qp = (const uint32_t *)qg;
    for (int64_t p = 0; p < head_dim / 2; p++) {
        __m512bh k[4];
        for (int j = 0; j < nj; j++) k[j] = (__m512bh)_mm512_loadu_si512(kt + p * CHUNK + 16 * j);
        for (int g = 0; g < gc; g++) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qp[g * head_dim / 2 + p]);
            for (int j = 0; j < nj; j++) a[g][j] = _mm512_dpbf16_ps(a[g][j], q, k[j]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int j = 0; j < nj; j++)
            _mm512_storeu_ps(s + g * CHUNK + 16 * j, _mm512_mul_ps(a[g][j], _mm512_set1_ps(scale)));
}

#define SCORES_KT_TILE(GC) \
    (nj == 4 ? scores_kt_tile(qg, kt, head_dim, scale, s, GC, 4) : scores_kt_tile(qg, kt, head_dim, scale, s, GC, 2))

static inline __attribute__((always_inline)) void scores_transposed(const uint16_t *qb, const uint16_t *kc,
                                                                    const int64_t *rows, int64_t kept,
                                                                    int64_t head_dim, int64_t groups, float scale,
                                                                    float *scores) {
    uint32_t kt[MAX_HEAD_DIM / 2 * CHUNK];
    const int nj = kept > 32 ? 4 : 2; /* key groups of sixteen scored (past `kept`: a copy of the last key) */
    for (int64_t j0 = 0; j0 < 16 * nj; j0 += 16)
        for (int64_t d = 0; d < head_dim; d += 32) { /* 32 channels = 16 pairs of each of 16 keys */
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_loadu_si512(kc + rows[j0 + i < kept ? j0 + i : kept - 1] + d);
            transpose16(r, kt + d / 2 * CHUNK + j0, CHUNK);
        }
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        const uint16_t *qg = qb + g0 * head_dim;
        float *s = scores + g0 * CHUNK;
        const int64_t gc = groups - g0 >= 4 ? 4 : groups - g0;
        if (gc == 4) SCORES_KT_TILE(4); else if (gc == 3) SCORES_KT_TILE(3);
        else if (gc == 2) SCORES_KT_TILE(2); else SCORES_KT_TILE(1);
    }
}

static inline __attribute__((always_inline)) void scores_dot(const uint16_t *qb, const uint16_t *kc,
                                                             const int64_t *rows, int64_t kept, int64_t head_dim,
                                                             int64_t groups, float scale, float *scores) {
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const uint16_t *qg = qb + g0 * head_dim;
        float *s = scores + g0 * CHUNK;
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        if (gc == 3) block_scores_dot(qg, kc, rows, kept, head_dim, scale, s, 3);
        else if (gc == 2) block_scores_dot(qg, kc, rows, kept, head_dim, scale, s, 2);
        else block_scores_dot(qg, kc, rows, kept, head_dim, scale, s, 1);
    }
}
#endif
#endif

#endif /* HEARTH_PAGED_DECODE_TILES_H */
