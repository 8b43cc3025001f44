/* Decode attention over the paged KV pool in fp32, read in place: the CPU sibling of the Triton decode kernel.
 *
 * The torch reference gathers each sequence's blocks into a contiguous copy, then runs SDPA over it: the KV
 * cache is read, written and read again. With many sequences decoding, the cache read per step is as large as
 * the weights, so those copies cost as much as the matmuls. Here each (sequence, kv-head) pair walks its block
 * table once, block by block: scores of the block's entries for every query head of the group, one rescale
 * of the running output per block (online softmax), then the values. Masking is by stored position, as in
 * kernels/paged_attention.py: entries past kv_len, after the query's position, or outside a sliding window
 * are skipped, so compressed heads (entries dropped) are served too.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define MAX_BLOCK 64
#define MAX_GROUP_DIM 4096 /* query heads per kv head x head_dim the stack buffers hold */

/* exp(x) for x <= 0 (scores minus their running max), 8 at a time: 2^(x log2 e) split into an integer
 * power (exponent bits) and a degree-6 polynomial of the fraction; relative error about 2e-7. */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 fi = _mm256_floor_ps(t);
    __m256 f = _mm256_sub_ps(t, fi);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

/* q [B, Hq, D]; k_cache, v_cache [NB, BS, D]; pos_cache [NB, BS] int32; tables [B, Hkv, W] int64;
 * kv_lens [B, Hkv] int32; q_pos [B] int64; out [B, Hq, D]. window <= 0: none; softcap <= 0: none.
 * D % 8 == 0, BS <= MAX_BLOCK, (Hq / Hkv) * D <= MAX_GROUP_DIM (the caller checks). */
void hearth_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *pos_cache,
                             const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, float *out,
                             int64_t batch, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t width, float scale, int64_t window, float softcap,
                             int64_t threads) {
    const int64_t groups = num_q_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : 1)
    for (int64_t pair = 0; pair < batch * num_kv_heads; pair++) {
        const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
        const int64_t *table = tables + pair * width;
        const int64_t len = kv_lens[pair], qp = q_pos[b];
        const float *qh = q + (b * num_q_heads + h * groups) * head_dim;
        float acc[MAX_GROUP_DIM], run_max[64], run_sum[64], scores[64 * MAX_BLOCK];
        int64_t keep[MAX_BLOCK];
        for (int64_t i = 0; i < groups * head_dim; i++) acc[i] = 0.f;
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
            const float *kb = k_cache + blk * block_size * head_dim, *vb = v_cache + blk * block_size * head_dim;
            for (int64_t g = 0; g < groups; g++) {
                float *s = scores + g * MAX_BLOCK, m = run_max[g];
                for (int64_t j = 0; j < kept; j++) {
                    float x = dot(qh + g * head_dim, kb + keep[j] * head_dim, head_dim) * scale;
                    if (softcap > 0.f) x = tanhf(x / softcap) * softcap;
                    s[j] = x;
                    if (x > m) m = x;
                }
                /* The running output and sum shrink by exp(old max - new max), once per block. */
                float shrink = run_max[g] == -INFINITY ? 0.f : expf(run_max[g] - m);
                run_max[g] = m;
                int64_t j = 0;
                for (; j + 8 <= kept; j += 8)
                    _mm256_storeu_ps(s + j, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m))));
                for (; j < kept; j++) s[j] = expf(s[j] - m);
                float total = 0.f;
                for (j = 0; j < kept; j++) total += s[j];
                run_sum[g] = run_sum[g] * shrink + total;
                float *a = acc + g * head_dim;
                for (int64_t d = 0; d < head_dim; d += 8) {
                    __m256 o = _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_set1_ps(shrink));
                    for (j = 0; j < kept; j++)
                        o = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_loadu_ps(vb + keep[j] * head_dim + d), o);
                    _mm256_storeu_ps(a + d, o);
                }
            }
        }
        float *oh = out + (b * num_q_heads + h * groups) * head_dim;
        for (int64_t g = 0; g < groups; g++) {
            float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
            for (int64_t d = 0; d < head_dim; d++) oh[g * head_dim + d] = acc[g * head_dim + d] * inv;
        }
    }
}
