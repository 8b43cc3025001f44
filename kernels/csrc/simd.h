/* Helpers shared by the CPU kernels (AVX2 + FMA). */
#ifndef HEARTH_SIMD_H
#define HEARTH_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Before an AMX tile load (or tile configuration) from a buffer the code just filled with ordinary stores: GCC's
 * _tile_loadd is an asm statement that does not say it reads memory (its _tile_stored says it writes), and its
 * _tile_loadconfig says it reads 8 bytes, so without this compiler barrier those stores may be dropped as dead or
 * moved past the load (seen at -O3 in a trial kernel: a buffer filled for a tile load read as zeros, and a tile
 * load faulting after a configuration whose stores the compiler had dropped). */
#define TILE_LOADS_SEE_STORES() __asm__ __volatile__("" ::: "memory")

/* The sum of a vector's eight lanes. */
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp(x), eight lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by Cephes'
 * degree-5 polynomial, 2^n through the exponent bits; relative error about 1e-7. x is clamped to [-87, 88],
 * where the result is a normal float. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

/* One bf16 value widened to fp32, and one fp32 value rounded to bf16 as torch's .to(bfloat16) does (nearest
 * even; NaN stays NaN). */
static inline float widen1_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t narrow1_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    return (v.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((v.u >> 16) | 0x40)
                                             : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Eight bf16 values widened to fp32. */
static inline __m256 widen8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight fp32 lanes -> bf16 bits, round to nearest even as torch's .to(bfloat16) (NaN stays NaN). */
static inline __m128i narrow8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* pack the low 16 bits of each lane: lanes 0-3 and 4-7 sit in the two 128-bit halves */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

/* v rounded to bf16 and widened back: what a bf16 torch op's result holds. */
static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow8_bf16(v)), 16));
}

#ifdef __AVX512F__
/* exp8, sixteen lanes: the same steps, so each lane's result is exp8's bit for bit. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

/* widen8_bf16 and narrow8_bf16, sixteen lanes (the same rounding: nearest even, NaN stays NaN). Where the CPU has
 * AVX-512 BF16, its one conversion instruction: the same bits, except that it flushes fp32 values below 2^-126
 * (denormals) to zero, as oneDNN's bf16 products (which use it) do. A third of a 32 x 32 block's time went to the
 * eleven-instruction sequence below in the AMX GEMM's epilogue at k = 576 (docs/benchmarks.md). */
static inline __m512 widen16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m256i narrow16_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
#endif
}

static inline __m512 round16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16_bf16(v)), 16));
}
#endif

/* silu(g) = g / (1 + exp(-g)), eight lanes (fused.c's SiLU * up, gemm.c's gate/up products). */
static inline __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

#ifdef __AVX512F__
static inline __m512 silu16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
#endif

/* The widest fp32 vector this build has (VL lanes: 16 with AVX-512, 8 with AVX2), for kernels written once for
 * both: zero, load, broadcast, multiply-add, add, store, multiply, SiLU. */
#ifdef __AVX512F__
#define VL 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vbcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vsilu(vec g) { return silu16(g); }
#else
#define VL 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vbcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vsilu(vec g) { return silu8(g); }
#endif

#ifdef __AVX512BF16__
/* x[0], x[1] (bf16) in every 32-bit lane: the pair of x an AVX-512 BF16 dot product multiplies by each output's
 * pair of weights. */
static inline __m512bh vbcast_pair_bf16(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}
#endif

#endif
