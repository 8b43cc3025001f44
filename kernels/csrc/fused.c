/* Small per-layer steps of the decoder, fused: rotary embedding + KV-cache write, and SiLU(gate) * up.
 *
 * At decode each of these is a handful of torch ops over a few hundred numbers per layer (views, two muls, a
 * cat, a negation, three index_copy_ calls...), microseconds of dispatch each for nanoseconds of arithmetic;
 * with the weights streamed at memory speed they were a fifth of a single stream's step. One call each does
 * the same arithmetic in the same order and rounding as the torch ops (products and sums rounded separately,
 * never contracted into FMAs; bf16 results rounded after every op, as torch does), so the results are the
 * torch path's bit for bit, except SiLU's exp (a polynomial of our own, not torch's: a few ulp apart).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline float f32_load(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline void f32_store(void *p, int64_t i, float x) { ((float *)p)[i] = x; }
static inline float f32_round(float x) { return x; }

static inline float bf16_load(const void *p, int64_t i) {
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 bits, round to nearest even (as torch's .to(bfloat16)); NaN stays NaN. */
static inline uint16_t bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                           : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void bf16_store(void *p, int64_t i, float x) { ((uint16_t *)p)[i] = bf16_bits(x); }

/* x rounded to bf16 and widened back: what a bf16 torch op's intermediate result holds. */
static inline float bf16_round(float x) {
    uint32_t u = (uint32_t)bf16_bits(x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Rotate one head of `dim` channels in place (rotate-half convention): x * cos + rotate_half(x) * sin. */
#define ROTATE_HEAD(LOAD, STORE, ROUND)                                                                       \
    do {                                                                                                      \
        const int64_t half = dim / 2;                                                                         \
        for (int64_t i = 0; i < half; i++) {                                                                  \
            const float a = LOAD(x, i), b = LOAD(x, i + half);                                                \
            const float lo = ROUND(ROUND(a * LOAD(c, i)) + ROUND(-b * LOAD(s, i)));                           \
            const float hi = ROUND(ROUND(b * LOAD(c, i + half)) + ROUND(a * LOAD(s, i + half)));               \
            STORE(x, i, lo);                                                                                  \
            STORE(x, i + half, hi);                                                                           \
        }                                                                                                     \
    } while (0)

/* qk [T, Hq + Hkv, D] rows `qk_stride` elements apart (query heads, then key heads) are rotated in place by
 * the rows of cos/sin [max_pos, D] at positions [T]; then each token's rotated key and its value (v [T, Hkv, D],
 * rows `v_stride` apart) go to the flat slot slots[h * T + t] of k_cache/v_cache [*, D], and its position to
 * pos_cache [*] (int32). ELEM is the element size in bytes. */
#define ROPE_WRITE_KV(LOAD, STORE, ROUND, ELEM)                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(tokens * (hq + hkv) * dim >= 65536 ? threads : 1)") \
    for (int64_t t = 0; t < tokens; t++) {                                                                    \
        const char *c = (const char *)cos_table + positions[t] * dim * ELEM;                                  \
        const char *s = (const char *)sin_table + positions[t] * dim * ELEM;                                  \
        for (int64_t h = 0; h < hq + hkv; h++) {                                                              \
            char *x = (char *)qk + (t * qk_stride + h * dim) * ELEM;                                          \
            ROTATE_HEAD(LOAD, STORE, ROUND);                                                                  \
        }                                                                                                     \
        for (int64_t h = 0; h < hkv; h++) {                                                                   \
            const int64_t slot = slots[h * tokens + t];                                                       \
            memcpy((char *)k_cache + slot * dim * ELEM, (const char *)qk + (t * qk_stride + (hq + h) * dim) * ELEM, \
                   dim * ELEM);                                                                               \
            memcpy((char *)v_cache + slot * dim * ELEM, (const char *)v + (t * v_stride + h * dim) * ELEM,     \
                   dim * ELEM);                                                                               \
            pos_cache[slot] = (int32_t)positions[t];                                                          \
        }                                                                                                     \
    }

/* Products and sums are rounded one by one, as torch's separate mul and add kernels round them. */
__attribute__((optimize("fp-contract=off"))) void hearth_rope_write_kv_f32(
    float *qk, int64_t qk_stride, const float *v, int64_t v_stride, const float *cos_table, const float *sin_table,
    const int64_t *positions, const int64_t *slots, float *k_cache, float *v_cache, int32_t *pos_cache,
    int64_t tokens, int64_t hq, int64_t hkv, int64_t dim, int64_t threads) {
    ROPE_WRITE_KV(f32_load, f32_store, f32_round, 4)
}

__attribute__((optimize("fp-contract=off"))) void hearth_rope_write_kv_bf16(
    uint16_t *qk, int64_t qk_stride, const uint16_t *v, int64_t v_stride, const uint16_t *cos_table,
    const uint16_t *sin_table, const int64_t *positions, const int64_t *slots, uint16_t *k_cache,
    uint16_t *v_cache, int32_t *pos_cache, int64_t tokens, int64_t hq, int64_t hkv, int64_t dim, int64_t threads) {
    ROPE_WRITE_KV(bf16_load, bf16_store, bf16_round, 2)
}

/* Elements (rows x intermediate) from which the threads share the work. Measured on 2 cores (AVX-512 build,
 * intermediate 1536): 11 rows take 13.8 us in one thread and 8.8 in two (bf16), 6.3 and 4.6 (fp32); a single
 * decode row (1536) stays on one thread, where waking the other would cost more than its share. */
#define SILU_PARALLEL_FROM 16384

/* out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first); I % 8 == 0. bf16: the activation is rounded
 * before the product, as torch's two ops round. Sixteen lanes at a time where the build has AVX-512 (the same
 * arithmetic per lane as the eight-lane loop, which takes what is left). */
void hearth_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(rows * inter >= SILU_PARALLEL_FROM && threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
        for (; i < inter; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
    }
}

void hearth_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(rows * inter >= SILU_PARALLEL_FROM && threads > 0 ? threads : 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inter; i += 16) {
            __m512 act = round16_bf16(silu16(widen16_bf16(g + i)));
            _mm256_storeu_si256((__m256i *)(o + i), narrow16_bf16(_mm512_mul_ps(act, widen16_bf16(u + i))));
        }
#endif
        for (; i < inter; i += 8) {
            __m256 act = round8_bf16(silu8(widen8_bf16(g + i)));
            _mm_storeu_si128((__m128i *)(o + i), narrow8_bf16(_mm256_mul_ps(act, widen8_bf16(u + i))));
        }
    }
}
