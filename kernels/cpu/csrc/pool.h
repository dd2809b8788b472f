/* The shared helper threads' interface (`pool.c`), for the kernels that take them: a
 * kernel keeps a `pool_run_fn` its caller hands in and runs its items through it. */
#ifndef SPILLWAY_POOL_H
#define SPILLWAY_POOL_H
#include <omp.h>
#include <stdint.h>

/* Item `item` of a call, on worker `worker` (0 the calling thread, 1 .. the helpers; less
 * than MOST_WORKERS: a kernel may keep per-worker scratch in an array of that many). */
typedef void (*pool_item_fn)(void *ctx, int64_t item, int worker);
typedef int (*pool_run_fn)(pool_item_fn fn, void *ctx, int64_t items);
#define MOST_WORKERS 64

/* Whether the call ran on the pool: `run` handed in (else NULL), and not from inside an
 * OpenMP region (decode_layers.c's, whose other threads wait there: they stay the only
 * ones), and it took the items. Otherwise the kernel runs them on OpenMP's threads. */
static inline int pool_took(pool_run_fn run, pool_item_fn fn, void *ctx, int64_t items) {
    return run != NULL && !omp_in_parallel() && run(fn, ctx, items) == 0;
}

#endif
