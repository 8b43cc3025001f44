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
 *    bf16 pools with BF16 dot products instead transpose the chunk's keys once and score sixteen keys to a
 *    vector for up to four heads, with no horizontal sums at all (`scores_transposed`);
 *  - values: register tiles of up to three query heads x 32-64 channels (four for bf16 pairs), so each value row
 *    loaded serves every query head of the tile while the accumulators stay in registers for the whole chunk;
 *  - memory: a per-thread prefetcher runs a fixed number of entries ahead of the value loop, through the rest
 *    of the pair's blocks and on into the thread's next pair (see `prefetcher`).
 * The tiles and the prefetcher are in paged_decode_tiles.h.
 * Masking is by stored position, as in kernels/paged_attention.py: entries past kv_len, after the query's
 * position, or outside a sliding window are skipped, so compressed heads (entries dropped) are served too.
 * A sequence being compressed also needs the attention each of its entries received (its probabilities summed
 * over the kv head's query heads, kernels/kv_compress.py's reference): with `received` given, each chunk's
 * exponentials are kept beside the pass and scaled by the head's final max and sum at the end (`observed`), so
 * the scores come from the same single read of the keys.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paged_decode_tiles.h"
#include "simd.h"

#define MAX_BLOCK 64
/* Entries the prefetcher runs ahead of the value loop: more than a chunk, since a chunk's scores are all computed
 * before its values are read. 192 measured best of 0-512 (docs/benchmarks.md, "Decode attention: chunks of 64
 * entries"). */
#define LEAD 192
#define MAX_GROUP_DIM 4096 /* query heads per kv head x head_dim the stack buffers hold */

typedef void (*store8_fn)(void *, int64_t, __m256);

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

/* What an observed pair keeps while it runs: each visible entry's exponentials (per query head, against the
 * running max of its chunk), its index in the head's entries, and per chunk that max and where the chunk ends.
 * Per thread, grown to the largest pair seen (sizes follow kv_len, which has no fixed bound). */
typedef struct {
    float *ex;        /* [groups, len] */
    int32_t *index;   /* [len] */
    float *chunk_max; /* [groups, chunks] */
    int64_t *chunk_end;
    int64_t len, chunks, capacity; /* chunks so far, and room for */
} observed;

static _Thread_local char *observed_buffer;
static _Thread_local size_t observed_size;

static void observed_start(observed *o, int64_t groups, int64_t len, int64_t block_size) {
    const int64_t chunks = (len + block_size - 1) / block_size + 1; /* a chunk takes at least one block */
    const size_t need = (size_t)(groups * len + groups * chunks) * sizeof(float) + (size_t)len * sizeof(int32_t)
                        + (size_t)chunks * sizeof(int64_t) + 64 * sizeof(int32_t);
    if (need > observed_size) {
        free(observed_buffer);
        observed_buffer = malloc(need);
        observed_size = observed_buffer ? need : 0;
        if (!observed_buffer) { /* no memory for a few floats an entry: the process is out of it anyway */
            fputs("hearth_paged_decode: out of memory for the received attention\n", stderr);
            abort();
        }
    }
    o->chunk_end = (int64_t *)observed_buffer;
    o->ex = (float *)(o->chunk_end + chunks);
    o->chunk_max = o->ex + groups * len;
    o->index = (int32_t *)(o->chunk_max + groups * chunks);
    o->len = len;
    o->chunks = 0;
    o->capacity = chunks;
}

/* received[e] for each of the pair's `width` entries: sum over its query heads of exp(s - chunk max) scaled to
 * the head's final max and sum, 0 for entries no query saw. */
static void observed_finish(const observed *o, const float *run_max, const float *run_sum, int64_t groups,
                            float *received, int64_t width) {
    memset(received, 0, (size_t)width * sizeof(float));
    float factor[MAX_GROUPS];
    for (int64_t c = 0, p = 0; c < o->chunks; c++) {
        for (int64_t g = 0; g < groups; g++)
            factor[g] = run_sum[g] > 0.f ? expf(o->chunk_max[g * o->capacity + c] - run_max[g]) / run_sum[g] : 0.f;
        for (; p < o->chunk_end[c]; p++) {
            float total = 0.f;
            for (int64_t g = 0; g < groups; g++) total += o->ex[g * o->len + p] * factor[g];
            received[o->index[p]] = total;
        }
    }
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
    float softcap, int64_t elem, int mode, prefetcher *pf, load8_fn load8, store8_fn store8, float *received) {
    (void)elem; /* read by the sixteen-lane loops only */
    const int64_t groups = num_q_heads / num_kv_heads;
    const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
    const int64_t *table = tables + pair * width;
    const int64_t len = kv_lens[pair], qp = q_pos[b];
    const int64_t q0 = (b * num_q_heads + h * groups) * head_dim;
    float qf[MAX_GROUP_DIM], acc[MAX_GROUP_DIM], run_max[MAX_GROUPS], run_sum[MAX_GROUPS];
    float shrink[MAX_GROUPS], scores[MAX_GROUPS * CHUNK];
    int64_t rows[CHUNK + 8]; /* where each kept entry's row starts in the caches, in elements (+ 8: the vector
                              * stores below write whole vectors past the last kept entry) */
    int32_t index[CHUNK + 16]; /* observed pairs: each kept entry's index in the head's entries (+ 16: as rows) */
    observed obs;
    const int observe = received != 0;
    if (observe) observed_start(&obs, groups, len, block_size);
    for (int64_t i = 0; i < groups * head_dim; i += 8) /* head_dim % 8 == 0 */
        _mm256_storeu_ps(qf + i, _mm256_mul_ps(load8(q, q0 + i), _mm256_set1_ps(scale)));
    memset(acc, 0, (size_t)(groups * head_dim) * sizeof(float));
    for (int64_t g = 0; g < groups; g++) { run_max[g] = -INFINITY; run_sum[g] = 0.f; }
    int64_t seen_total = 0; /* observed pairs: visible entries so far */
    for (int64_t start = 0; start < len;) {
        int64_t kept = 0;
        int64_t seen = 0;
        for (; start < len && kept + block_size <= CHUNK; start += block_size) {
            const int64_t blk = table[start / block_size];
            const int64_t n = len - start < block_size ? len - start : block_size;
            const int32_t *pos = pos_cache + blk * block_size;
#ifdef __AVX512F__
            /* sixteen entries a compare; the visible ones' rows packed to the front of a vector (compressing in
             * registers: to memory it is microcoded on AMD) */
            const __m512i q_at = _mm512_set1_epi32((int32_t)qp);
            const __m512i after = _mm512_set1_epi32(window > 0 ? (int32_t)(qp - window) : INT32_MIN);
            const int64_t d = head_dim;
            const __m512i first8 = _mm512_set_epi64(7 * d, 6 * d, 5 * d, 4 * d, 3 * d, 2 * d, d, 0);
            const __m512i iota16 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            for (int64_t j = 0; j < n; j += 16) {
                const __mmask16 in = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
                const __m512i p = _mm512_maskz_loadu_epi32(in, pos + j);
                const __mmask16 vis =
                    _mm512_mask_cmple_epi32_mask(in, p, q_at) & _mm512_cmpgt_epi32_mask(p, after);
                if (observe)
                    _mm512_storeu_si512(index + kept, _mm512_maskz_compress_epi32(
                                                          vis, _mm512_add_epi32(_mm512_set1_epi32((int32_t)(start + j)),
                                                                                iota16)));
                const __m512i r = _mm512_add_epi64(first8, _mm512_set1_epi64((blk * block_size + j) * head_dim));
                _mm512_storeu_si512(rows + kept, _mm512_maskz_compress_epi64((__mmask8)vis, r));
                kept += __builtin_popcount(vis & 0xffu);
                _mm512_storeu_si512(rows + kept, _mm512_maskz_compress_epi64(
                                                     (__mmask8)(vis >> 8),
                                                     _mm512_add_epi64(r, _mm512_set1_epi64(8 * head_dim))));
                kept += __builtin_popcount(vis >> 8);
            }
#else
            for (int64_t j = 0; j < n; j++) { /* branch-free: kept only moves on for a visible entry */
                rows[kept] = (blk * block_size + j) * head_dim;
                if (observe) index[kept] = (int32_t)(start + j);
                kept += pos[j] <= qp && (window <= 0 || pos[j] > qp - window);
            }
#endif
            seen += block_size;
        }
        pf_advance(pf, seen - kept); /* the value loop moves the prefetcher on only for the entries it reads */
        if (kept == 0) continue;
#ifdef __AVX512F__
#ifdef __AVX512BF16__
        if (mode == PAIRS && head_dim <= MAX_HEAD_DIM)
            scores_transposed((const uint16_t *)q + q0, k_cache, rows, kept, head_dim, groups, scale, scores);
        else if (mode == PAIRS) scores_dot((const uint16_t *)q + q0, k_cache, rows, kept, head_dim, groups, scale, scores);
#else
        if (mode == PAIRS) scores16(qf, k_cache, rows, kept, head_dim, groups, scores, elem);
#endif
        if (mode == LANES16) scores16(qf, k_cache, rows, kept, head_dim, groups, scores, elem);
#endif
        for (int64_t g = 0; g < groups; g++) {
            float *s = scores + g * CHUNK;
            if (mode == LANES8) block_scores(qf + g * head_dim, k_cache, rows, kept, head_dim, s, load8);
            softmax_chunk(s, kept, softcap, run_max + g, run_sum + g, shrink + g);
            if (observe) { /* before the value loops, which may round the probabilities in place */
                memcpy(obs.ex + g * len + seen_total, s, (size_t)kept * sizeof(float));
                obs.chunk_max[g * obs.capacity + obs.chunks] = run_max[g];
            }
        }
        if (observe) {
            memcpy(obs.index + seen_total, index, (size_t)kept * sizeof(int32_t));
            seen_total += kept;
            obs.chunk_end[obs.chunks++] = seen_total;
            if (!out) continue; /* the received scores alone (a prompt's observed queries): no values to weigh */
        }
#ifdef __AVX512F__
#ifdef __AVX512BF16__
        if (mode == PAIRS) values_dot(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups);
#else
        if (mode == PAIRS) values_pairs(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups);
#endif
        if (mode == LANES16) values16(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups, elem);
#endif
        if (mode == LANES8) values(acc, scores, shrink, v_cache, rows, kept, pf, head_dim, groups, load8);
    }
    if (observe) {
        observed_finish(&obs, run_max, run_sum, groups, received + pair * width * block_size, width * block_size);
        if (!out) return;
    }
    for (int64_t g = 0; g < groups; g++) { /* out = acc / sum, eight channels a store */
        const __m256 inv = _mm256_set1_ps(run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f);
        const float *a = acc + g * head_dim;
        const int64_t at = q0 + g * head_dim;
#ifdef __AVX512F__
        if (mode == PAIRS) { /* each 32 channels back in order from their two halves of 16 (values_pairs: the 16
                              * even and 16 odd ones; values_dot: the lo and hi lanes of each 128-bit lane) */
#ifdef __AVX512BF16__
            const __m512i low = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
            const __m512i high = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
#else
            const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#endif
            for (int64_t d = 0; d < head_dim; d += 32) {
                const __m512 first_half = _mm512_loadu_ps(a + d), second_half = _mm512_loadu_ps(a + d + 16);
                const __m512 part[2] = {_mm512_permutex2var_ps(first_half, low, second_half),
                                        _mm512_permutex2var_ps(first_half, high, second_half)};
                for (int i = 0; i < 2; i++) {
                    const __m256 first = _mm512_castps512_ps256(part[i]);
                    const __m256 second = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(part[i]), 1));
                    store8(out, at + d + 16 * i, _mm256_mul_ps(first, inv));
                    store8(out, at + d + 16 * i + 8, _mm256_mul_ps(second, inv));
                }
            }
            continue;
        }
#endif
        for (int64_t d = 0; d < head_dim; d += 8) store8(out, at + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), inv));
    }
}

/* Pairs are dealt round robin (thread t takes t, t + T, ...), so each thread's prefetcher knows which blocks it
 * reads next; it starts LEAD entries ahead of the thread's first pair. */
#define DECODE_PAIRS(ELEM, MODE, LOAD8, STORE8, RECEIVED)                                                        \
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
                        LOAD8, STORE8, RECEIVED);                                                             \
    }

/* The observed and plain passes are separate copies (RECEIVED a constant null in the plain one), so a step with no
 * sequence being compressed runs without the bookkeeping's branches. */
#ifdef __AVX512F__
#define DECODE_MODES(ELEM, LOAD8, STORE8, RECEIVED)                                                           \
    if (ELEM == 2 && head_dim % 32 == 0) {                                                                    \
        DECODE_PAIRS(ELEM, PAIRS, LOAD8, STORE8, RECEIVED)                                                    \
    } else if (head_dim % 16 == 0) {                                                                          \
        DECODE_PAIRS(ELEM, LANES16, LOAD8, STORE8, RECEIVED)                                                  \
    } else {                                                                                                  \
        DECODE_PAIRS(ELEM, LANES8, LOAD8, STORE8, RECEIVED)                                                   \
    }
#else
#define DECODE_MODES(ELEM, LOAD8, STORE8, RECEIVED)                                                           \
    { DECODE_PAIRS(ELEM, LANES8, LOAD8, STORE8, RECEIVED) }
#endif
#define DECODE_ALL(ELEM, LOAD8, STORE8)                                                                       \
    if (received) {                                                                                           \
        DECODE_MODES(ELEM, LOAD8, STORE8, received)                                                           \
    } else {                                                                                                  \
        DECODE_MODES(ELEM, LOAD8, STORE8, (float *)0)                                                         \
    }

/* q [B, Hq, D]; k_cache, v_cache [NB, BS, D]; pos_cache [NB, BS] int32; tables [B, Hkv, W] int64;
 * kv_lens [B, Hkv] int32; q_pos [B] int64; out [B, Hq, D]. window <= 0: none; softcap <= 0: none.
 * D % 8 == 0, BS <= MAX_BLOCK, Hq / Hkv <= MAX_GROUPS, (Hq / Hkv) * D <= MAX_GROUP_DIM (the caller checks).
 * q, the caches and out are all fp32 (_f32) or all bf16 (_bf16). received: null, or [B, Hkv, W * BS] fp32 for
 * the attention each entry received (summed over the kv head's query heads; 0 for entries no query saw); with
 * received, out may be null for those scores alone. */
void hearth_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *pos_cache,
                             const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, float *out,
                             int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t width, float scale, int64_t window, float softcap,
                             int64_t threads, float *received) {
    DECODE_ALL(4, load8_f32, store8_f32)
}

void hearth_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *pos_cache, const int64_t *tables, const int32_t *kv_lens,
                              const int64_t *q_pos, uint16_t *out, int64_t batch, int64_t num_q_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale,
                              int64_t window, float softcap, int64_t threads, float *received) {
    DECODE_ALL(2, load8_bf16, store8_bf16)
}

/* Whether bf16 pools of this head_dim weigh their values by dot products here (values_dot: the probabilities rounded
 * to bf16, as torch's bf16 attention rounds them); otherwise bf16 results are the fp32 computation rounded once. */
int64_t hearth_paged_decode_pairs(int64_t head_dim) {
#ifdef __AVX512BF16__
    return head_dim % 32 == 0;
#else
    (void)head_dim;
    return 0;
#endif
}
