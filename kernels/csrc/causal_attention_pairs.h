/* causal_attention.c's bf16 prompt attention multiplied in bf16 pairs: the layouts both pair paths read (AMX tiles,
 * causal_attention_amx.h, and the AVX-512 BF16 dot products here), and the dot-product path itself, for CPUs with
 * AVX-512 BF16 but no tiles (AMD Zen 4 and 5, Intel Cooper Lake) or where the tiles are not permitted. Included by
 * causal_attention.c only, in builds with AVX-512 BF16.
 *
 * Why: the fp32 path widens bf16 and multiplies on fp32 lanes; a dot product multiplies a pair of bf16 values per
 * fp32 lane (products exact in fp32), twice the work an instruction. On a Zen 4 VM the fp32 path ran a 165-token
 * SmolLM2 prompt at 89 GFLOP/s of a ~450 peak and prompt attention was 6% of a 32-concurrent pass
 * (docs/benchmarks.md). As on the tiles, the scores are the bf16 query and keys' dot products, scaled after, and
 * the probabilities are rounded to bf16 for the value product, as torch's CPU flash attention rounds them;
 * masks, the online softmax and the running sums stay fp32 and each output is rounded once.
 *
 * Layouts (a dot product takes pairs: one 32-bit lane holds elements 2p and 2p + 1 of the reduced dimension):
 *  - keys as kt [Hkv][tpad / 16][D / 2][16] of 32-bit channel pairs: row p of a group is channels 2p, 2p + 1 of
 *    16 consecutive keys, one vector of sixteen keys' pairs, and a group is 1 KB in one piece;
 *  - values as vv [Hkv][tpad / 2][D] of 32-bit key pairs: row s is keys 2s, 2s + 1 of each channel, so a vector
 *    of it is sixteen channels' pairs, in channel order.
 * Register tiles (this file): PQ query vectors against 64 keys (PQ x 4 vectors of scores; each step of p loads
 * four key vectors and broadcasts each query's pair p), then PQ vectors x up to 64 channels of running outputs
 * (each step of s loads four value vectors and broadcasts each vector's probability pair s).
 */
#ifndef HEARTH_CAUSAL_ATTENTION_PAIRS_H
#define HEARTH_CAUSAL_ATTENTION_PAIRS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* The keys and values of K in the pair layouts (above), zero past S. Parallel over pairs of keys. */
static void pairs_prepare(const Keys *K, int64_t S, int64_t hkv, int64_t D, int64_t tpad, uint32_t *kt,
                          uint32_t *vv, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t s = 0; s < tpad / 2; s++) {
        for (int64_t h = 0; h < hkv; h++) {
            const uint16_t *kr[2], *vr[2];
            for (int e = 0; e < 2; e++) {
                const int64_t t = 2 * s + e;
                kr[e] = t < S ? (const uint16_t *)K->k + key_row(K, h, t, K->sk, D) : NULL;
                vr[e] = t < S ? (const uint16_t *)K->v + key_row(K, h, t, K->sv, D) : NULL;
                uint32_t *to = kt + ((h * (tpad / 16) + t / 16) * (D / 2)) * 16 + t % 16;
                for (int64_t p = 0; p < D / 2; p++)
                    to[p * 16] = kr[e] ? (uint32_t)kr[e][2 * p] | (uint32_t)kr[e][2 * p + 1] << 16 : 0u;
            }
            uint32_t *to = vv + (h * (tpad / 2) + s) * D;
            for (int64_t c = 0; c < D; c++)
                to[c] = (vr[0] ? vr[0][c] : 0u) | (uint32_t)(vr[1] ? vr[1][c] : 0u) << 16;
        }
    }
}

#ifdef __AVX512BF16__
#define PQ 6      /* query vectors per register tile: 6 x 4 sums, 4 loaded vectors and a broadcast of 32 registers */
#define PKEYS 64  /* keys per step of the walk: four vectors of scores per query vector */

static inline int pairs_takes(int64_t D) { return D % 16 == 0 && D <= MAX_DIM; }

/* o[i][c0 + 16 c] += sum over the key pairs s < pairs of pb[i] pair s times row s of vv, for nv (1-4, a
 * constant once inlined) vectors of channels from c0; o starts as the running output times shrink[i]. */
static inline __attribute__((always_inline)) void pairs_values(int nv, const uint16_t pb[PQ][PKEYS],
                                                                const uint32_t *vv, int64_t pairs, int64_t D,
                                                                int64_t c0, const float shrink[PQ],
                                                                float out_f[PQ][MAX_DIM]) {
    __m512 o[PQ][4];
    for (int i = 0; i < PQ; i++)
        for (int c = 0; c < nv; c++)
            o[i][c] = _mm512_mul_ps(_mm512_loadu_ps(out_f[i] + c0 + 16 * c), _mm512_set1_ps(shrink[i]));
    for (int64_t s = 0; s < pairs; s++) {
        __m512bh v[4];
        for (int c = 0; c < nv; c++) v[c] = (__m512bh)_mm512_loadu_si512(vv + s * D + c0 + 16 * c);
        for (int i = 0; i < PQ; i++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)pb[i])[s]);
            for (int c = 0; c < nv; c++) o[i][c] = _mm512_dpbf16_ps(o[i][c], w, v[c]);
        }
    }
    for (int i = 0; i < PQ; i++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(out_f[i] + c0 + 16 * c, o[i][c]);
}

/* PQ query vectors of one kv head (qv[i]: D bf16 values, unscaled; row[i]: its position) against that head's kt
 * and vv: out_f[i] gets the attention output, normalised. */
static void pairs_attend(const uint16_t *const qv[PQ], const float row[PQ], const uint32_t *kt, const uint32_t *vv,
                         int64_t D, float scale, float out_f[PQ][MAX_DIM]) {
    float m[PQ], l[PQ], shrink[PQ], last = row[0];
    _Alignas(64) uint16_t pb[PQ][PKEYS];
    for (int i = 0; i < PQ; i++) {
        m[i] = -INFINITY;
        l[i] = 0.f;
        memset(out_f[i], 0, sizeof(float) * (size_t)D);
        last = row[i] > last ? row[i] : last;
    }
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t group = (D / 2) * 16; /* u32 per group of 16 keys */
    for (int64_t t0 = 0; t0 <= (int64_t)last; t0 += PKEYS) {
        __m512 s[PQ][4];
        for (int i = 0; i < PQ; i++)
            for (int c = 0; c < 4; c++) s[i][c] = _mm512_setzero_ps();
        const uint32_t *k = kt + (t0 / 16) * group;
        for (int64_t p = 0; p < D / 2; p++) {
            __m512bh kv[4];
            for (int c = 0; c < 4; c++) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * group + p * 16);
            for (int i = 0; i < PQ; i++) {
                const __m512bh q = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)qv[i])[p]);
                for (int c = 0; c < 4; c++) s[i][c] = _mm512_dpbf16_ps(s[i][c], q, kv[c]);
            }
        }
        for (int i = 0; i < PQ; i++) { /* scale, mask past the vector's row, online softmax; P rounded to bf16 */
            __m512 mx = _mm512_set1_ps(-INFINITY);
            __mmask16 live[4];
            for (int c = 0; c < 4; c++) {
                const __m512 idx = _mm512_add_ps(lanes, _mm512_set1_ps((float)(t0 + 16 * c)));
                live[c] = _mm512_cmp_ps_mask(idx, _mm512_set1_ps(row[i]), _CMP_LE_OQ);
                s[i][c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live[c], s[i][c], _mm512_set1_ps(scale));
                mx = _mm512_max_ps(mx, s[i][c]);
            }
            /* finite: every vector sees key 0, so m is finite after the first step and later steps may be all
             * masked */
            const float mnew = fmaxf(m[i], _mm512_reduce_max_ps(mx));
            shrink[i] = m[i] == -INFINITY ? 0.f : expf(m[i] - mnew);
            m[i] = mnew;
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                const __m512 e = _mm512_maskz_mov_ps(live[c], exp16(_mm512_sub_ps(s[i][c], _mm512_set1_ps(mnew))));
                sum = _mm512_add_ps(sum, e);
                _mm256_storeu_si256((__m256i *)(pb[i] + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
            }
            l[i] = l[i] * shrink[i] + _mm512_reduce_add_ps(sum);
        }
        /* past the last live key of the step every probability is zero, so an odd last key's partner adds 0 */
        const int64_t keys = (int64_t)last + 1 - t0 < PKEYS ? (int64_t)last + 1 - t0 : PKEYS;
        const int64_t pairs = (keys + 1) / 2;
        const uint32_t *v = vv + (t0 / 2) * D;
        for (int64_t c0 = 0; c0 < D; c0 += 64) {
            const int64_t nv = D - c0 >= 64 ? 4 : (D - c0) / 16;
            if (nv == 4) pairs_values(4, pb, v, pairs, D, c0, shrink, out_f);
            else if (nv == 3) pairs_values(3, pb, v, pairs, D, c0, shrink, out_f);
            else if (nv == 2) pairs_values(2, pb, v, pairs, D, c0, shrink, out_f);
            else pairs_values(1, pb, v, pairs, D, c0, shrink, out_f);
        }
    }
    for (int i = 0; i < PQ; i++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[i]);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(out_f[i] + d, _mm512_mul_ps(_mm512_loadu_ps(out_f[i] + d), inv));
    }
}

/* causal_attention.c's attention() in bf16 pairs: bf16 q (row stride sq), keys, values and out; scratch as there
 * (its floats hold kt and vv, 4 * Hkv * D * tpad bytes together). Tasks as the fp32 path deals them. */
static void pairs_attention(const uint16_t *q, int64_t sq, const Keys *K, uint16_t *out, int64_t T, int64_t ctx,
                            int64_t hq, int64_t hkv, int64_t D, float scale, float *scratch, int64_t threads) {
    const int64_t S = ctx + T, tpad = (S + KT - 1) / KT * KT, G = hq / hkv, tiles = (T + QT - 1) / QT;
    uint32_t *kt = (uint32_t *)scratch, *vv = kt + hkv * (D / 2) * tpad;
    pairs_prepare(K, S, hkv, D, tpad, kt, vv, threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1)
    for (int64_t task = 0; task < tiles * hkv; task++) {
        const int64_t tile = tiles - 1 - task / hkv, h = task % hkv; /* largest first, as the fp32 path */
        const int64_t r0 = tile * QT, r1 = r0 + QT < T ? r0 + QT : T, vectors = (r1 - r0) * G;
        float out_f[PQ][MAX_DIM];
        for (int64_t first = 0; first < vectors; first += PQ) {
            const uint16_t *qv[PQ];
            float row[PQ];
            int64_t to[PQ];
            for (int i = 0; i < PQ; i++) { /* past the last vector: repeats of it, dropped */
                const int64_t n = first + i < vectors ? first + i : vectors - 1;
                const int64_t r = r0 + n / G, head = h * G + n % G;
                qv[i] = q + r * sq + head * D;
                row[i] = (float)(ctx + r);
                to[i] = (r * hq + head) * D;
            }
            pairs_attend(qv, row, kt + h * (D / 2) * tpad, vv + h * (tpad / 2) * D, D, scale, out_f);
            for (int i = 0; i < PQ && first + i < vectors; i++)
                for (int64_t d = 0; d < D; d += 8)
                    _mm_storeu_si128((__m128i *)(out + to[i] + d), narrow8_bf16(_mm256_loadu_ps(out_f[i] + d)));
        }
    }
}
#endif /* __AVX512BF16__ */
#endif /* HEARTH_CAUSAL_ATTENTION_PAIRS_H */
