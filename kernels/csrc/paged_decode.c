/* Decode attention over the paged KV pool, read in place: the CPU sibling of the Triton decode kernel, for fp32
 * and bf16 pools (all sums in fp32; bf16 entries are widened as they are loaded, or multiplied in pairs by AVX-512
 * BF16 dot products, whose products are exact in fp32).
 *
 * The torch reference gathers each sequence's blocks into a contiguous copy, then runs SDPA over it: the KV
 * cache is read, written and read again. With many sequences decoding, the cache read per step is as large as
 * the weights, so this kernel aims at reading each entry once at memory speed. Each (sequence, kv-head) pair
 * walks its block table once, a chunk of up to 64 visible entries at a time (online softmax, one update per
 * chunk):
 *  - scores: eight keys at a time for up to three query heads, each key row loaded once for all of them, eight
 *    independent chains reduced together (one transpose-add for eight scores instead of a horizontal sum each);
 *  - values: register tiles of up to three query heads x 32-64 channels, so each value row loaded serves every
 *    query head of the group while the accumulators stay in registers for the whole chunk;
 *  - memory: a per-thread prefetcher runs a fixed number of entries ahead of the value loop, through the rest
 *    of the pair's blocks and on into the thread's next pair (see `prefetcher`).
 * Masking is by stored position, as in kernels/paged_attention.py: entries past kv_len, after the query's
 * position, or outside a sliding window are skipped, so compressed heads (entries dropped) are served too.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MAX_BLOCK 64
#define CHUNK 64 /* visible entries scored together (>= MAX_BLOCK: a chunk holds at least one block) */
/* Entries the prefetcher runs ahead of the value loop: more than a chunk, since a chunk's scores are all computed
 * before its values are read. 192 measured best of 32-512 (docs/benchmarks.md, "CPU kernels"). */
#define LEAD 192
#define MAX_GROUPS 64
#define MAX_GROUP_DIM 4096 /* query heads per kv head x head_dim the stack buffers hold */
#define TILE_GROUPS 3
#define TILE_VECS 4

/* Where channel d of a head sits in its accumulators in PAIRS mode (below): each 32 channels as 16 even, then 16
 * odd ones. */
static inline int64_t acc_index(int64_t d) { return (d & ~(int64_t)31) + ((d & 1) << 4) + ((d & 31) >> 1); }

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

static inline float load1_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }

static inline float load1_bf16(const void *p, int64_t i) {
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store1_f32(void *p, int64_t i, float x) { ((float *)p)[i] = x; }

/* fp32 -> bf16, round to nearest even (as torch's .to(bfloat16)); NaN stays NaN. */
static inline void store1_bf16(void *p, int64_t i, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    ((uint16_t *)p)[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                           : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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

/* acc[g][d0 : d0 + 8 * nv] for the `gc` query heads from g0 = shrink * acc + sum_j s[g][j] * v[keep[j]].
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

/* Every query head's scores of one block, in tiles of up to three heads: scores[g * MAX_BLOCK + j]. */
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
 * end (acc_index, below). */

static inline __attribute__((always_inline)) void value_tile_pairs(float *acc, const float *scores,
                                                                    const float *shrink, const uint16_t *vc,
                                                                    const int64_t *rows, int64_t kept, prefetcher *pf,
                                                                    int64_t head_dim, int64_t g0, int64_t d0, int gc,
                                                                    int nv) {
    __m512 o[TILE_GROUPS][4];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 2 * nv; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c),
                                    _mm512_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        if (pf) pf_advance(pf, 1);
        __m512 w[TILE_GROUPS];
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
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        int64_t d0 = 0;
        for (; d0 + 64 <= head_dim; d0 += 64) {
            if (gc == 3) VALUE_TILE_PAIRS(d0, 3, 2); else if (gc == 2) VALUE_TILE_PAIRS(d0, 2, 2);
            else VALUE_TILE_PAIRS(d0, 1, 2);
        }
        if (d0 < head_dim) { /* 32 channels left */
            if (gc == 3) VALUE_TILE_PAIRS(d0, 3, 1); else if (gc == 2) VALUE_TILE_PAIRS(d0, 2, 1);
            else VALUE_TILE_PAIRS(d0, 1, 1);
        }
    }
}

#ifdef __AVX512BF16__
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

typedef float (*load1_fn)(const void *, int64_t);
typedef void (*store1_fn)(void *, int64_t, float);

/* Online softmax over one chunk's scores of one query head: s[j] becomes exp(s[j] - m) for the new running
 * max m, and shrink the factor exp(old max - m) by which the running output and sum scale down. Whole vectors
 * at a time (a scalar max and sum over each entry were dependency chains as long as the chunk). */
static inline __attribute__((always_inline)) void softmax_chunk(float *s, int64_t kept, float softcap,
                                                                float *run_max, float *run_sum, float *shrink) {
    if (softcap > 0.f)
        for (int64_t j = 0; j < kept; j++) s[j] = tanhf(s[j] / softcap) * softcap;
    float m, total;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(*run_max);
    int64_t j = 0;
    for (; j + 16 <= kept; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    const __mmask16 tail = (__mmask16)((1u << (kept - j)) - 1u);
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + j));
    m = _mm512_reduce_max_ps(mv);
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= kept; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mb));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mb));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#else
    __m256 mv = _mm256_set1_ps(*run_max);
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (int64_t t = j; t < kept; t++) m = s[t] > m ? s[t] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= kept; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = hsum(sum);
    for (; j < kept; j++) total += s[j] = expf(s[j] - m);
#endif
    *shrink = *run_max == -INFINITY ? 0.f : expf(*run_max - m);
    *run_max = m;
    *run_sum = *run_sum * *shrink + total;
}

/* How a pair's arithmetic runs: eight-lane loops (any build), sixteen-lane ones (AVX-512, head_dim % 16 == 0),
 * or bf16 rows read 32 entries at a time (AVX-512, bf16 pool, head_dim % 32 == 0; BF16 dot-product scores where
 * the build has them). */
enum { LANES8, LANES16, PAIRS };

/* One (sequence, kv head) pair: its query heads against its blocks. Entries are taken a chunk at a time (whole
 * blocks, up to CHUNK visible entries), so the softmax update and the loads and stores of the value accumulators
 * happen once per chunk rather than once per block (with 16-entry blocks, their scalar chains and stores were a
 * third of a block's time once the data was in cache). Always inlined with constant loaders, one copy per dtype
 * and mode (inside an OpenMP region a function
 * pointer would stay a call per load). */
static inline __attribute__((always_inline)) void decode_pair(
    int64_t pair, const void *q, const void *k_cache, const void *v_cache, const int32_t *pos_cache,
    const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, void *out, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
    float softcap, int64_t elem, int mode, prefetcher *pf, load8_fn load8, load1_fn load1, store1_fn store1) {
    (void)elem; /* read by the sixteen-lane loops only */
    const int64_t groups = num_q_heads / num_kv_heads;
    const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
    const int64_t *table = tables + pair * width;
    const int64_t len = kv_lens[pair], qp = q_pos[b];
    const int64_t q0 = (b * num_q_heads + h * groups) * head_dim;
    float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM], run_max[MAX_GROUPS], run_sum[MAX_GROUPS];
    float shrink[MAX_GROUPS], scores[MAX_GROUPS * CHUNK];
    int64_t rows[CHUNK]; /* where each kept entry's row starts in the caches, in elements */
    for (int64_t i = 0; i < groups * head_dim; i++) {
        qf[i] = load1(q, q0 + i) * scale;
        acc[i] = 0.f;
    }
    for (int64_t g = 0; g < groups; g++) { run_max[g] = -INFINITY; run_sum[g] = 0.f; }
    for (int64_t start = 0; start < len;) {
        int64_t kept = 0;
        int64_t seen = 0;
        for (; start < len && kept + block_size <= CHUNK; start += block_size) {
            const int64_t blk = table[start / block_size];
            const int64_t n = len - start < block_size ? len - start : block_size;
            const int32_t *pos = pos_cache + blk * block_size;
            for (int64_t j = 0; j < n; j++) { /* branch-free: kept only moves on for a visible entry */
                rows[kept] = (blk * block_size + j) * head_dim;
                kept += pos[j] <= qp && (window <= 0 || pos[j] > qp - window);
            }
            seen += block_size;
        }
        pf_advance(pf, seen - kept); /* the value loop moves the prefetcher on only for the entries it reads */
        if (kept == 0) continue;
#ifdef __AVX512F__
#ifdef __AVX512BF16__
        if (mode == PAIRS) scores_dot((const uint16_t *)q + q0, k_cache, rows, kept, head_dim, groups, scale, scores);
#else
        if (mode == PAIRS) scores16(qf, k_cache, rows, kept, head_dim, groups, scores, elem);
#endif
        if (mode == LANES16) scores16(qf, k_cache, rows, kept, head_dim, groups, scores, elem);
#endif
        for (int64_t g = 0; g < groups; g++) {
            float *s = scores + g * CHUNK;
            if (mode == LANES8) block_scores(qf + g * head_dim, k_cache, rows, kept, head_dim, s, load8);
            softmax_chunk(s, kept, softcap, run_max + g, run_sum + g, shrink + g);
        }
#ifdef __AVX512F__
        if (mode == PAIRS) values_pairs(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups);
        if (mode == LANES16) values16(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups, elem);
#endif
        if (mode == LANES8) values(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups, load8);
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float a = acc[g * head_dim + (mode == PAIRS ? acc_index(d) : d)];
            store1(out, q0 + g * head_dim + d, a * inv);
        }
    }
}

/* Pairs are dealt round robin (thread t takes t, t + T, ...), so each thread's prefetcher knows which blocks it
 * reads next; it starts LEAD entries ahead of the thread's first pair. */
#define DECODE_PAIRS(ELEM, MODE, LOAD8, LOAD1, STORE1)                                                          \
    _Pragma("omp parallel num_threads(threads > 0 ? threads : 1)")                                            \
    {                                                                                                         \
        const int64_t t = omp_get_thread_num(), team = omp_get_num_threads(), pairs = batch * num_kv_heads;   \
        prefetcher pf = {(const char *)k_cache, (const char *)v_cache, pos_cache, tables, kv_lens, width,     \
                         block_size, head_dim * ELEM, pairs, team, t, 0,                                     \
                         t < pairs ? (kv_lens[t] + block_size - 1) / block_size : 0, 0, 0};                   \
        pf_advance(&pf, LEAD);                                                                                \
        for (int64_t pair = t; pair < pairs; pair += team)                                                    \
            decode_pair(pair, q, k_cache, v_cache, pos_cache, tables, kv_lens, q_pos, out, num_q_heads,       \
                        num_kv_heads, head_dim, block_size, width, scale, window, softcap, ELEM, MODE, &pf,   \
                        LOAD8, LOAD1, STORE1);                                                                \
    }

#ifdef __AVX512F__
#define DECODE_ALL(ELEM, LOAD8, LOAD1, STORE1)                                                                   \
    if (ELEM == 2 && head_dim % 32 == 0) {                                                                    \
        DECODE_PAIRS(ELEM, PAIRS, LOAD8, LOAD1, STORE1)                                                       \
    } else if (head_dim % 16 == 0) {                                                                          \
        DECODE_PAIRS(ELEM, LANES16, LOAD8, LOAD1, STORE1)                                                     \
    } else {                                                                                                  \
        DECODE_PAIRS(ELEM, LANES8, LOAD8, LOAD1, STORE1)                                                      \
    }
#else
#define DECODE_ALL(ELEM, LOAD8, LOAD1, STORE1) do { DECODE_PAIRS(ELEM, LANES8, LOAD8, LOAD1, STORE1) } while (0)
#endif

/* q [B, Hq, D]; k_cache, v_cache [NB, BS, D]; pos_cache [NB, BS] int32; tables [B, Hkv, W] int64;
 * kv_lens [B, Hkv] int32; q_pos [B] int64; out [B, Hq, D]. window <= 0: none; softcap <= 0: none.
 * D % 8 == 0, BS <= MAX_BLOCK, Hq / Hkv <= MAX_GROUPS, (Hq / Hkv) * D <= MAX_GROUP_DIM (the caller checks).
 * q, the caches and out are all fp32 (_f32) or all bf16 (_bf16). */
void hearth_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *pos_cache,
                             const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, float *out,
                             int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t width, float scale, int64_t window, float softcap,
                             int64_t threads) {
    DECODE_ALL(4, load8_f32, load1_f32, store1_f32);
}

void hearth_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *pos_cache, const int64_t *tables, const int32_t *kv_lens,
                              const int64_t *q_pos, uint16_t *out, int64_t batch, int64_t num_q_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale,
                              int64_t window, float softcap, int64_t threads) {
    DECODE_ALL(2, load8_bf16, load1_bf16, store1_bf16);
}
