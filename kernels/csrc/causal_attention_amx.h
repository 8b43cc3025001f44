/* causal_attention.c's bf16 prompt attention on AMX tiles (Intel Sapphire Rapids and later), where the build has
 * them and Linux lets the process use them, for head_dim a multiple of 32. Included by causal_attention.c only.
 *
 * Why: the fp32 kernel widens bf16 and multiplies on AVX-512 lanes; on an AMX Xeon torch's own SDPA (oneDNN's
 * tiles) outran it 3x at 2048 tokens (docs/benchmarks.md, cpu_attention). Here both products run on the tiles:
 * scores S = Q K^T sixteen query vectors by sixteen keys a tile, and the values O += P V sixteen vectors by sixteen
 * channels a tile, with the probabilities P rounded to bf16 for the second product, as torch's CPU flash attention
 * rounds them. Everything else (scale, mask, online softmax, the running sums) stays fp32, and each output is
 * rounded once.
 *
 * Layouts (a tile multiply takes its right operand as pairs: row p holds, for each of 16 columns, elements 2p and
 * 2p + 1 of the reduced dimension in one 32-bit lane), made by causal_attention_pairs.h's pairs_prepare:
 *  - keys as kt [Hkv][tpad / 16][D / 2][16] of 32-bit channel pairs: row p of a key tile is channels 2p, 2p + 1
 *    of 16 consecutive keys, and a tile is 1 KB in one piece (the pass before the tasks transposes the keys once
 *    per prompt; rows a whole [D / 2][tpad] apart made each tile's loads stall);
 *  - values as vv [Hkv][tpad / 2][D] of 32-bit key pairs: row s of a value tile is keys 2s, 2s + 1 of 16
 *    consecutive channels;
 *  - queries and probabilities are left operands, rows as they are (a vector's channels, a vector's keys).
 * Per task (16 query rows x one kv head, as the fp32 path deals them), sixteen query vectors at a time walk the
 * keys AK at a time: score tiles four at a time, stored for the softmax; the running outputs O [16][D] live in an
 * L1 buffer, scaled when the running max moves, and go through the tiles (four channel tiles at a time) once per
 * block of keys.
 */
#include "amx.h"
#include "causal_attention_pairs.h"

#define AK 128 /* keys per block: eight score tiles of 16, four at a time */

static int attention_amx_permitted;

__attribute__((constructor)) static void attention_amx_request(void) {
    attention_amx_permitted = amx_request_permission();
}

static inline int attention_amx_takes(int64_t D) { return attention_amx_permitted && D % 32 == 0 && D <= MAX_DIM; }

/* Scores of the 16 vectors in qb [16][D] against keys [t0, t0 + 16 * groups) of kt (one kv head) into
 * s [16][AK] (from its column 0), unscaled. groups (1-4) is a constant once inlined: tile numbers must be. */
static inline __attribute__((always_inline)) void amx_scores(int groups, const uint16_t *qb, const uint32_t *kt,
                                                              int64_t t0, int64_t D, float *s) {
    _tile_zero(0);
    if (groups > 1) _tile_zero(1);
    if (groups > 2) _tile_zero(2);
    if (groups > 3) _tile_zero(3);
    const int64_t group = (D / 2) * 16; /* u32 per group of 16 keys */
    for (int64_t dc = 0; dc < D / 32; dc++) {
        const uint32_t *k = kt + (t0 / 16) * group + dc * 256;
        _tile_loadd(4, qb + dc * 32, D * 2);
        _tile_loadd(5, k, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
            _tile_loadd(6, k + group, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (groups > 2) {
            _tile_loadd(7, k + 2 * group, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (groups > 3) {
            _tile_loadd(5, k + 3 * group, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, s, AK * 4);
    if (groups > 1) _tile_stored(1, s + 16, AK * 4);
    if (groups > 2) _tile_stored(2, s + 32, AK * 4);
    if (groups > 3) _tile_stored(3, s + 48, AK * 4);
}

/* o [16][D] += p [16][32 * chunks] (bf16, rows AK apart) times values [t0, t0 + 32 * chunks) of vv (one kv
 * head), channels [c0, c0 + 16 * tiles); tiles (2 or 4) a constant once inlined. */
static inline __attribute__((always_inline)) void amx_values(int tiles, int64_t chunks, const uint16_t *p,
                                                              const uint32_t *vv, int64_t t0, int64_t c0, int64_t D,
                                                              float *o) {
    _tile_loadd(0, o + c0, D * 4);
    _tile_loadd(1, o + c0 + 16, D * 4);
    if (tiles > 2) {
        _tile_loadd(2, o + c0 + 32, D * 4);
        _tile_loadd(3, o + c0 + 48, D * 4);
    }
    for (int64_t kc = 0; kc < chunks; kc++) {
        const uint32_t *v = vv + (t0 / 2 + kc * 16) * D + c0;
        _tile_loadd(4, p + kc * 32, AK * 2);
        _tile_loadd(5, v, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        if (tiles > 2) {
            _tile_loadd(7, v + 32, D * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, v + 48, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, o + c0, D * 4);
    _tile_stored(1, o + c0 + 16, D * 4);
    if (tiles > 2) {
        _tile_stored(2, o + c0 + 32, D * 4);
        _tile_stored(3, o + c0 + 48, D * 4);
    }
}

/* Row s of the score buffer (`vecs` vectors of 16 keys from t0) scaled and masked past the vector's position, in
 * place; its largest value. */
static inline float amx_mask_row(float *s, int64_t vecs, int64_t t0, float pos, float scale) {
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < vecs; c++) {
        const __m512 idx = _mm512_add_ps(lanes, _mm512_set1_ps((float)(t0 + 16 * c)));
        const __mmask16 live = _mm512_cmp_ps_mask(idx, _mm512_set1_ps(pos), _CMP_LE_OQ);
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, _mm512_loadu_ps(s + 16 * c),
                                            _mm512_set1_ps(scale));
        _mm512_storeu_ps(s + 16 * c, x);
        mx = _mm512_max_ps(mx, x);
    }
    return _mm512_reduce_max_ps(mx);
}

/* exp(s - m) of a masked row into p as bf16 (zero where masked); their fp32 sum. */
static inline float amx_exp_row(const float *s, int64_t vecs, float m, uint16_t *p) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < vecs; c++) {
        const __m512 x = _mm512_loadu_ps(s + 16 * c);
        const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

#define AMX_SCORES(G, AT) amx_scores(G, qb, kt, t0 + (AT), D, sb + (AT))

/* Scores of keys [t0 + at, t0 + at + 16 * groups) into columns [at, ...) of sb, groups 1-4. */
#define AMX_SCORE_PART(GROUPS, AT)                                                                                \
    do {                                                                                                          \
        if ((GROUPS) == 1) AMX_SCORES(1, AT);                                                                     \
        else if ((GROUPS) == 2) AMX_SCORES(2, AT);                                                                \
        else if ((GROUPS) == 3) AMX_SCORES(3, AT);                                                                \
        else AMX_SCORES(4, AT);                                                                                   \
    } while (0)

/* Up to 16 query vectors of one kv head (kt, vv: its keys and values): vector i is q row at element offset
 * from[i], at position pos[i], its output going to element offset to[i] of out. nv live; the rest repeat the last
 * and are dropped. Keys go AK at a time: scores in tiles of 16 (four tiles at once), one softmax update per row,
 * then the values; the running outputs make one trip through the tiles per block (which is why a block is long:
 * a tile load of what the vector code just stored waits for it). */
static void amx_vectors(const uint16_t *q, const int64_t from[16], const float pos_in[16], const int64_t to[16],
                        int nv, uint16_t *out, const uint32_t *kt, const uint32_t *vv, int64_t D, float scale) {
    _Alignas(64) uint16_t qb[16 * MAX_DIM];
    _Alignas(64) float o[16 * MAX_DIM];
    _Alignas(64) float sb[16 * AK];
    _Alignas(64) uint16_t pb[16 * AK];
    _Alignas(64) float run_max[16], run_sum[16], next_max[16], shrink[16], pos[16];
    float last = 0.f;
    for (int i = 0; i < 16; i++) {
        const int live = i < nv ? i : nv - 1;
        memcpy(qb + i * D, q + from[live], (size_t)D * 2);
        run_max[i] = -INFINITY;
        run_sum[i] = 0.f;
        pos[i] = pos_in[live];
        last = pos[i] > last ? pos[i] : last;
    }
    memset(o, 0, sizeof(float) * 16 * (size_t)D);
    TILE_LOADS_SEE_STORES(); /* qb, and o below */
    for (int64_t t0 = 0; t0 <= (int64_t)last; t0 += AK) {
        const int64_t keys = (int64_t)last + 1 - t0 < AK ? (int64_t)last + 1 - t0 : AK;
        const int64_t groups = (keys + 15) / 16, chunks = (keys + 31) / 32;
        for (int64_t g0 = 0; g0 < groups; g0 += 4) AMX_SCORE_PART(groups - g0 < 4 ? groups - g0 : 4, 16 * g0);
        for (int i = 0; i < 16; i++) {
            const float m = amx_mask_row(sb + i * AK, 2 * chunks, t0, pos[i], scale);
            next_max[i] = m > run_max[i] ? m : run_max[i]; /* finite: every vector sees key 0 in the first block */
        }
        /* the sixteen running maxima move at once: one vector of exponentials (none before the first block) */
        const __m512 old = _mm512_loadu_ps(run_max), now = _mm512_loadu_ps(next_max);
        _mm512_storeu_ps(shrink, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                                     exp16(_mm512_sub_ps(old, now))));
        _mm512_storeu_ps(run_max, now);
        for (int i = 0; i < 16; i++) {
            run_sum[i] = run_sum[i] * shrink[i] + amx_exp_row(sb + i * AK, 2 * chunks, next_max[i], pb + i * AK);
            if (shrink[i] != 1.f)
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d),
                                                                  _mm512_set1_ps(shrink[i])));
        }
        TILE_LOADS_SEE_STORES(); /* the probabilities, and o scaled */
        for (int64_t c0 = 0; c0 < D; c0 += 64) {
            if (D - c0 >= 64) amx_values(4, chunks, pb, vv, t0, c0, D, o);
            else amx_values(2, chunks, pb, vv, t0, c0, D, o); /* D % 32 == 0 */
        }
    }
    for (int i = 0; i < nv; i++) {
        const __m256 inv = _mm256_set1_ps(1.f / run_sum[i]);
        for (int64_t d = 0; d < D; d += 8)
            _mm_storeu_si128((__m128i *)(out + to[i] + d),
                             narrow8_bf16(_mm256_mul_ps(_mm256_loadu_ps(o + i * D + d), inv)));
    }
}

/* causal_attention.c's attention() on tiles: bf16 q, keys, values and out; scratch as there (its floats hold
 * kt and vv, 4 * Hkv * D * tpad bytes together). */
static void amx_attention(const uint16_t *q, int64_t sq, const Keys *K, uint16_t *out, int64_t T, int64_t ctx,
                          int64_t hq, int64_t hkv, int64_t D, float scale, float *scratch, int64_t threads) {
    const int64_t S = ctx + T, tpad = (S + KT - 1) / KT * KT, G = hq / hkv, tiles = (T + QT - 1) / QT;
    uint32_t *kt = (uint32_t *)scratch, *vv = kt + hkv * (D / 2) * tpad;
    pairs_prepare(K, S, hkv, D, tpad, kt, vv, threads);
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tiles * hkv; task++) {
            const int64_t tile = tiles - 1 - task / hkv, h = task % hkv; /* largest first, as the fp32 path */
            const int64_t r0 = tile * QT, r1 = r0 + QT < T ? r0 + QT : T, vectors = (r1 - r0) * G;
            for (int64_t first = 0; first < vectors; first += 16) {
                int64_t from[16], to[16];
                float pos[16];
                const int nv = vectors - first < 16 ? (int)(vectors - first) : 16;
                for (int i = 0; i < nv; i++) {
                    const int64_t n = first + i, r = r0 + n / G, head = h * G + n % G;
                    from[i] = r * sq + head * D;
                    to[i] = (r * hq + head) * D;
                    pos[i] = (float)(ctx + r);
                }
                amx_vectors(q, from, pos, to, nv, out, kt + h * (D / 2) * tpad, vv + h * (tpad / 2) * D, D, scale);
            }
        }
        _tile_release();
    }
}
