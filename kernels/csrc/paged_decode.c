/* Decode attention over the paged KV pool, read in place: the CPU sibling of the Triton decode kernel, for fp32
 * and bf16 pools (bf16 entries are widened to fp32 as they are loaded; all arithmetic is fp32).
 *
 * The torch reference gathers each sequence's blocks into a contiguous copy, then runs SDPA over it: the KV
 * cache is read, written and read again. With many sequences decoding, the cache read per step is as large as
 * the weights, so this kernel aims at reading each entry once at memory speed. Each (sequence, kv-head) pair
 * walks its block table once, block by block (online softmax):
 *  - scores: eight keys at a time per query head, eight independent FMA chains reduced together (one
 *    transpose-add for eight scores instead of a horizontal sum per score);
 *  - values: register tiles of up to three query heads x 32 channels, so each value row loaded serves every
 *    query head of the group while twelve accumulators stay in registers.
 * The next block of the table is prefetched while one block computes; on AVX-512 each key row is loaded once
 * for up to three query heads' scores.
 * Masking is by stored position, as in kernels/paged_attention.py: entries past kv_len, after the query's
 * position, or outside a sliding window are skipped, so compressed heads (entries dropped) are served too.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MAX_BLOCK 64
#define MAX_GROUPS 64
#define MAX_GROUP_DIM 4096 /* query heads per kv head x head_dim the stack buffers hold */
#define TILE_GROUPS 3
#define TILE_VECS 4

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

typedef __m256 (*load8_fn)(const void *, int64_t);

/* acc[g][d0 : d0 + 8 * nv] for the `gc` query heads from g0 = shrink * acc + sum_j s[g][j] * v[keep[j]].
 * Always inlined with constant gc and nv, so the tile lives in registers. */
static inline __attribute__((always_inline)) void value_tile(float *acc, const float *scores, const float *shrink,
                                                              const void *vb, const int64_t *keep, int64_t kept,
                                                              int64_t head_dim, int64_t g0, int64_t d0, int gc,
                                                              int nv, load8_fn load8) {
    __m256 o[TILE_GROUPS][TILE_VECS];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++)
            o[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (g0 + g) * head_dim + d0 + 8 * c),
                                    _mm256_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        const int64_t row = keep[j] * head_dim + d0;
        __m256 w[TILE_GROUPS];
        for (int g = 0; g < gc; g++) w[g] = _mm256_set1_ps(scores[(g0 + g) * MAX_BLOCK + j]);
        for (int c = 0; c < nv; c++) {
            __m256 v = load8(vb, row + 8 * c);
            for (int g = 0; g < gc; g++) o[g][c] = _mm256_fmadd_ps(w[g], v, o[g][c]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(acc + (g0 + g) * head_dim + d0 + 8 * c, o[g][c]);
}

#define VALUE_TILE(D0, GC, NV) value_tile(acc, scores, shrink, vb, keep, kept, head_dim, g0, D0, GC, NV, load8)

static inline __attribute__((always_inline)) void values(float *acc, const float *scores, const float *shrink,
                                                         const void *vb, const int64_t *keep, int64_t kept,
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
static inline __attribute__((always_inline)) void block_scores(const float *qg, const void *kb, const int64_t *keep,
                                                               int64_t kept, int64_t head_dim, float *s,
                                                               load8_fn load8) {
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) {
            __m256 q = _mm256_loadu_ps(qg + d);
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(load8(kb, keep[j + i] * head_dim + d), q, a[i]);
        }
        _mm256_storeu_ps(s + j, hsum8(a));
    }
    for (; j < kept; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(load8(kb, keep[j] * head_dim + d),
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
                                                                const int64_t *keep, int64_t kept, int64_t head_dim,
                                                                int64_t g0, int64_t d0, int gc, int nv, int64_t elem) {
    __m512 o[TILE_GROUPS][TILE_VECS];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++)
            o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c),
                                    _mm512_set1_ps(shrink[g0 + g]));
    for (int64_t j = 0; j < kept; j++) {
        const int64_t row = keep[j] * head_dim + d0;
        __m512 w[TILE_GROUPS];
        for (int g = 0; g < gc; g++) w[g] = _mm512_set1_ps(scores[(g0 + g) * MAX_BLOCK + j]);
        for (int c = 0; c < nv; c++) {
            __m512 v = load16(vb, row + 16 * c, elem);
            for (int g = 0; g < gc; g++) o[g][c] = _mm512_fmadd_ps(w[g], v, o[g][c]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(acc + (g0 + g) * head_dim + d0 + 16 * c, o[g][c]);
}

#define VALUE_TILE16(D0, GC, NV) value_tile16(acc, scores, shrink, vb, keep, kept, head_dim, g0, D0, GC, NV, elem)

static inline __attribute__((always_inline)) void values16(float *acc, const float *scores, const float *shrink,
                                                           const void *vb, const int64_t *keep, int64_t kept,
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
static inline __attribute__((always_inline)) void block_scores16(const float *qg, const void *kb, const int64_t *keep,
                                                                 int64_t kept, int64_t head_dim, float *s, int gc,
                                                                 int64_t elem) {
    int64_t j = 0;
    for (; j + 8 <= kept; j += 8) {
        __m512 a[TILE_GROUPS][8];
        for (int g = 0; g < gc; g++)
            for (int i = 0; i < 8; i++) a[g][i] = _mm512_setzero_ps();
        int64_t rows[8];
        for (int i = 0; i < 8; i++) rows[i] = keep[j + i] * head_dim;
        for (int64_t d = 0; d < head_dim; d += 16) {
            __m512 q[TILE_GROUPS];
            for (int g = 0; g < gc; g++) q[g] = _mm512_loadu_ps(qg + g * head_dim + d);
            for (int i = 0; i < 8; i++) {
                const __m512 k = load16(kb, rows[i] + d, elem);
                for (int g = 0; g < gc; g++) a[g][i] = _mm512_fmadd_ps(k, q[g], a[g][i]);
            }
        }
        for (int g = 0; g < gc; g++) {
            __m256 h[8];
            for (int i = 0; i < 8; i++) h[i] = fold16(a[g][i]);
            _mm256_storeu_ps(s + g * MAX_BLOCK + j, hsum8(h));
        }
    }
    for (; j < kept; j++) {
        for (int g = 0; g < gc; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16)
                a = _mm512_fmadd_ps(load16(kb, keep[j] * head_dim + d, elem), _mm512_loadu_ps(qg + g * head_dim + d),
                                    a);
            s[g * MAX_BLOCK + j] = _mm512_reduce_add_ps(a);
        }
    }
}

/* Every query head's scores of one block, in tiles of up to three heads: scores[g * MAX_BLOCK + j]. */
static inline __attribute__((always_inline)) void scores16(const float *qf, const void *kb, const int64_t *keep,
                                                           int64_t kept, int64_t head_dim, int64_t groups,
                                                           float *scores, int64_t elem) {
    for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
        const float *qg = qf + g0 * head_dim;
        float *s = scores + g0 * MAX_BLOCK;
        const int64_t gc = groups - g0 >= TILE_GROUPS ? TILE_GROUPS : groups - g0;
        if (gc == 3) block_scores16(qg, kb, keep, kept, head_dim, s, 3, elem);
        else if (gc == 2) block_scores16(qg, kb, keep, kept, head_dim, s, 2, elem);
        else block_scores16(qg, kb, keep, kept, head_dim, s, 1, elem);
    }
}
#endif

/* The next block's entries are requested into L2 while this block computes: blocks lie scattered over the
 * pool, so the hardware prefetchers cannot see the next one coming, and without this each block starts with
 * a wait on memory (three of them: positions, keys, then values). L2 rather than L1: at head_dim 64 a block's
 * keys and values are 64 (bf16) or 128 (fp32) lines, more than the L1 can keep in flight beside the demand loads
 * (measured in docs/benchmarks.md).
 * Always inlined: GCC finds a function that only prefetches free of effects and deletes calls to it. */
static inline __attribute__((always_inline)) void prefetch_block(int64_t blk, const void *k_cache,
                                                                  const void *v_cache, const int32_t *pos_cache,
                                                                  int64_t block_size, int64_t block_bytes) {
    const char *k = (const char *)k_cache + blk * block_bytes, *v = (const char *)v_cache + blk * block_bytes;
    _mm_prefetch((const char *)(pos_cache + blk * block_size), _MM_HINT_T1);
    for (int64_t o = 0; o < block_bytes; o += 64) {
        _mm_prefetch(k + o, _MM_HINT_T1);
        _mm_prefetch(v + o, _MM_HINT_T1);
    }
}

typedef float (*load1_fn)(const void *, int64_t);
typedef void (*store1_fn)(void *, int64_t, float);

/* One (sequence, kv head) pair: its query heads against its blocks. Always inlined with constant loaders, one
 * copy per dtype (inside an OpenMP region a function pointer would stay a call per load). */
static inline __attribute__((always_inline)) void decode_pair(
    int64_t pair, const void *q, const void *k_cache, const void *v_cache, const int32_t *pos_cache,
    const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, void *out, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
    float softcap, int64_t elem, int wide, load8_fn load8, load1_fn load1, store1_fn store1) {
    const int64_t groups = num_q_heads / num_kv_heads;
    const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
    const int64_t *table = tables + pair * width;
    const int64_t len = kv_lens[pair], qp = q_pos[b];
    const int64_t q0 = (b * num_q_heads + h * groups) * head_dim;
    float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM], run_max[MAX_GROUPS], run_sum[MAX_GROUPS];
    float shrink[MAX_GROUPS], scores[MAX_GROUPS * MAX_BLOCK];
    int64_t keep[MAX_BLOCK];
    for (int64_t i = 0; i < groups * head_dim; i++) {
        qf[i] = load1(q, q0 + i) * scale;
        acc[i] = 0.f;
    }
    for (int64_t g = 0; g < groups; g++) { run_max[g] = -INFINITY; run_sum[g] = 0.f; }
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size];
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int32_t *pos = pos_cache + blk * block_size;
        int64_t kept = 0;
        for (int64_t j = 0; j < n; j++) {
            if (pos[j] > qp || (window > 0 && pos[j] <= qp - window)) continue;
            keep[kept++] = j;
        }
        if (kept == 0) continue;
        const int64_t block_bytes = block_size * head_dim * elem;
        const char *kb = (const char *)k_cache + blk * block_bytes;
        const char *vb = (const char *)v_cache + blk * block_bytes;
        if (start + block_size < len) prefetch_block(table[start / block_size + 1], k_cache, v_cache, pos_cache,
                                                     block_size, block_bytes);
#ifdef __AVX512F__
        if (wide) scores16(qf, kb, keep, kept, head_dim, groups, scores, elem);
#endif
        for (int64_t g = 0; g < groups; g++) {
            float *s = scores + g * MAX_BLOCK;
            if (!wide) block_scores(qf + g * head_dim, kb, keep, kept, head_dim, s, load8);
            float m = run_max[g];
            for (int64_t j = 0; j < kept; j++) {
                if (softcap > 0.f) s[j] = tanhf(s[j] / softcap) * softcap;
                if (s[j] > m) m = s[j];
            }
            /* The running output and sum shrink by exp(old max - new max), once per block. */
            shrink[g] = run_max[g] == -INFINITY ? 0.f : expf(run_max[g] - m);
            run_max[g] = m;
            int64_t j = 0;
            for (; j + 8 <= kept; j += 8)
                _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m))));
            for (; j < kept; j++) s[j] = expf(s[j] - m);
            float total = 0.f;
            for (j = 0; j < kept; j++) total += s[j];
            run_sum[g] = run_sum[g] * shrink[g] + total;
        }
#ifdef __AVX512F__
        if (wide) values16(acc, scores, shrink, vb, keep, kept, head_dim, groups, elem); else
#endif
        values(acc, scores, shrink, vb, keep, kept, head_dim, groups, load8);
    }
    for (int64_t g = 0; g < groups; g++) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        for (int64_t d = 0; d < head_dim; d++) store1(out, q0 + g * head_dim + d, acc[g * head_dim + d] * inv);
    }
}

#define DECODE_PAIRS(ELEM, WIDE, LOAD8, LOAD1, STORE1)                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1)")                   \
    for (int64_t pair = 0; pair < batch * num_kv_heads; pair++)                                               \
        decode_pair(pair, q, k_cache, v_cache, pos_cache, tables, kv_lens, q_pos, out, num_q_heads,           \
                    num_kv_heads, head_dim, block_size, width, scale, window, softcap, ELEM, WIDE, LOAD8, LOAD1,  \
                    STORE1);

#ifdef __AVX512F__
#define DECODE_ALL(ELEM, LOAD8, LOAD1, STORE1)                                                                   \
    if (head_dim % 16 == 0) {                                                                                 \
        DECODE_PAIRS(ELEM, 1, LOAD8, LOAD1, STORE1)                                                           \
    } else {                                                                                                  \
        DECODE_PAIRS(ELEM, 0, LOAD8, LOAD1, STORE1)                                                           \
    }
#else
#define DECODE_ALL(ELEM, LOAD8, LOAD1, STORE1) do { DECODE_PAIRS(ELEM, 0, LOAD8, LOAD1, STORE1) } while (0)
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
