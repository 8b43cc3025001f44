/* How a product's work is dealt between threads (gemm.c, gemm_amx.h).
 *
 * An item is one block of outputs times one chunk of rows. Thread t owns the run of blocks
 * [blocks * t / team, blocks * (t + 1) / team) in every chunk, chunk by chunk, and takes its items in that order,
 * so it knows which block comes next and fetches it ahead. A thread whose run is done takes what is left of the
 * others' runs one item at a time from their back ends (so an owner's next item, already on its way into cache, is
 * the last to go), instead of waiting at the end of the parallel region.
 *
 * Why: the halves were equal in work but not in time. In a perf profile of a Qwen2.5 bf16 32-concurrent pass on a
 * 2-core AVX-512 EPYC VM, the second thread spent 8% longer in the products than the first, which waited for it at
 * the end of each product (4% of all samples), the same work split evenly. A VM's cores run at different speeds
 * from one moment to the next; the last items now go to whichever thread is free. Each output is still computed
 * by one tile over the same rows, so results do not depend on who computed them.
 */
#include <stdatomic.h>
#include <stdint.h>

/* How much of a thread's run is taken: from the front by its owner (low 32 bits), from the back by the others
 * (high 32 bits); one cache line each, so the owner's updates stay in its cache until another thread comes. */
typedef struct {
    _Alignas(64) _Atomic uint64_t taken;
} deal_count;

/* Declares `name`: the counts for a team of up to `threads` threads (at least one), zeroed; `name##_team` is that
 * size, for the parallel region's num_threads. Before the region: the team shares them. */
#define DEAL_COUNTS(name, threads)                                                                                 \
    const int64_t name##_team = (threads) > 0 ? (threads) : 1;                                                     \
    deal_count name[name##_team];                                                                                  \
    for (int64_t name##_i = 0; name##_i < name##_team; name##_i++) atomic_init(&name[name##_i].taken, 0)

typedef struct {
    int64_t blocks, chunks, team;
    deal_count *counts; /* [team], zeroed */
    int64_t self, rows, chunk_rows; /* the calling thread; all rows, rows a chunk */
} deal;

/* Thread `self` of a team of `team` dealing `blocks` blocks times the chunks of `chunk_rows` of `rows` rows. */
static inline deal deal_start(int64_t blocks, int64_t rows, int64_t chunk_rows, int64_t team, int64_t self,
                              deal_count *counts) {
    return (deal){blocks, (rows + chunk_rows - 1) / chunk_rows, team, counts, self, rows, chunk_rows};
}

/* Item `j` of thread `t`'s run of `*count` items: its block (and *chunk); -1 outside the run. */
static inline int64_t deal_item(const deal *d, int64_t t, int64_t j, int64_t *chunk, int64_t *count) {
    const int64_t first = d->blocks * t / d->team, run = d->blocks * (t + 1) / d->team - first;
    *count = run * d->chunks;
    if (j < 0 || j >= *count) return -1;
    *chunk = j / run;
    return first + j % run;
}

/* Take one item of `owner`'s run: the next from the front if `front`, else the last from the back. Its index,
 * or -1 when the run is done. */
static inline int64_t deal_take(deal *d, int64_t owner, int front) {
    int64_t chunk, count;
    deal_item(d, owner, 0, &chunk, &count);
    _Atomic uint64_t *taken = &d->counts[owner].taken;
    uint64_t old = atomic_load_explicit(taken, memory_order_relaxed), now;
    int64_t j;
    do {
        const int64_t head = (int64_t)(old & 0xffffffffu), tail = (int64_t)(old >> 32);
        if (head + tail >= count) return -1;
        j = front ? head : count - 1 - tail;
        now = old + (front ? 1u : (uint64_t)1 << 32);
    } while (!atomic_compare_exchange_weak_explicit(taken, &old, now, memory_order_relaxed, memory_order_relaxed));
    return j;
}

/* The calling thread's next item: the front of its own run, then the backs of the others'. Returns its block (-1
 * when none is left) and sets its rows (*first, *rows); *after is the block the same thread likely takes next (-1:
 * none), to fetch ahead. Not inlined: inlined into gemm.c's parallel regions, its variables crowded the register
 * tiles' (sums and row pointers spilled to the stack, the products ran at 0.35x). */
static __attribute__((noinline)) int64_t deal_next(deal *d, int64_t *first, int64_t *rows, int64_t *after) {
    for (int64_t i = 0; i < d->team; i++) {
        const int64_t owner = (d->self + i) % d->team;
        const int64_t j = deal_take(d, owner, i == 0);
        if (j < 0) continue;
        int64_t count, chunk, next_chunk;
        const int64_t blk = deal_item(d, owner, j, &chunk, &count);
        *after = deal_item(d, owner, i == 0 ? j + 1 : j - 1, &next_chunk, &count);
        *first = chunk * d->chunk_rows;
        *rows = d->rows - *first < d->chunk_rows ? d->rows - *first : d->chunk_rows;
        return blk;
    }
    return -1;
}
