/* The shared helper threads' interface (`pool.c`), for the kernels that take them: a
 * kernel keeps a `pool_run_fn` its caller hands in and runs its items through it. */
#ifndef SPILLWAY_POOL_H
#define SPILLWAY_POOL_H
#include <stdint.h>

/* Item `item` of a call, on worker `worker` (0 the calling thread, 1 .. the helpers; less
 * than MOST_WORKERS: a kernel may keep per-worker scratch in an array of that many). */
typedef void (*pool_item_fn)(void *ctx, int64_t item, int worker);
typedef int (*pool_run_fn)(pool_item_fn fn, void *ctx, int64_t items);
#define MOST_WORKERS 64

#endif
