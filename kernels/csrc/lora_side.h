/* LoRA adapters' expands added inside a base product (gemm_amx.h), as decode_layer.c hands them over.
 *
 * A projection's output for a row with an adapter is x W^T plus, for each sub-module the adapter changes, its
 * rank vectors v (the shrink's outputs) times that sub-module's B^T (scale folded in). Done apart, the expands
 * wrote each adapted output once more and added it back over the projection's outputs, and an adapted gate|up
 * could not take the fused SiLU * up (docs/benchmarks.md, the LoRA notes). Here they are more multiplies into
 * the block's sums before its epilogue: each output is rounded once, from x W^T + v B^T summed in fp32.
 *
 * The tiles hold 16 rows; a 16-row group of the product's rows may mix adapters (and rows without one). Each
 * (group, adapter) pair is an entry: for each sub-module of the adapter, a 16-row tile of rank vectors where the
 * rows of other adapters are zero, so one tile multiply per 32 ranks adds exactly that adapter's rows. A group
 * whose 16 rows are all one adapter's, in order (a prompt's), reads its tiles where the shrinks wrote them. */
#ifndef HEARTH_LORA_SIDE_H
#define HEARTH_LORA_SIDE_H

#include <stdint.h>

enum { LORA_PARTS = 3 }; /* the most sub-modules of a fused projection (q|k|v) */

typedef struct {
    const uint16_t *v[LORA_PARTS]; /* part p's rank vectors, a tile [16][stride] (rows of others zero) */
    const uint16_t *b[LORA_PARTS]; /* part p's expand, packed as gemv.c's bf16 pairs ([n / 32][rank / 2][32][2]) */
    int64_t column[LORA_PARTS];    /* part p's first output column in the projection (a multiple of 32) */
    int64_t n[LORA_PARTS];         /* part p's outputs */
    int64_t parts, rank;           /* rank: a multiple of 32 */
    int64_t stride;                /* elements between the rows of its rank-vector tiles */
} lora_entry;

typedef struct {
    const int64_t *first;      /* [groups + 1]: group g (rows [16g, 16g + 16)) has entries [first[g], first[g+1]) */
    const lora_entry *entries;
} lora_side;

/* One of the shrinks a projection's adapters run before it (gemm.c's hearth_gemm_bf16_shrinks): x [m, k] (rows k
 * apart) times one adapter's stacked A, packed as gemv.c's bf16 pairs for n outputs, into y [m, n]. */
typedef struct {
    const uint16_t *x, *packed;
    uint16_t *y;
    int64_t m, n;
} lora_job;

#endif
