/* Causal self-attention of a prompt on CPU, fp32 or bf16, grouped-query heads: out[t, h] = softmax over keys
 * s <= t of (q[t, h] . k[s, h / G]) * scale, times v[s, h / G]. A fresh prompt (nothing cached before it) passes
 * its own k and v; the next chunk of a prompt whose start is cached reads its keys from the paged KV pool, the
 * chunk's queries sitting after them. All arithmetic is fp32; bf16 inputs are widened once and the output
 * rounded once. bf16 prompts multiply bf16 pairs instead where the CPU can: on AMX tiles
 * (causal_attention_amx.h), else by AVX-512 BF16 dot products (causal_attention_pairs.h); both round the
 * probabilities to bf16 for the value product.
 *
 * torch's SDPA took about 1 ms a layer for a 165-token prompt of SmolLM2 (9 query heads, 3 kv heads, head_dim
 * 64): its per-call setup and the expanded key/value copies for the grouped heads cost more than the ~1 MFLOP of
 * arithmetic per head. Here, in two parallel passes:
 *  1. the keys are transposed per kv head into [head_dim][S] (fp32; S keys, from their rows or the pool's
 *     blocks), the values widened into [S][head_dim], the queries widened and scaled: each is then read by
 *     every query row after it at unit stride;
 *  2. tasks of 16 query rows x one kv head: the rows' query vectors (row-major, the G heads of a row together)
 *     go QB at a time against key tiles of KT keys. Scores are QB x KT register tiles (one broadcast of q[d]
 *     against KT transposed keys per step of d), online softmax per vector with one update per key tile, then
 *     the value rows each multiply-added into the QB running outputs. Keys past a vector's own row are masked
 *     (only the diagonal tile has any).
 * Built by kernels/cpu_build (AVX2 + FMA; 16-lane loops where the CPU has AVX-512).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define KT (4 * VL) /* keys per tile: four vectors of scores per query vector */
#ifdef __AVX512F__
#define QB 4 /* query vectors per register tile: 4 x 4 accumulators of 32 registers */
#else
#define QB 2 /* 2 x 4 of 16 */
#endif
#define QT 16          /* query rows per task */
#define MAX_DIM 512    /* head_dim the stack buffers hold */

/* lanes of x whose key index (idx + lane) lies past `row` become `fill`. */
#ifdef __AVX512F__
static inline vec mask_past(vec x, vec idx, float row, float fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(idx, _mm512_set1_ps(row), _CMP_GT_OQ), x, _mm512_set1_ps(fill));
}
static inline vec vlanes(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vreduce_max(vec a) { return _mm512_reduce_max_ps(a); }
static inline float vreduce_add(vec a) { return _mm512_reduce_add_ps(a); }
static inline vec vexp(vec x) { return exp16(x); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
#else
static inline vec mask_past(vec x, vec idx, float row, float fill) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(fill), _mm256_cmp_ps(idx, _mm256_set1_ps(row), _CMP_GT_OQ));
}
static inline vec vlanes(void) { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vreduce_max(vec a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float vreduce_add(vec a) { return hsum(a); }
static inline vec vexp(vec x) { return exp8(x); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
#endif

static inline float load_elem(const void *p, int64_t i, int bf16) {
    return bf16 ? widen1_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Where key t of kv head h lives: in k and v rows of their own (table NULL: row t, strides sk and sv), or in the
 * paged KV pool (caches [N, B, D], one kv head per block; table [Hkv, W] gives each head's blocks). */
typedef struct {
    const void *k, *v;
    int64_t sk, sv;
    const int64_t *table;
    int64_t width, block;
} Keys;

static inline int64_t key_row(const Keys *K, int64_t h, int64_t t, int64_t stride, int64_t D) {
    if (!K->table) return t * stride + h * D;
    return (K->table[h * K->width + t / K->block] * K->block + t % K->block) * D;
}

/* Pass 1. q [T, Hq, D] with row stride sq, the S keys and values of K; qs [T, Hq, D] (scaled), kt [Hkv, D, tpad],
 * vw [Hkv, tpad, D]; key columns past S are zero (finite, and masked anyway). */
static void prepare(const void *q, int64_t sq, const Keys *K, int64_t T, int64_t S, int64_t hq, int64_t hkv,
                    int64_t D, int64_t tpad, float scale, int bf16, float *qs, float *kt, float *vw,
                    int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t t = 0; t < tpad; t++) {
        for (int64_t h = 0; h < hkv; h++) {
            const int live = t < S;
            const int64_t kr = live ? key_row(K, h, t, K->sk, D) : 0, vr = live ? key_row(K, h, t, K->sv, D) : 0;
            for (int64_t d = 0; d < D; d++) {
                kt[(h * D + d) * tpad + t] = live ? load_elem(K->k, kr + d, bf16) : 0.f;
                vw[(h * tpad + t) * D + d] = live ? load_elem(K->v, vr + d, bf16) : 0.f;
            }
        }
        if (t < T)
            for (int64_t i = 0; i < hq * D; i++) qs[t * hq * D + i] = load_elem(q, t * sq + i, bf16) * scale;
    }
}

/* Pass 2 for QB query vectors (qv[i]: D scaled floats, row[i]: its position) of kv head h: out_f[i] gets the
 * attention output, normalised. nq <= QB vectors are live (the rest repeat the last one and are dropped). */
static inline __attribute__((always_inline)) void attend(const float *const qv[QB], const float row[QB],
                                                         const float *kt, const float *vw, int64_t D, int64_t tpad,
                                                         float out_f[QB][MAX_DIM]) {
    float m[QB], l[QB], p[QB][KT];
    for (int i = 0; i < QB; i++) {
        m[i] = -INFINITY;
        l[i] = 0.f;
        memset(out_f[i], 0, sizeof(float) * D);
    }
    float last = row[0];
    for (int i = 1; i < QB; i++) last = row[i] > last ? row[i] : last;
    const vec lanes = vlanes();
    for (int64_t t0 = 0; t0 <= (int64_t)last; t0 += KT) {
        vec s[QB][4];
        for (int i = 0; i < QB; i++)
            for (int c = 0; c < 4; c++) s[i][c] = vzero();
        for (int64_t d = 0; d < D; d++) {
            const float *krow = kt + d * tpad + t0;
            const vec k0 = vload_f32(krow), k1 = vload_f32(krow + VL), k2 = vload_f32(krow + 2 * VL),
                      k3 = vload_f32(krow + 3 * VL);
            for (int i = 0; i < QB; i++) {
                const vec qd = vbcast(qv[i] + d);
                s[i][0] = vfma(k0, qd, s[i][0]);
                s[i][1] = vfma(k1, qd, s[i][1]);
                s[i][2] = vfma(k2, qd, s[i][2]);
                s[i][3] = vfma(k3, qd, s[i][3]);
            }
        }
        float shrink[QB];
        for (int i = 0; i < QB; i++) {
            vec mx = vset1(-INFINITY);
            for (int c = 0; c < 4; c++) {
                s[i][c] = mask_past(s[i][c], vadd(lanes, vset1((float)(t0 + c * VL))), row[i], -INFINITY);
                mx = vmax(mx, s[i][c]);
            }
            /* finite: every vector sees key 0, so m is finite after the first tile and later tiles may be all masked */
            const float mnew = fmaxf(m[i], vreduce_max(mx));
            shrink[i] = m[i] == -INFINITY ? 0.f : expf(m[i] - mnew);
            m[i] = mnew;
            vec sum = vzero();
            for (int c = 0; c < 4; c++) {
                const vec idx = vadd(lanes, vset1((float)(t0 + c * VL)));
                const vec e = mask_past(vexp(vsub(s[i][c], vset1(mnew))), idx, row[i], 0.f);
                vstore(p[i] + c * VL, e);
                sum = vadd(sum, e);
            }
            l[i] = l[i] * shrink[i] + vreduce_add(sum);
        }
        const int64_t keys = (int64_t)last + 1 - t0 < KT ? (int64_t)last + 1 - t0 : KT;
        for (int64_t d0 = 0; d0 < D; d0 += 4 * VL) {
            const int nv = D - d0 >= 4 * VL ? 4 : (int)((D - d0) / VL);
            vec o[QB][4];
            for (int i = 0; i < QB; i++)
                for (int c = 0; c < nv; c++) o[i][c] = vmul(vload_f32(out_f[i] + d0 + c * VL), vset1(shrink[i]));
            for (int64_t j = 0; j < keys; j++) {
                const float *vrow = vw + (t0 + j) * D + d0;
                for (int c = 0; c < nv; c++) {
                    const vec vv = vload_f32(vrow + c * VL);
                    for (int i = 0; i < QB; i++) o[i][c] = vfma(vbcast(p[i] + j), vv, o[i][c]);
                }
            }
            for (int i = 0; i < QB; i++)
                for (int c = 0; c < nv; c++) vstore(out_f[i] + d0 + c * VL, o[i][c]);
        }
    }
    for (int i = 0; i < QB; i++) {
        const float inv = 1.f / l[i];
        for (int64_t d = 0; d < D; d++) out_f[i][d] *= inv;
    }
}

#ifdef __AVX512BF16__
#include "causal_attention_pairs.h"
#endif
#ifdef __AMX_BF16__
#include "causal_attention_amx.h"
#endif

/* The prompt's T queries after `ctx` earlier keys: query row r sits at position ctx + r and sees keys 0..ctx + r
 * of the S = ctx + T in K. */
static void attention(const void *q, int64_t sq, const Keys *K, void *out, int64_t T, int64_t ctx, int64_t hq,
                      int64_t hkv, int64_t D, float scale, int bf16, float *scratch, int64_t threads) {
#ifdef __AMX_BF16__
    if (bf16 && attention_amx_takes(D)) {
        amx_attention(q, sq, K, out, T, ctx, hq, hkv, D, scale, scratch, threads);
        return;
    }
#endif
#ifdef __AVX512BF16__
    if (bf16 && pairs_takes(D)) {
        pairs_attention(q, sq, K, out, T, ctx, hq, hkv, D, scale, scratch, threads);
        return;
    }
#endif
    const int64_t S = ctx + T, tpad = (S + KT - 1) / KT * KT, G = hq / hkv;
    float *qs = scratch, *kt = qs + T * hq * D, *vw = kt + hkv * D * tpad;
    prepare(q, sq, K, T, S, hq, hkv, D, tpad, scale, bf16, qs, kt, vw, threads);
    const int64_t tiles = (T + QT - 1) / QT;
    /* Later row tiles attend over more keys: the largest go first so the threads finish together. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1)
    for (int64_t task = 0; task < tiles * hkv; task++) {
        const int64_t tile = tiles - 1 - task / hkv, h = task % hkv;
        const int64_t r0 = tile * QT, r1 = r0 + QT < T ? r0 + QT : T, vectors = (r1 - r0) * G;
        float out_f[QB][MAX_DIM];
        for (int64_t first = 0; first < vectors; first += QB) {
            const float *qv[QB];
            float row[QB];
            int64_t where[QB]; /* element offset of each vector's output */
            for (int i = 0; i < QB; i++) {
                const int64_t n = first + i < vectors ? first + i : vectors - 1;
                const int64_t r = r0 + n / G, head = h * G + n % G;
                qv[i] = qs + (r * hq + head) * D;
                row[i] = (float)(ctx + r);
                where[i] = (r * hq + head) * D;
            }
            attend(qv, row, kt + h * D * tpad, vw + h * tpad * D, D, tpad, out_f);
            for (int i = 0; i < QB && first + i < vectors; i++)
                for (int64_t d = 0; d < D; d++) {
                    if (bf16) ((uint16_t *)out)[where[i] + d] = narrow1_bf16(out_f[i][d]);
                    else ((float *)out)[where[i] + d] = out_f[i][d];
                }
        }
    }
}

/* q [T, Hq, D] (row stride sq), k and v [T, Hkv, D] (row strides sk, sv), out [T, Hq, D] contiguous; all fp32
 * (bf16 = 0) or all bf16 (bf16 = 1). D % VL == 0, D <= MAX_DIM, Hq % Hkv == 0 (the caller checks). scratch:
 * floats for qs, kt and vw: T * Hq * D + 2 * Hkv * D * tpad, tpad = T rounded up to KT
 * (hearth_causal_attention_tile() gives KT). */
void hearth_causal_attention(const void *q, const void *k, const void *v, void *out, int64_t sq, int64_t sk,
                             int64_t sv, int64_t T, int64_t hq, int64_t hkv, int64_t D, float scale, int64_t bf16,
                             float *scratch, int64_t threads) {
    const Keys K = {k, v, sk, sv, NULL, 0, 0};
    attention(q, sq, &K, out, T, 0, hq, hkv, D, scale, (int)bf16, scratch, threads);
}

/* The next T tokens of a prompt whose first ctx tokens are already in the paged KV pool, with the T new keys and
 * values written there too: entry t of every kv head's blocks (table [Hkv, W], caches [N, B, D]) holds position
 * t, for t < ctx + T (the caller checks: nothing evicted). The rest as hearth_causal_attention, with tpad =
 * ctx + T rounded up to KT. */
void hearth_prefill_attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *table,
                              void *out, int64_t sq, int64_t width, int64_t block, int64_t T, int64_t ctx, int64_t hq,
                              int64_t hkv, int64_t D, float scale, int64_t bf16, float *scratch, int64_t threads) {
    const Keys K = {k_cache, v_cache, 0, 0, table, width, block};
    attention(q, sq, &K, out, T, ctx, hq, hkv, D, scale, (int)bf16, scratch, threads);
}

int64_t hearth_causal_attention_tile(void) { return KT; }

/* Whether bf16 prompts of this head_dim multiply bf16 pairs here, on AMX tiles (causal_attention_amx.h) or by
 * AVX-512 BF16 dot products (causal_attention_pairs.h): the probabilities rounded to bf16 for the value product, as
 * torch's own bf16 attention rounds them. */
int64_t hearth_causal_attention_pairs(int64_t D) {
#ifdef __AMX_BF16__
    if (attention_amx_takes(D)) return 1;
#endif
#ifdef __AVX512BF16__
    return pairs_takes(D);
#else
    (void)D;
    return 0;
#endif
}
