/* One register tile of gemm.c: MR rows of x times one block of BW outputs over all of k, its sums kept in
 * registers from the first step to the epilogue (gemm.c's opening comment says why that shape), and its epilogues:
 * the bias, the rounding and store, or SiLU * up of a gate block and its up block. How rows and blocks are dealt to
 * the tiles, and the entry points, are gemm.c's; it includes this after its NB, BW, MR and kinds. */
#ifndef HEARTH_GEMM_TILES_H
#define HEARTH_GEMM_TILES_H

/* acc[r][v] += (vector v of step i of the block) * (step i of row r of x), for a tile's M rows. */
static inline __attribute__((always_inline)) void step(int kind, int M, vec acc[MR][NB], const void *block,
                                                        int64_t i, const void *x, int64_t k) {
#ifdef __AVX512BF16__
    if (kind != F32) {
        const uint16_t *w = (const uint16_t *)block + i * BW * 2;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 2 * VL);
        _Pragma("GCC unroll 12") for (int r = 0; r < M; r++) {
            const __m512bh xr = vbcast_pair_bf16((const uint16_t *)x + r * k + 2 * i);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
        }
        return;
    }
#endif
    const float *w = (const float *)block + i * BW;
    const vec w0 = vload_f32(w), w1 = vload_f32(w + VL);
    _Pragma("GCC unroll 12") for (int r = 0; r < M; r++) {
        const vec xr = vbcast((const float *)x + r * k + i);
        acc[r][0] = vfma(w0, xr, acc[r][0]);
        acc[r][1] = vfma(w1, xr, acc[r][1]);
    }
}

/* Lines of a block to fetch into cache ahead of its use, `lines` (1 or 2) a step until `end`; lines 0: none. (T0:
 * into L1 as well, which measured 1-10% ahead of L2 alone at 24-96 rows of bf16.) */
typedef struct {
    const char *at, *end;
    int64_t lines;
} prefetch;

static inline __attribute__((always_inline)) void fetch_ahead(prefetch *pf) {
    if (pf->at < pf->end) {
        _mm_prefetch(pf->at, _MM_HINT_T0);
        if (pf->lines > 1) _mm_prefetch(pf->at + 64, _MM_HINT_T0);
        pf->at += 64 * pf->lines;
    }
}

#ifdef __AVX512BF16__
/* Half `half` (0: values 0-15, 1: values 16-31) of 32 bf16 values, widened to fp32. */
static inline __m512 widen_half_bf16(__m512i v, int half) {
    const __m256i h = half ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* One row's BW sums plus the bias, stored in y's dtype; width is how many of the block's outputs exist (the
 * last block may be partial). The bf16 kinds load, round and store through masks and registers only: with a
 * stack buffer and a memcpy for the partial block here, GCC kept the register tile's sums on the stack in every
 * tile of the inlined kernels, fp32 ones included (products 2.3x slower on an AVX-512 EPYC; docs/benchmarks.md). */
static inline __attribute__((always_inline)) void store_row(int kind, const vec sums[NB], const void *b, void *y,
                                                             int64_t width) {
#ifdef __AVX512BF16__
    if (kind != F32) {
        const __mmask32 keep = width == BW ? ~(__mmask32)0 : (__mmask32)((1u << width) - 1);
        vec lo = sums[0], hi = sums[1];
        if (b) {
            const __m512i bias = _mm512_maskz_loadu_epi16(keep, b);
            lo = vadd(lo, widen_half_bf16(bias, 0));
            hi = vadd(hi, widen_half_bf16(bias, 1));
        }
        /* both vectors rounded by one instruction (simd.h's narrow16_bf16) */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        if (kind == BF16_WIDE) { /* each bf16 value widened back */
            _mm512_mask_storeu_ps(y, (__mmask16)keep, widen_half_bf16(both, 0));
            _mm512_mask_storeu_ps((float *)y + VL, (__mmask16)(keep >> 16), widen_half_bf16(both, 1));
            return;
        }
        _mm512_mask_storeu_epi16(y, keep, both);
        return;
    }
#endif
    float row[BW];
    vstore(row, sums[0]);
    vstore(row + VL, sums[1]);
    const float *bf = (const float *)b;
    if (width == BW) {
        vstore((float *)y, b ? vadd(sums[0], vload_f32(bf)) : sums[0]);
        vstore((float *)y + VL, b ? vadd(sums[1], vload_f32(bf + VL)) : sums[1]);
        return;
    }
    for (int64_t c = 0; c < width; c++) ((float *)y)[c] = row[c] + (b ? bf[c] : 0.f);
}

/* The sums of rows [0, M) of x (row stride k elements) times one block over all k, into acc. M is a constant once
 * inlined, so the sums live in registers. */
static inline __attribute__((always_inline)) void tile_sums(int kind, int M, const void *x, int64_t k,
                                                            const void *block, prefetch *pf, vec acc[MR][NB]) {
    const int64_t steps = kind == F32 ? k : k / 2;
    _Pragma("GCC unroll 12") for (int r = 0; r < M; r++) {
        acc[r][0] = vzero();
        acc[r][1] = vzero();
    }
    if (pf->lines == 0)
        for (int64_t i = 0; i < steps; i++) step(kind, M, acc, block, i, x, k);
    else
        for (int64_t i = 0; i < steps; i++) {
            step(kind, M, acc, block, i, x, k);
            fetch_ahead(pf);
        }
}

/* Rows [0, M) of x times one block, stored in y (rows of stride n). */
static inline __attribute__((always_inline)) void tile(int kind, int M, const void *x, int64_t k, const void *block,
                                                        const void *b, void *y, int64_t n, int64_t width,
                                                        prefetch *pf) {
    const int64_t out = kind == BF16_PAIRS ? 2 : 4; /* bytes per output */
    vec acc[MR][NB];
    tile_sums(kind, M, x, k, block, pf, acc);
    _Pragma("GCC unroll 12") for (int r = 0; r < M; r++) store_row(kind, acc[r], b, (char *)y + r * n * out, width);
}

/* One row of silu(gate) * up for one block's BW outputs: g the gate sums (fp32), up the up sums. In bf16 each of
 * gate, up and silu(gate) is rounded as the separate product and fused.c's SiLU * up round them, so the result is
 * theirs bit for bit; fp32 has nothing to round. */
static inline __attribute__((always_inline)) void store_silu_row(int kind, const float g[BW], const vec up[NB],
                                                                  const void *b_gate, const void *b_up, void *row) {
    for (int v = 0; v < NB; v++) {
        vec gv = vload_f32(g + v * VL), uv = up[v];
#ifdef __AVX512BF16__
        if (kind == BF16_PAIRS) {
            const uint16_t *bg = (const uint16_t *)b_gate, *bu = (const uint16_t *)b_up;
            gv = round16_bf16(bg ? vadd(gv, widen16_bf16(bg + v * VL)) : gv);
            uv = round16_bf16(bu ? vadd(uv, widen16_bf16(bu + v * VL)) : uv);
            _mm256_storeu_si256((__m256i *)((uint16_t *)row + v * VL),
                                narrow16_bf16(vmul(round16_bf16(vsilu(gv)), uv)));
            continue;
        }
#endif
        if (b_gate) gv = vadd(gv, vload_f32((const float *)b_gate + v * VL));
        if (b_up) uv = vadd(uv, vload_f32((const float *)b_up + v * VL));
        vstore((float *)row + v * VL, vmul(vsilu(gv), uv));
    }
}

/* y = silu(gate) * up for rows [0, M) and one block's BW outputs of each half of a fused gate/up weight: the gate
 * block's sums wait in an L1-resident buffer while the up block's are computed, then both meet in registers.
 * pf_gate and pf_up: what each half prefetches. */
static inline __attribute__((always_inline)) void tile_silu(int kind, int M, const void *x, int64_t k,
                                                             const void *gate, const void *up, const void *b_gate,
                                                             const void *b_up, void *y, int64_t n, prefetch *pf_gate,
                                                             prefetch *pf_up) {
    const int64_t size = kind == F32 ? 4 : 2;
    vec acc[MR][NB];
    float g[MR][BW];
    tile_sums(kind, M, x, k, gate, pf_gate, acc);
    _Pragma("GCC unroll 12") for (int r = 0; r < M; r++) {
        vstore(g[r], acc[r][0]);
        vstore(g[r] + VL, acc[r][1]);
    }
    tile_sums(kind, M, x, k, up, pf_up, acc);
    _Pragma("GCC unroll 12") for (int r = 0; r < M; r++)
        store_silu_row(kind, g[r], acc[r], b_gate, b_up, (char *)y + r * n * size);
}

/* A tile of M rows, M in [1, MR] known only at run time: one inlined copy per height. */
static inline __attribute__((always_inline)) void tile_of(int kind, int64_t M, const void *x, int64_t k,
                                                           const void *block, const void *b, void *y, int64_t n,
                                                           int64_t width, prefetch *pf) {
    switch (M) {
#if MR == 12
    case 12: tile(kind, 12, x, k, block, b, y, n, width, pf); break;
    case 11: tile(kind, 11, x, k, block, b, y, n, width, pf); break;
    case 10: tile(kind, 10, x, k, block, b, y, n, width, pf); break;
    case 9: tile(kind, 9, x, k, block, b, y, n, width, pf); break;
    case 8: tile(kind, 8, x, k, block, b, y, n, width, pf); break;
    case 7: tile(kind, 7, x, k, block, b, y, n, width, pf); break;
#endif
    case 6: tile(kind, 6, x, k, block, b, y, n, width, pf); break;
    case 5: tile(kind, 5, x, k, block, b, y, n, width, pf); break;
    case 4: tile(kind, 4, x, k, block, b, y, n, width, pf); break;
    case 3: tile(kind, 3, x, k, block, b, y, n, width, pf); break;
    case 2: tile(kind, 2, x, k, block, b, y, n, width, pf); break;
    case 1: tile(kind, 1, x, k, block, b, y, n, width, pf); break;
    default: break;
    }
}

#endif
