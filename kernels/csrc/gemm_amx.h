/* gemm.c's bf16 products on AMX tiles (Intel Sapphire Rapids and later), where the build has them (-mamx-tile
 * -mamx-bf16) and Linux lets the process use them: included by gemm.c, whose entry points come here for k a
 * multiple of 32 and fall back to the AVX-512 BF16 register tiles otherwise.
 *
 * One tile multiply (tdpbf16ps) adds a 16 x 32 bf16 tile of x times a 32 x 16 tile of weights into 16 x 16 fp32
 * sums: 16,384 flops an instruction against 64 for an AVX-512 BF16 dot product. oneDNN's products run on the
 * tiles too, which put them 2-12x ahead of the AVX-512 GEMM on such a CPU (docs/benchmarks.md, cpu_gemm), and so
 * the engine sent bf16 steps of many rows there, through the Python forward; with the tiles here the one-call C
 * layers of csrc/decode_layer.c run those steps as well.
 *
 * No repacking: gemv.c's layout of a block, k-pair-major [k / 2][BW = 32][2], is already what a weight tile reads
 * (each of its 16 rows a pair of k for 16 outputs, 64 bytes): the tile of outputs [16h, 16h + 16) and k-pairs
 * [16j, 16j + 16) starts 2048 j + 64 h bytes into the block, rows 128 bytes apart. x tiles read 16 rows of x in
 * place (rows 2k bytes apart); the rows past m of a last partial group come from a zero-padded copy.
 *
 * Eight tiles: sums for rows [0, 16) and [16, 32) by the block's two halves (0-3), two x tiles (4, 5), two weight
 * tiles (6, 7); a weight tile is loaded once for 32 rows. Each block's sums are stored to an L1 buffer and go
 * through gemm.c's row epilogues (bias, rounding, SiLU * up), so each output is rounded once, as there.
 */
#include <stdlib.h>

#include "amx.h"
#include "lora_side.h"

#define AMX_ROWS 16 /* rows of an x tile */
#define AMX_K 32    /* k per tile multiply */
#ifndef AMX_AHEAD
#define AMX_AHEAD 4 /* steps of k (2 KB of weights each) fetched into L1 ahead */
#endif
#ifndef AMX_FAR
#define AMX_FAR 24 /* steps of k fetched into L2 ahead */
#endif

static int amx_permitted;

__attribute__((constructor)) static void amx_request(void) { amx_permitted = amx_request_permission(); }

static inline int amx_takes(int64_t k) { return amx_permitted && k % AMX_K == 0; }

/* The 32 lines of weights AMX_FAR steps on into L2, and those AMX_AHEAD steps on from there into L1: a step's
 * weight tiles wait on memory otherwise (the prefetchers do not follow tile loads well). Past a block's end this
 * reads the thread's next block, which follows it. Why two distances: with L1's alone (8 steps), a 32-row decode
 * product streamed its weights 20% slower than one of 16 rows or the GEMV of one, as if the tiles' multiplies
 * and the memory took turns; fetches into L2 as well (likely: more lines on their way than L1's fill buffers
 * hold; not measured apart) brought it close to the GEMV's rate (LM head, 32 rows: 10.1 ms against 9.6 ms). On
 * the AMX Xeon VM of docs/benchmarks.md, Qwen2.5-0.5B bf16 decode steps of 32 sequences took 52.6-54.6 ms against
 * 56.6-57.7 ms (two alternating pairs of processes); 16 and 32 steps into L1 alone were no faster than 8. */
static inline __attribute__((always_inline)) void amx_fetch(const char *w) {
#if AMX_AHEAD > 0
    _Pragma("GCC unroll 32") for (int l = 0; l < 32; l++) _mm_prefetch(w + AMX_FAR * 2048 + 64 * l, _MM_HINT_T1);
    _Pragma("GCC unroll 32") for (int l = 0; l < 32; l++) _mm_prefetch(w + AMX_AHEAD * 2048 + 64 * l, _MM_HINT_T0);
#else
    (void)w;
#endif
}

/* One unit's sums (up to 32 rows by one block) waiting for their epilogue: gemm.c's row epilogues (bias,
 * rounding, SiLU * up) into y, or, for an argmax, each row's outputs folded into its best (best.h). */
typedef struct {
    float sums[32][BW], ups[32][BW];
    int64_t rows; /* 0: nothing waits */
    int up;       /* ups holds the up half's sums: y gets silu(gate) * up */
    char *y;      /* the first row's outputs (rows n outputs apart) */
    const void *b, *b_up;
    int64_t width;
    best *bests; /* argmax: the first row's best; y unused */
    int64_t c0;  /* argmax: the block's first output */
} amx_unit;

/* Row i of a unit's epilogue. */
static inline __attribute__((always_inline)) void amx_epilogue_row(int kind, amx_unit *u, int64_t i, int64_t n) {
    const int64_t out = kind == BF16_PAIRS ? 2 : 4; /* bytes per output */
    if (u->up) {
        const vec up[NB] = {vload_f32(u->ups[i]), vload_f32(u->ups[i] + VL)};
        store_silu_row(kind, u->sums[i], up, u->b, u->b_up, u->y + i * n * out);
        return;
    }
    const vec s[NB] = {vload_f32(u->sums[i]), vload_f32(u->sums[i] + VL)};
    if (!u->bests) {
        store_row(kind, s, u->b, u->y + i * n * out, u->width);
        return;
    }
    float row[BW];
    store_row(kind, s, u->b, row, u->width);
    best_scan(&u->bests[i], row, u->width, u->c0);
}

static inline __attribute__((always_inline)) void amx_epilogue(int kind, amx_unit *u, int64_t n) {
    for (int64_t i = 0; i < u->rows; i++) amx_epilogue_row(kind, u, i, n);
    u->rows = 0;
}

/* The LoRA expands of 16-row group `group` (lora_side.h) into the sums of the block of outputs from `column` on:
 * tiles 0-1 (second 0) or 2-3 (second 1). Per entry, the part whose outputs hold the block: its rank-vector tile
 * times the block's rows of its expand, 32 ranks a multiply. */
static inline __attribute__((always_inline)) void amx_lora(const lora_side *L, int64_t group, int64_t column,
                                                            int second) {
    for (int64_t e = L->first[group]; e < L->first[group + 1]; e++) {
        const lora_entry *E = &L->entries[e];
        for (int64_t p = 0; p < E->parts; p++) {
            if (!E->b[p] || column < E->column[p] || column >= E->column[p] + E->n[p]) continue;
            const char *w = (const char *)(E->b[p] + (column - E->column[p]) * E->rank); /* its block: rank x 32 */
            const uint16_t *v = E->v[p];
            for (int64_t j = 0; j < E->rank; j += AMX_K, w += 2048) {
                amx_tiles_weights(w);
                amx_tiles_rows(second, v + j, E->stride * 2);
            }
            break;
        }
    }
}

/* Tiles 0-3 = rows [0, 16) (x0) and, with two groups, [16, 32) (x1) of x times one block over all k (amx.h's plan);
 * x rows 2k bytes apart. groups and fetch are constants once inlined: one loop each, no branch in it. The sums stay
 * in the tiles until amx_tiles_store. After each step's multiplies come a row or two of the epilogue of `before`
 * (an earlier unit, whose sums are already stored), until all of its rows are done (see amx_block_rows). */
static inline __attribute__((always_inline)) void amx_run(int kind, int groups, int fetch, const uint16_t *x0,
                                                           const uint16_t *x1, int64_t k, const uint16_t *block,
                                                           amx_unit *before, int64_t n, const lora_side *lora,
                                                           int64_t group, int64_t column) {
    const int64_t stride = 2 * k, steps = k / AMX_K;
    const int64_t per = (before->rows + steps - 1) / steps; /* rows of the earlier unit's epilogue a step */
    int64_t done = 0;
    const char *w = (const char *)block;
    amx_tiles_zero();
    for (int64_t j = 0; j < steps; j++, w += 2048) {
        if (fetch) amx_fetch(w);
        amx_tiles_weights(w);
        amx_tiles_rows(0, x0 + j * AMX_K, stride);
        if (groups == 2) amx_tiles_rows(1, x1 + j * AMX_K, stride);
        for (int64_t e = 0; e < per && done < before->rows; e++, done++) amx_epilogue_row(kind, before, done, n);
    }
    before->rows = 0;
    if (lora) {
        amx_lora(lora, group, column, 0);
        if (groups == 2) amx_lora(lora, group + 1, column, 1);
    }
}

/* amx_run with its constant arguments chosen at run time. */
static inline __attribute__((always_inline)) void amx_run_any(int kind, int64_t groups, int fetch,
                                                               const uint16_t *x0, const uint16_t *x1, int64_t k,
                                                               const uint16_t *block, amx_unit *before, int64_t n,
                                                               const lora_side *L, int64_t g, int64_t c) {
    if (groups == 2)
        fetch ? amx_run(kind, 2, 1, x0, x1, k, block, before, n, L, g, c)
              : amx_run(kind, 2, 0, x0, x1, k, block, before, n, L, g, c);
    else
        fetch ? amx_run(kind, 1, 1, x0, x0, k, block, before, n, L, g, c)
              : amx_run(kind, 1, 0, x0, x0, k, block, before, n, L, g, c);
}

/* Row r of x, or of the zero-padded copy of the last partial group (tail, which holds rows [tail_from, m)). */
static inline const uint16_t *amx_row(const uint16_t *x, const uint16_t *tail, int64_t tail_from, int64_t r,
                                      int64_t k) {
    return tail && r >= tail_from ? tail + (r - tail_from) * k : x + r * k;
}

/* Rows [r0, r0 + rows) of x times one block (outputs c0 on, width of them exist): gemm.c's block_rows on tiles.
 * y: row r0's outputs (rows n outputs apart); or bests: row r0's best (an argmax). up: the up block of the same
 * outputs, and y gets silu(gate) * up (tile_silu's epilogue).
 *
 * Software-pipelined over units of 32 rows: a unit's sums are stored to units[] and its epilogue (vector code:
 * bias, rounding, SiLU, the stores to y) is spread over the next unit's k-steps, so that the core runs both at
 * once; units[2] alternate, and the last one waits, *pending says which, for the caller's next block or for
 * amx_epilogue at the end. Run after the multiplies, the epilogue and the tile stores it waited on took a third of
 * a product at k = 576 on an AMX Xeon VM (2048 rows: 1.86 TFLOP/s against 2.82 without the epilogue); merely
 * issued after the next unit's multiplies, it still ran mostly alone (the tile instructions fill the core's
 * window until they retire). */
static inline __attribute__((always_inline)) void amx_block_rows(int kind, const uint16_t *x, const uint16_t *tail,
                                                                  int64_t tail_from, int64_t r0, int64_t rows,
                                                                  int64_t k, const uint16_t *block,
                                                                  const uint16_t *up, const void *b, const void *b_up,
                                                                  char *y, best *bests, int64_t n, int64_t c0,
                                                                  int64_t width, amx_unit units[2], int *pending,
                                                                  const lora_side *lora) {
    const int64_t out = kind == BF16_PAIRS ? 2 : 4; /* bytes per output */
    for (int64_t g = 0; g < rows; g += 32) {
        const int64_t r = r0 + g, here = rows - g < 32 ? rows - g : 32, groups = here > AMX_ROWS ? 2 : 1;
        const uint16_t *x0 = amx_row(x, tail, tail_from, r, k), *x1 = amx_row(x, tail, tail_from, r + AMX_ROWS, k);
        amx_unit *now = &units[!*pending], *before = &units[*pending];
        /* the first pass over a block reads it from memory: only that one fetches ahead */
        /* the earlier unit's epilogue too; r is a multiple of 16 (chunks and units are) */
        amx_run_any(kind, groups, g == 0, x0, x1, k, block, before, n, lora, r / AMX_ROWS, c0);
        amx_tiles_store(groups, now->sums[0], BW);
        if (up) { /* silu: the up half's outputs are the projection's n + c0 on */
            amx_run_any(kind, groups, g == 0, x0, x1, k, up, before, n, lora, r / AMX_ROWS, n + c0);
            amx_tiles_store(groups, now->ups[0], BW);
        }
        now->rows = here, now->up = up != NULL, now->y = y ? y + g * n * out : NULL; /* not a compound literal: */
        now->b = b, now->b_up = b_up, now->width = width, now->c0 = c0;               /* it would zero the sums */
        now->bests = bests ? bests + g : NULL;
        *pending = !*pending;
    }
}

/* gemm.c's product (silu: product_silu, n = inter outputs of silu(gate) * up from 2 * inter packed; tokens:
 * product_argmax, y unused) on tiles, for kind BF16_PAIRS or BF16_WIDE and k % AMX_K == 0: the same items of
 * blocks and chunks of rows, dealt between threads the same way (deal.h). 0, or -1 out of memory. */
static int amx_product(int kind, const uint16_t *x, const uint16_t *packed, const uint16_t *b, void *y, int64_t m,
                       int64_t n, int64_t k, int64_t threads, int silu, int64_t *tokens, const lora_side *lora) {
    const int64_t blocks = (n + BW - 1) / BW, bytes = k * BW, out = kind == BF16_PAIRS ? 2 : 4;
    /* a last group of fewer than 16 rows reads them from a copy padded with zero rows */
    const int64_t tail_from = m - m % AMX_ROWS;
    uint16_t *tail = NULL;
    if (m % AMX_ROWS) {
        tail = calloc((size_t)(AMX_ROWS * k), sizeof *tail);
        if (!tail) return -1;
        memcpy(tail, x + tail_from * k, (size_t)((m - tail_from) * k) * sizeof *tail);
        TILE_LOADS_SEE_STORES();
    }
    DEAL_COUNTS(counts, threads);
    best *all = tokens ? bests_open(counts_team, m) : NULL;
    if (tokens && !all) {
        free(tail);
        return -1;
    }
#pragma omp parallel num_threads(counts_team)
    {
        deal d = deal_start(blocks, m, CHUNK_ROWS, omp_get_num_threads(), omp_get_thread_num(), counts);
        best *mine = all ? all + omp_get_thread_num() * m : NULL;
        amx_unit units[2];
        int pending = 0;
        units[0].rows = units[1].rows = 0;
        int64_t r0, rows, after, blk;
        amx_configure();
        while ((blk = deal_next(&d, &r0, &rows, &after)) >= 0) {
            const int64_t c0 = blk * BW, width = n - c0 < BW ? n - c0 : BW;
            const uint16_t *bias = b ? b + c0 : NULL, *bias_up = b && silu ? b + n + c0 : NULL;
            amx_block_rows(kind, x, tail, tail_from, r0, rows, k, packed + blk * bytes,
                           silu ? packed + (blk + blocks) * bytes : NULL, bias, bias_up,
                           mine ? NULL : (char *)y + (r0 * n + c0) * out, mine ? mine + r0 : NULL, n, c0, width,
                           units, &pending, lora);
        }
        _tile_release();
        if (units[pending].rows) amx_epilogue(kind, &units[pending], n);
    }
    if (all) bests_close(all, counts_team, m, tokens);
    free(tail);
    return 0;
}

/* gemm.c's product_argmax on tiles: y [m] the argmax of each row of hearth_gemm_bf16_wide's outputs. */
static int amx_product_argmax(const uint16_t *x, const uint16_t *packed, const uint16_t *b, int64_t *y, int64_t m,
                              int64_t n, int64_t k, int64_t threads) {
    return amx_product(BF16_WIDE, x, packed, b, NULL, m, n, k, threads, 0, y, NULL);
}

/* Tiles 0-3 = 16 or 32 rows (x0, x1) of x times one block over all k, as amx_run, with the weights fetched from
 * `next` on (the block the thread takes after this one, of the same size, wherever it lies) step for step into L2,
 * and AMX_AHEAD steps on within this block into L1; no fetches with next NULL (the block is already in cache). */
static inline __attribute__((always_inline)) void amx_run_to(int groups, const uint16_t *x0, const uint16_t *x1,
                                                              int64_t k, const uint16_t *block, const uint16_t *next) {
    const int64_t stride = 2 * k, steps = k / AMX_K;
    const char *w = (const char *)block, *f = (const char *)next;
    amx_tiles_zero();
    for (int64_t j = 0; j < steps; j++, w += 2048) {
        if (f) {
            _Pragma("GCC unroll 32") for (int l = 0; l < 32; l++) _mm_prefetch(f + 2048 * j + 64 * l, _MM_HINT_T1);
            if (j + AMX_AHEAD < steps)
                _Pragma("GCC unroll 32") for (int l = 0; l < 32; l++)
                    _mm_prefetch(w + AMX_AHEAD * 2048 + 64 * l, _MM_HINT_T0);
        }
        amx_tiles_weights(w);
        amx_tiles_rows(0, x0 + j * AMX_K, stride);
        if (groups == 2) amx_tiles_rows(1, x1 + j * AMX_K, stride);
    }
}

/* An item of amx_shrinks: one block of a job's outputs by one chunk of its rows, and the work before it (in 16-row
 * groups) of all the items before it. */
typedef struct {
    int64_t job, block, r0, rows, work;
} amx_item;

/* The shrinks of a projection's adapters (lora_side.h's jobs, all of one k) in one parallel region. One at a time
 * through amx_product, each began cold: the fetches ahead start with a product, so its first 48 KB waited on
 * memory, and those near its end ran on past it into other memory; each paid a region, a tile configuration and a
 * zeroed copy of its rows as well, ~960 times a 32-sequence SmolLM2 step over eight rank-32 adapters. Here the
 * jobs' items (block by chunk of rows) are split into one run of equal work per thread, and while a thread
 * multiplies one item it fetches the next one's weights, whichever adapter they belong to. Each output is summed
 * in the same order as amx_product sums it, so the results are its bits. 0, or -1 out of memory. */
static int amx_shrinks(const lora_job *jobs, int64_t count, int64_t k, int64_t threads) {
    const int64_t bytes = k * BW;
    int64_t items = 0;
    for (int64_t j = 0; j < count; j++)
        items += (jobs[j].n + BW - 1) / BW * ((jobs[j].m + CHUNK_ROWS - 1) / CHUNK_ROWS);
    amx_item *list = malloc((size_t)(items + 1) * sizeof *list);
    if (!list) return -1;
    int64_t at = 0, work = 0;
    for (int64_t j = 0; j < count; j++)
        for (int64_t r0 = 0; r0 < jobs[j].m; r0 += CHUNK_ROWS) {
            const int64_t rows = jobs[j].m - r0 < CHUNK_ROWS ? jobs[j].m - r0 : CHUNK_ROWS;
            for (int64_t blk = 0; blk * BW < jobs[j].n; blk++, work += (rows + AMX_ROWS - 1) / AMX_ROWS)
                list[at++] = (amx_item){j, blk, r0, rows, work};
        }
    list[items].work = work;
    const int64_t team = threads > 0 ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = work * t / nt, hi = work * (t + 1) / nt;
        uint16_t *tail = malloc((size_t)(AMX_ROWS * k) * sizeof *tail); /* a job's last rows, zero-padded */
        int64_t tail_job = -1;
        amx_unit u;
        u.up = 0, u.b = u.b_up = NULL, u.bests = NULL;
        if (!tail) failed = 1;
        else amx_configure();
        for (int64_t i = 0; tail && i < items; i++) {
            if (list[i].work < lo || list[i].work >= hi) continue;
            const amx_item *it = &list[i];
            const lora_job *J = &jobs[it->job];
            const int64_t tail_from = J->m - J->m % AMX_ROWS, c0 = it->block * BW;
            const int64_t after = i + 1 < items && list[i + 1].work < hi ? i + 1 : -1;
            const uint16_t *block = J->packed + it->block * bytes;
            const uint16_t *next = after >= 0 ? jobs[list[after].job].packed + list[after].block * bytes : NULL;
            if (J->m % AMX_ROWS && tail_job != it->job) {
                memset(tail, 0, (size_t)(AMX_ROWS * k) * sizeof *tail);
                memcpy(tail, J->x + tail_from * k, (size_t)((J->m - tail_from) * k) * sizeof *tail);
                TILE_LOADS_SEE_STORES();
                tail_job = it->job;
            }
            const uint16_t *padded = J->m % AMX_ROWS ? tail : NULL;
            for (int64_t g = 0; g < it->rows; g += 32) {
                const int64_t r = it->r0 + g, here = it->rows - g < 32 ? it->rows - g : 32;
                const uint16_t *x0 = amx_row(J->x, padded, tail_from, r, k);
                const uint16_t *x1 = amx_row(J->x, padded, tail_from, r + AMX_ROWS, k);
                const uint16_t *fetch = g == 0 ? next : NULL; /* the first pass over a block reads it from memory */
                if (here > AMX_ROWS) amx_run_to(2, x0, x1, k, block, fetch);
                else amx_run_to(1, x0, x0, k, block, fetch);
                amx_tiles_store(here > AMX_ROWS ? 2 : 1, u.sums[0], BW);
                u.rows = here, u.y = (char *)(J->y + r * J->n + c0);
                u.width = J->n - c0 < BW ? J->n - c0 : BW, u.c0 = c0;
                amx_epilogue(BF16_PAIRS, &u, J->n);
            }
        }
        if (tail) _tile_release();
        free(tail);
    }
    free(list);
    return failed ? -1 : 0;
}
