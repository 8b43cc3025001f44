/* One decoder layer of a decode step (one token per sequence) as a single call: the sequence of the other
 * kernels' entry points that the decoder's Python forward would make, without going back to Python between them.
 *
 * At one token a layer is nine kernel calls. With the weights streaming at memory speed, what each call costs
 * around its work (ctypes argument conversion, torch allocations and views, the interpreter) added up to about
 * a fifth of a SmolLM2 token (docs/benchmarks.md); with 32 sequences decoding it is still a few milliseconds a
 * step. This file does no arithmetic of its own: it calls the same kernels (gemv.c, gemm.c, gemv_i8.c, norm.c,
 * fused.c, paged_decode.c, each its own library, reached through function pointers the Python side takes from
 * them) in the same order on the same buffers, so its results are the Python path's bit for bit.
 *
 * LoRA adapters ride along the same way: after each product an adapter changes, every adapter of the step adds
 * its rows' deltas with its packed products (kernels/lora.py) on the same entry points, as the Python
 * forward's lora_apply_packed does, instead of the two dozen torch ops a projection costs there.
 *
 * Prompt chunks too: a step's rows are its decodes, then each chunk's tokens, and the attention stage calls the
 * prompt kernels (causal_attention.c) per chunk as the forward does. In a step of prompts the Python forward
 * gave the interpreter lock up and took it back at each of a layer's dozen kernel calls, and a batch worker's
 * threads holding it meanwhile slowed those steps most (docs/benchmarks.md, "Batches").
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lora_side.h"
#include "simd.h"

/* How a matrix's product is computed: which entry point, and so which arguments it takes. */
enum { GEMV_F32 = 0, GEMV_BF16 = 1, I8_F32 = 2, I8_BF16 = 3, I8_PAIRS = 4 };

typedef void (*gemv_fn)(const void *x, const void *packed, const void *b, void *y, int64_t m, int64_t n, int64_t k,
                        int64_t threads);
typedef void (*gemv_widened_fn)(const void *x, const void *packed, const void *b, void *y, int64_t m, int64_t n,
                                int64_t k, int64_t threads, float *xf);
typedef void (*i8_fn)(const void *x, const void *packed, const float *scale, const void *b, void *y, int64_t m,
                      int64_t n, int64_t k, int64_t threads);
typedef void (*i8_widened_fn)(const void *x, const void *packed, const float *scale, const void *b, void *y,
                              int64_t m, int64_t n, int64_t k, int64_t threads, float *xf);
typedef void (*norm_fn)(void *h, const void *x, const void *w, void *out, int64_t rows, int64_t dim, float eps,
                        int64_t offset, int64_t threads);
typedef void (*rope_fn)(void *qk, int64_t qk_stride, const void *v, int64_t v_stride, const void *cos_table,
                        const void *sin_table, const int64_t *positions, const int64_t *slots, void *k_cache,
                        void *v_cache, int32_t *pos_cache, int64_t tokens, int64_t hq, int64_t hkv, int64_t dim,
                        int64_t threads);
typedef void (*attention_fn)(const void *q, const void *k_cache, const void *v_cache, const int32_t *pos_cache,
                             const int64_t *tables, const int32_t *kv_lens, const int64_t *q_pos, void *out,
                             int64_t batch, int64_t hq, int64_t hkv, int64_t head_dim, int64_t block_size,
                             int64_t width, float scale, int64_t window, float softcap, int64_t threads,
                             float *received);
typedef int64_t (*lora_gemm_fn)(const void *x, const void *packed, const void *b, void *y, int64_t m, int64_t n,
                                int64_t k, int64_t threads, int64_t silu, const lora_side *lora);
typedef int64_t (*shrinks_fn)(const lora_job *jobs, int64_t count, int64_t k, int64_t threads);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t rows, int64_t inter, int64_t threads);
typedef void (*causal_fn)(const void *q, const void *k, const void *v, void *out, int64_t sq, int64_t sk, int64_t sv,
                          int64_t T, int64_t hq, int64_t hkv, int64_t D, float scale, int64_t bf16, float *scratch,
                          int64_t threads);
typedef void (*prefill_fn)(const void *q, const void *k_cache, const void *v_cache, const int64_t *table, void *out,
                           int64_t sq, int64_t width, int64_t block, int64_t T, int64_t ctx, int64_t hq, int64_t hkv,
                           int64_t D, float scale, int64_t bf16, float *scratch, int64_t threads);

typedef struct {
    void *fn;
    int64_t kind;
    const void *packed;
    const float *scale; /* int8 kinds: one per output */
    const void *bias;   /* [n] in the activations' dtype, or NULL */
    int64_t n, k;
    void *many; /* the entry point for more than Model.gemv_rows rows (same arguments as fn), or NULL: none */
} Matrix;

enum { MAX_PARTS = 3 }; /* the most sub-modules of a fused projection (q|k|v) */

/* One adapter's packed products for one projection (kernels/lora.py): shrink = x A^T [m, k*r], then for each of
 * the k sub-modules it adapts, its r rank vectors times that sub-module's B^T (scale folded in) into its own
 * output columns, from column[p] on; shrink.fn NULL where the adapter leaves the projection alone. */
typedef struct {
    Matrix shrink;
    Matrix expand[MAX_PARTS];
    int64_t column[MAX_PARTS];
    int64_t parts;
} Adapter;

enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3, PROJECTIONS = 4 };

/* The step's adapters: which rows use which adapter (inference/lora/slots.py LoRABatch). */
typedef struct {
    const Adapter *table;  /* [slots][layers][PROJECTIONS] */
    int64_t layers;
    const int64_t *order;  /* the rows that use an adapter, sorted so each adapter's rows are contiguous */
    const int64_t *spans;  /* [n_spans][3]: slot, start, end (a range of order) */
    int64_t n_spans;
    void *xs, *mid, *delta; /* scratch: rows x widest input, rows x mid_row, rows x widest output */
    int64_t mid_row;        /* elements a row of mid holds: the widest rank vectors (k*r) of any adapter */
    int64_t widened_row;    /* floats a row of Step.widened holds */
    void *pieces;           /* scratch: rows x rank, one sub-module's rank vectors as contiguous rows */
    int64_t rank;           /* the highest rank of any adapter */
} Lora;

/* What stays fixed for one layer from step to step. */
typedef struct {
    Matrix qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    const void *cos, *sin; /* rotary tables [max_pos, head_dim] */
    int64_t window;        /* sliding window, 0 for none */
    void *gate_up_silu;    /* for more than gemv_rows rows: silu(gate) * up in one call (gemm.c), or NULL */
} Layer;

/* The model's shapes and kernels. */
typedef struct {
    void *norm, *rope, *attention, *silu_mul;
    int64_t elem; /* bytes per activation: 4 (fp32) or 2 (bf16) */
    int64_t hidden, hq, hkv, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    int64_t norm_offset, threads;
    int64_t gemv_rows; /* the most rows `fn` takes; a step of more runs each product's `many` */
    void *causal, *prefill; /* a prompt chunk's attention (causal_attention.c): fresh, and after cached keys */
    void *lora_gemm; /* gemm.c's hearth_gemm_bf16_lora where bf16 products of many rows run on AMX tiles, or NULL */
    void *lora_shrinks; /* gemm.c's hearth_gemm_bf16_shrinks where lora_gemm is, or NULL */
} Model;

/* A prompt chunk of a step (rows after the decodes): its queries attend to its own keys (context < 0: nothing
 * cached before it) or, with its keys already written, to the context + T first entries of its blocks. */
typedef struct {
    int64_t start, end;    /* rows [start, end) of the step */
    int64_t context;       /* keys cached before the chunk, or -1: fresh */
    const int64_t *tables; /* context >= 0: [L, hkv, width], entry t of every head holding position t */
    int64_t width;
} Prompt;

/* One step: `rows` tokens, the first `decodes` of them one per sequence, then the prompt chunks; per-layer
 * inputs stacked with the layer first. */
typedef struct {
    int64_t rows, width, block_size;
    const int64_t *positions; /* [rows] */
    const int64_t *slots;     /* [L, hkv, rows] */
    const int64_t *tables;    /* [L, decodes, hkv, width] */
    const int32_t *lens;      /* [L, decodes, hkv] */
    void *k_cache, *v_cache;
    int32_t *pos_cache;
    /* buffers: h [rows, hidden] the residual stream (updated in place); x [rows, hidden] the last sublayer's
     * output, added to h by the next norm (has_x says whether there is one yet); the rest are scratch. */
    void *h, *x, *normed, *qkv, *q, *attn, *gate_up, *act;
    float *widened; /* rows * (largest k) floats, for the products that widen bf16 x first */
    int64_t has_x;
    const Lora *lora; /* NULL: no row uses an adapter */
    int64_t decodes;  /* rows [0, decodes) decode one token each */
    const Prompt *prompts;
    int64_t n_prompts;
    float *scratch;      /* the prompt kernel's work space for the largest chunk (hearth_causal_attention) */
    const int64_t *keep; /* NULL, or the rows (ascending) the last layer's output projection and MLP run on */
    int64_t kept, last;  /* how many rows keep lists; the last layer's index */
    const Lora *lora_kept; /* with keep: the adapters of the kept rows, in their new places (NULL: none) */
    float *received; /* NULL, or [L, decodes, hkv, width * block_size]: the attention each decode's entries
                      * received in each layer, for sequences being compressed (paged_decode.c) */
} Step;

/* y = x W^T (+ bias) on the entry point the Python forward would call for this many rows (the caller only
 * starts steps of more than gemv_rows rows where every matrix has a `many`). */
static void product_rows(const Model *M, const Matrix *W, const void *x, void *y, int64_t m, int64_t threads,
                         float *widened) {
    void *fn = m > M->gemv_rows ? W->many : W->fn;
    switch (W->kind) {
    case GEMV_F32: ((gemv_fn)fn)(x, W->packed, W->bias, y, m, W->n, W->k, threads); break;
    case GEMV_BF16: ((gemv_widened_fn)fn)(x, W->packed, W->bias, y, m, W->n, W->k, threads, widened); break;
    case I8_F32:
    case I8_PAIRS: ((i8_fn)fn)(x, W->packed, W->scale, W->bias, y, m, W->n, W->k, threads); break;
    case I8_BF16: ((i8_widened_fn)fn)(x, W->packed, W->scale, W->bias, y, m, W->n, W->k, threads, widened); break;
    }
}

static void product(const Model *M, const Step *S, const Matrix *W, const void *x, void *y, int64_t m) {
    product_rows(M, W, x, y, m, M->threads, S->widened);
}

static const Adapter *adapter(const Lora *A, int64_t slot, int64_t layer, int64_t projection) {
    return &A->table[(slot * A->layers + layer) * PROJECTIONS + projection];
}

/* Whether some adapter of the step changes this projection of this layer. */
static int lora_adapted(const Lora *A, int64_t layer, int64_t projection) {
    for (int64_t s = 0; A && s < A->n_spans; s++)
        if (adapter(A, A->spans[3 * s], layer, projection)->shrink.fn) return 1;
    return 0;
}

/* y[rows[i]] [column, column + n) += delta[i] (in the activations' dtype) for the m rows. */
static void add_rows(void *y, int64_t out, const int64_t *rows, int64_t m, const void *delta, int64_t column,
                     int64_t n, int64_t e) {
    for (int64_t i = 0; i < m; i++) {
        if (e == 4) {
            float *dst = (float *)y + rows[i] * out + column;
            const float *d = (const float *)delta + i * n;
            for (int64_t c = 0; c < n; c++) dst[c] += d[c];
        } else {
            uint16_t *dst = (uint16_t *)y + rows[i] * out + column;
            const uint16_t *d = (const uint16_t *)delta + i * n;
            int64_t c = 0;
#ifdef __AVX512F__
            /* sixteen lanes: at a prompt chunk's rows these adds took as long as the adapters' products */
            for (; c + 16 <= n; c += 16)
                _mm256_storeu_si256((__m256i *)(dst + c),
                                    narrow16_bf16(_mm512_add_ps(widen16_bf16(dst + c), widen16_bf16(d + c))));
#endif
            for (; c + 8 <= n; c += 8) /* eight lanes: one at a time cost as much as the products at decode */
                _mm_storeu_si128((__m128i *)(dst + c),
                                 narrow8_bf16(_mm256_add_ps(widen8_bf16(dst + c), widen8_bf16(d + c))));
            for (; c < n; c++) dst[c] = narrow1_bf16(widen1_bf16(dst[c]) + widen1_bf16(d[c]));
        }
    }
}

/* A span's rows of x: in place where they follow each other (a prompt chunk's), else gathered into A->xs at the
 * span's rows. */
static const void *span_rows(const Model *M, const Lora *A, int64_t start, int64_t m, const void *x, int64_t in) {
    const int64_t e = M->elem, *rows = A->order + start;
    if (rows[m - 1] - rows[0] == m - 1) /* rows ascend within a span: only consecutive ones span m - 1 */
        return (const char *)x + rows[0] * in * e;
    char *gathered = (char *)A->xs + start * in * e;
    for (int64_t i = 0; i < m; i++) memcpy(gathered + i * in * e, (const char *)x + rows[i] * in * e, in * e);
    return gathered;
}

/* The rank vectors of a span's rows (its adapter's shrink) into A->mid at the span's rows. */
static void shrink_span(const Model *M, const Lora *A, float *widened_rows, const Adapter *ad, int64_t start, int64_t m,
                        const void *x, int64_t in, int64_t threads) {
    product_rows(M, &ad->shrink, span_rows(M, A, start, m, x, in), (char *)A->mid + start * A->mid_row * M->elem, m,
                 threads, widened_rows + start * A->widened_row);
}

/* One span's part of hearth_lora_add: rows order[start, start + m) of one adapter, its scratch rows at `start`
 * (each scratch buffer's rows have one width for every adapter, so spans run at once never share a byte). */
static void add_span(const Model *M, const Lora *A, float *widened_rows, const Adapter *ad, int64_t start, int64_t m,
                     const void *x, int64_t in, void *y, int64_t out, int64_t threads) {
    const int64_t e = M->elem, *rows = A->order + start, kr = ad->shrink.n, rank = kr / ad->parts;
    char *mid = (char *)A->mid + start * A->mid_row * e;
    char *delta = (char *)A->delta + start * out * e, *piece = (char *)A->pieces + start * A->rank * e;
    float *widened = widened_rows + start * A->widened_row;
    shrink_span(M, A, widened_rows, ad, start, m, x, in, threads);
    for (int64_t p = 0; p < ad->parts; p++) {
        const Matrix *B = &ad->expand[p];
        const char *vectors = mid;
        if (ad->parts > 1) { /* this sub-module's rank vectors, as contiguous rows for its product */
            for (int64_t i = 0; i < m; i++) memcpy(piece + i * rank * e, mid + (i * kr + p * rank) * e, rank * e);
            vectors = piece;
        }
        product_rows(M, B, vectors, delta, m, threads, widened);
        add_rows(y, out, rows, m, delta, ad->column[p], B->n, e);
    }
}

/* Each span's work: its deltas added to y (add_span), or with y NULL its shrink alone (shrink_span). With at least
 * as many adapters as threads, each thread takes whole adapters, their products on one thread: a step's few rows
 * per adapter make products of a few microseconds, which a parallel region per product would double. Each output
 * is computed by the same code on the same rows either way, so the results do not change. */
static void span_work(const Model *M, const Lora *A, float *widened, int64_t layer, int64_t projection,
                      const void *x, int64_t in, void *y, int64_t out, int64_t s, int64_t threads) {
    const Adapter *ad = adapter(A, A->spans[3 * s], layer, projection);
    const int64_t start = A->spans[3 * s + 1], m = A->spans[3 * s + 2] - start;
    if (!ad->shrink.fn || m <= 0) return;
    if (y)
        add_span(M, A, widened, ad, start, m, x, in, y, out, threads);
    else
        shrink_span(M, A, widened, ad, start, m, x, in, threads);
}

static void run_spans(const Model *M, const Lora *A, float *widened, int64_t layer, int64_t projection,
                      const void *x, int64_t in, void *y, int64_t out) {
    const int64_t n = A->n_spans, threads = M->threads > 0 ? M->threads : 1;
    if (n >= threads && threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t s = 0; s < n; s++) span_work(M, A, widened, layer, projection, x, in, y, out, s, 1);
        return;
    }
    for (int64_t s = 0; s < n; s++) span_work(M, A, widened, layer, projection, x, in, y, out, s, threads);
}

/* y [rows, out] += each adapted row's delta from x [rows, in], as lora_apply_packed computes it: the adapter's
 * rows gathered, its two products on them, each delta added to its row once (in the activations' dtype). With
 * at least as many adapters as threads, each thread takes whole adapters, their products on one thread: a step's
 * few rows per adapter make products of a few microseconds, which a parallel region per product would double.
 * Each output is computed by the same code on the same rows either way, so the results do not change. Steps of
 * the Python forward (prompt chunks) call it too (kernels/cpu_decode_layer.LoraRows): lora_apply_packed's bits,
 * without its gather, zeroed delta and scatter-add over the whole step. widened: rows x A->widened_row floats. */
void hearth_lora_add(const Model *M, const Lora *A, float *widened, int64_t layer, int64_t projection,
                     const void *x, int64_t in, void *y, int64_t out) {
    if (!A || !lora_adapted(A, layer, projection)) return;
    run_spans(M, A, widened, layer, projection, x, in, y, out);
}

/* Buffer `which` (0-3) of the calling thread's scratch for hearth_lora_product, at least `bytes` long (NULL out
 * of memory): kept from call to call and grown as needed, never given back (the largest a thread has needed: a
 * prompt step's tiles, a few hundred KB). Allocated afresh for each of a step's 120 products, buffers that large
 * are mapped anew by glibc's default allocator and come as new pages the kernel must zero. */
static void *scratch(int which, int64_t bytes) {
    static __thread void *held[4];
    static __thread int64_t size[4];
    if (bytes > size[which]) {
        void *grown = realloc(held[which], (size_t)bytes);
        if (!grown) return NULL;
        held[which] = grown, size[which] = bytes;
    }
    return held[which];
}

/* Every span's rank vectors of this projection into A->mid: in one call where gemm.c runs them all at once on AMX
 * tiles (hearth_gemm_bf16_shrinks: at a decode step, a few rows each by a small matrix, which one at a time
 * streamed their weights at ~11 GB/s on an AMX Xeon VM), else span by span (run_spans). */
static void shrinks(const Model *M, const Lora *A, float *widened, int64_t layer, int64_t projection, const void *x,
                    int64_t in) {
    lora_job *jobs = M->lora_shrinks ? scratch(3, (A->n_spans ? A->n_spans : 1) * (int64_t)sizeof *jobs) : NULL;
    int64_t count = 0;
    for (int64_t s = 0; jobs && s < A->n_spans; s++) {
        const Adapter *ad = adapter(A, A->spans[3 * s], layer, projection);
        const int64_t start = A->spans[3 * s + 1], m = A->spans[3 * s + 2] - start;
        if (!ad->shrink.fn || m <= 0) continue;
        if (ad->shrink.kind != GEMV_BF16 || ad->shrink.k != in) {
            jobs = NULL;
            break;
        }
        jobs[count++] = (lora_job){span_rows(M, A, start, m, x, in), ad->shrink.packed,
                                   (uint16_t *)A->mid + start * A->mid_row, m, ad->shrink.n};
    }
    if (jobs && ((shrinks_fn)M->lora_shrinks)(jobs, count, in, M->threads > 0 ? M->threads : 1)) return;
    run_spans(M, A, widened, layer, projection, x, in, NULL, 0);
}

/* Whether the step's adapters of this projection can ride inside its base product W (lora_side.h): a bf16
 * product of more rows than the GEMV takes, on gemm.c (whose AMX path takes k % 32 == 0), and every adapter
 * present that changes the projection of a rank and sub-module columns in whole tiles and blocks of 32. */
static int lora_fusable(const Model *M, const Lora *A, int64_t layer, int64_t projection, const Matrix *W,
                        int64_t m) {
    if (!M->lora_gemm || !A || W->kind != GEMV_BF16 || !W->many || m <= M->gemv_rows || W->k % 32) return 0;
    for (int64_t s = 0; s < A->n_spans; s++) {
        const Adapter *ad = adapter(A, A->spans[3 * s], layer, projection);
        if (!ad->shrink.fn) continue;
        if ((ad->shrink.n / ad->parts) % 32) return 0;
        for (int64_t p = 0; p < ad->parts; p++)
            if (ad->column[p] % 32 || ad->expand[p].kind != GEMV_BF16) return 0;
    }
    return 1;
}

/* y = x W^T (silu 0, y [m, n]) or silu(gate) * up of it (silu 1, y [m, n / 2]), with every adapted row's expands
 * summed inside the product (lora_side.h): the shrinks first (per span, as hearth_lora_add), then each 16-row
 * group's (group, adapter) entries with their rank-vector tiles, then gemm.c's product. 1 when done; 0 where it
 * cannot (lora_fusable, or out of memory) and nothing was written: the caller runs the product and adds apart. */
int64_t hearth_lora_product(const Model *M, const Lora *A, float *widened, int64_t layer, int64_t projection,
                            const Matrix *W, const void *x, void *y, int64_t m, int64_t silu) {
    if (!lora_fusable(M, A, layer, projection, W, m)) return 0;
    /* R: a tile row's elements, the highest rank of the table in whole tiles (the entries' ranks are whole ones) */
    const int64_t e = M->elem, groups = (m + 15) / 16, R = (A->rank + 31) / 32 * 32, n = A->n_spans;
    int64_t *first = scratch(0, (2 * groups + 1) * sizeof *first), *cursor = first + groups + 1, entries = 0;
    if (!first) return 0;
    memset(first, 0, (groups + 1) * sizeof *first);
    for (int64_t s = 0; s < n; s++) { /* count: each span's rows ascend, so its groups come in order */
        const Adapter *ad = adapter(A, A->spans[3 * s], layer, projection);
        int64_t last = -1;
        for (int64_t i = A->spans[3 * s + 1]; ad->shrink.fn && i < A->spans[3 * s + 2]; i++) {
            const int64_t g = A->order[i] / 16;
            if (g != last) first[g + 1]++, entries++, last = g;
        }
    }
    lora_entry *table = scratch(1, (entries ? entries : 1) * sizeof *table);
    uint16_t *tiles = scratch(2, (entries ? entries : 1) * LORA_PARTS * 16 * R * sizeof *tiles);
    if (!table || !tiles) return 0;
    for (int64_t g = 0; g < groups; g++) first[g + 1] += first[g], cursor[g] = first[g];
    shrinks(M, A, widened, layer, projection, x, W->k); /* each span's rank vectors */
    for (int64_t s = 0; s < n; s++) { /* each row's rank vectors into its group's entry for its adapter */
        const Adapter *ad = adapter(A, A->spans[3 * s], layer, projection);
        if (!ad->shrink.fn) continue;
        const int64_t rank = ad->shrink.n / ad->parts;
        lora_entry *E = NULL;
        const int64_t start = A->spans[3 * s + 1], end = A->spans[3 * s + 2];
        int64_t last = -1, at = 0;
        for (int64_t i = start; i < end; i++) {
            const int64_t row = A->order[i], g = row / 16;
            /* the span's rank vectors lie from its scratch rows on, kr = shrink.n apart (shrink_span) */
            const char *vectors = (const char *)A->mid + (start * A->mid_row + (i - start) * ad->shrink.n) * e;
            if (g != last) {
                at = cursor[g]++, last = g;
                E = &table[at];
                memset(E, 0, sizeof *E);
                E->parts = ad->parts, E->rank = rank;
                for (int64_t p = 0; p < ad->parts; p++)
                    E->b[p] = ad->expand[p].packed, E->column[p] = ad->column[p], E->n[p] = ad->expand[p].n;
                /* All 16 rows of the group are this span's, in order (rows ascend in a span: only consecutive
                 * ones span 15): its tiles are the shrinks' outputs as they lie, kr apart, not copied row by row
                 * into zeroed ones. A prompt step's groups mostly are: on an AMX Xeon VM the LoRA benchmark's
                 * prompts alone (one output token) cost 1.03x less with eight rank-32 adapters (medians of ten
                 * alternated rounds in one process), what the adapters added 0.249 -> 0.222 s a round. */
                if (row % 16 == 0 && i + 15 < end && A->order[i + 15] == row + 15) {
                    E->stride = ad->shrink.n;
                    for (int64_t p = 0; p < ad->parts; p++) E->v[p] = (const uint16_t *)(vectors + p * rank * e);
                    i += 15;
                    continue;
                }
                E->stride = R;
                memset(tiles + at * LORA_PARTS * 16 * R, 0, (size_t)(ad->parts * 16 * R) * sizeof *tiles);
                for (int64_t p = 0; p < ad->parts; p++) E->v[p] = tiles + (at * LORA_PARTS + p) * 16 * R;
            }
            for (int64_t p = 0; p < ad->parts; p++)
                memcpy((uint16_t *)E->v[p] + (row % 16) * R, vectors + p * rank * e, rank * e);
        }
    }
    const lora_side side = {first, table};
    return ((lora_gemm_fn)M->lora_gemm)(x, W->packed, W->bias, y, m, silu ? W->n / 2 : W->n, W->k,
                                        M->threads > 0 ? M->threads : 1, silu, &side);
}

static void add_adapters(const Model *M, const Step *S, const Lora *lora, int64_t layer, int64_t projection,
                         const void *x, int64_t in, void *y, int64_t out) {
    hearth_lora_add(M, lora, S->widened, layer, projection, x, in, y, out);
}

/* y = x W^T with the step's adapters of this projection: inside the product where they can ride in it
 * (hearth_lora_product), else added after it. */
static void adapted_product(const Model *M, const Step *S, const Lora *lora, int64_t layer, int64_t projection,
                            const Matrix *W, const void *x, void *y, int64_t m) {
    if (lora && lora_adapted(lora, layer, projection)
        && hearth_lora_product(M, lora, S->widened, layer, projection, W, x, y, m, 0))
        return;
    product(M, S, W, x, y, m);
    add_adapters(M, S, lora, layer, projection, x, W->k, y, W->n);
}

/* The attention of every row: the decodes' over their blocks, each prompt chunk's as the forward runs it. S->q
 * holds the queries, S->qkv the rotated keys and values of the step's own tokens (a fresh chunk reads them there). */
static void attend(const Model *M, const Layer *L, const Step *S, int64_t index) {
    const int64_t e = M->elem, d = M->head_dim, hq = M->hq, hkv = M->hkv, n = S->decodes;
    const int64_t qkv_row = (hq + 2 * hkv) * d, q_row = hq * d;
    if (n > 0)
        ((attention_fn)M->attention)(S->q, S->k_cache, S->v_cache, S->pos_cache, S->tables + index * n * hkv * S->width,
                                     S->lens + index * n * hkv, S->positions, S->attn, n, hq, hkv, d, S->block_size,
                                     S->width, M->scale, L->window, M->softcap, M->threads,
                                     S->received ? S->received + index * n * hkv * S->width * S->block_size : NULL);
    for (int64_t p = 0; p < S->n_prompts; p++) {
        const Prompt *P = &S->prompts[p];
        const int64_t T = P->end - P->start;
        const char *q = (const char *)S->q + P->start * q_row * e, *own = (const char *)S->qkv + P->start * qkv_row * e;
        void *out = (char *)S->attn + P->start * q_row * e;
        if (P->context < 0)
            ((causal_fn)M->causal)(q, own + hq * d * e, own + (hq + hkv) * d * e, out, q_row, qkv_row, qkv_row, T, hq,
                                   hkv, d, M->scale, e == 2, S->scratch, M->threads);
        else
            ((prefill_fn)M->prefill)(q, S->k_cache, S->v_cache, P->tables + index * hkv * P->width, out, q_row,
                                     P->width, S->block_size, T, P->context, hq, hkv, d, M->scale, e == 2, S->scratch,
                                     M->threads);
    }
}

/* The last layer's output projection and MLP feed only the final states, so they run on the rows the caller
 * reads (keep, ascending): those rows of h and of the attention output moved to the front. Returns their count. */
static int64_t keep_rows(const Model *M, Step *S) {
    const int64_t e = M->elem, hidden = M->hidden * e, q_row = M->hq * M->head_dim * e;
    for (int64_t i = 0; i < S->kept; i++) {
        const int64_t r = S->keep[i];
        if (r == i) continue; /* r > i from here on: the rows never overlap */
        memcpy((char *)S->h + i * hidden, (const char *)S->h + r * hidden, hidden);
        memcpy((char *)S->attn + i * q_row, (const char *)S->attn + r * q_row, q_row);
    }
    return S->kept;
}

/* Layer `index` of the decoder (pre-norm attention and SiLU-gated MLP, as DecoderLM.forward runs it). */
void hearth_decode_layer(const Model *M, const Layer *L, Step *S, int64_t index) {
    const int64_t e = M->elem, d = M->head_dim, hq = M->hq, hkv = M->hkv;
    const int64_t qkv_row = (hq + 2 * hkv) * d, q_row = hq * d;
    norm_fn norm = (norm_fn)M->norm;
    int64_t m = S->rows;
    const Lora *lora = S->lora;

    norm(S->h, S->has_x ? S->x : NULL, L->input_norm, S->normed, m, M->hidden, M->eps, M->norm_offset, M->threads);
    adapted_product(M, S, lora, index, QKV, &L->qkv, S->normed, S->qkv, m);
    ((rope_fn)M->rope)(S->qkv, qkv_row, (char *)S->qkv + (hq + hkv) * d * e, qkv_row, L->cos, L->sin, S->positions,
                       S->slots + index * hkv * m, S->k_cache, S->v_cache, S->pos_cache, m, hq, hkv, d, M->threads);
    for (int64_t r = 0; r < m; r++) /* the queries of each row, contiguous as the attention kernels read them */
        memcpy((char *)S->q + r * q_row * e, (const char *)S->qkv + r * qkv_row * e, q_row * e);
    attend(M, L, S, index);
    S->has_x = 1;
    if (S->keep && index == S->last) {
        lora = S->lora_kept;
        if ((m = keep_rows(M, S)) == 0) return; /* no row samples: the keys and values are written */
    }
    adapted_product(M, S, lora, index, O, &L->o, S->attn, S->x, m);
    norm(S->h, S->x, L->post_norm, S->normed, m, M->hidden, M->eps, M->norm_offset, M->threads);
    const Matrix *gu = &L->gate_up;
    if (m > M->gemv_rows && L->gate_up_silu && !(lora && lora_adapted(lora, index, GATE_UP))) {
        /* the products and SiLU * up in one pass, as the forward does */
        if (gu->kind == GEMV_F32)
            ((gemv_fn)L->gate_up_silu)(S->normed, gu->packed, gu->bias, S->act, m, M->inter, gu->k, M->threads);
        else
            ((gemv_widened_fn)L->gate_up_silu)(S->normed, gu->packed, gu->bias, S->act, m, M->inter, gu->k,
                                                M->threads, S->widened);
    } else if (!(L->gate_up_silu && lora_adapted(lora, index, GATE_UP)
                 && hearth_lora_product(M, lora, S->widened, index, GATE_UP, gu, S->normed, S->act, m, 1))) {
        adapted_product(M, S, lora, index, GATE_UP, gu, S->normed, S->gate_up, m);
        ((silu_mul_fn)M->silu_mul)(S->gate_up, S->act, m, M->inter, M->threads);
    }
    adapted_product(M, S, lora, index, DOWN, &L->down, S->act, S->x, m);
}
