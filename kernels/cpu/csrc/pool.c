/* A pool of helper threads that the native kernels of a process share for their many-row
 * work (CPU), in place of an OpenMP region per call.
 *
 * Why: under the worker's passive waits an OpenMP region wakes its sleeping threads, and
 * the region's closing barrier waits for every one of them to have woken and checked in,
 * even one that found no work left: some 90 us on a 2-core VM, where a 64-row decode step
 * of SmolLM2-135M opens about 150 regions (four projections and the attention a layer).
 * Here the calling thread takes items itself from the start and returns as soon as every
 * item is done; a helper that has not woken yet takes none and is not waited for. A helper
 * spins for a while after its last item (SPIN_NS, as decode_layers.c's threads do between
 * a step's pieces), so the next call of the same step finds it awake, then sleeps on a
 * futex: between steps it costs nothing.
 *
 * One call runs at a time (a second caller, another thread, runs its items alone). Items
 * are claimed through one 64-bit word, the call's generation in the high half and the next
 * item in the low, so a helper that read another call's fields claims nothing with them
 * (unless it slept through 2^32 calls, days of serving, between reading and claiming).
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define MOST_HELPERS (MOST_WORKERS - 1)

#define SPIN_NS 200000

static _Atomic(pool_item_fn) job_fn;
static _Atomic(void *) job_ctx;
static _Atomic int64_t job_items;
static _Atomic int64_t job_done;
static _Atomic uint64_t ticket;     /* generation << 32 | next item */
static _Atomic uint32_t generation; /* the futex word helpers sleep on */
static _Atomic int sleepers;
static _Atomic int helpers_running;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t starting = PTHREAD_MUTEX_INITIALIZER;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Runs items of generation `gen` until none is left to claim. */
static void work(uint32_t gen, pool_item_fn fn, void *ctx, int64_t items, int worker) {
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        if ((uint32_t)(t >> 32) != gen || (int64_t)(uint32_t)t >= items) return;
        if (!atomic_compare_exchange_weak(&ticket, &t, t + 1)) continue;
        fn(ctx, (int64_t)(uint32_t)t, worker);
        atomic_fetch_add(&job_done, 1);
        t = atomic_load(&ticket);
    }
}

static void *helper(void *arg) {
    const int worker = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&generation);
    for (;;) {
        uint64_t deadline = now_ns() + SPIN_NS;
        for (unsigned spins = 1; atomic_load(&generation) == seen; spins++) {
            if (spins % 256 == 0 && now_ns() > deadline) {
                /* Counted before the word is read again: the caller either sees the sleeper
                 * and wakes it, or changed the word first, and the wait returns at once. */
                atomic_fetch_add(&sleepers, 1);
                while (atomic_load(&generation) == seen)
                    syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                break;
            }
            /* A polite spin: a thread waiting for this core (the step's next operation may
             * be torch's, on OpenMP's threads) gets it at once. */
            if (spins % 64 == 0) sched_yield();
            spin_pause();
        }
        seen = atomic_load(&generation);
        /* The call of generation `seen`, or fields a newer call is writing: then that call
         * closed the ticket first, and every claim fails. */
        work(seen, atomic_load(&job_fn), atomic_load(&job_ctx), atomic_load(&job_items), worker);
    }
    return NULL;
}

/* Starts helpers until `count` run (at most MOST_HELPERS; they live as long as the
 * process). Returns how many run. A new thread takes its creator's float mode, so the
 * worker starts them from its step thread (denormals flushed there). */
int pool_start(int count) {
    if (count > MOST_HELPERS) count = MOST_HELPERS;
    pthread_mutex_lock(&starting);
    int running = atomic_load(&helpers_running);
    while (running < count) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper, (void *)(intptr_t)(running + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        atomic_store(&helpers_running, ++running);
    }
    pthread_mutex_unlock(&starting);
    return running;
}

int pool_helpers(void) { return atomic_load(&helpers_running); }

/* fn(ctx, i, worker) for every item i < items, each once, on this thread (worker 0) and
 * any helper (workers 1 ..) that comes for them; returns when all are done. 0, or -1 when
 * items does not fit the claim word (more than 2^32 - 1: the caller runs them itself). */
int pool_run(pool_item_fn fn, void *ctx, int64_t items) {
    if (items <= 0) return 0;
    if (items >= (int64_t)UINT32_MAX) return -1;
    if (atomic_load(&helpers_running) == 0 || items == 1 || pthread_mutex_trylock(&caller) != 0) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i, 0);
        return 0;
    }
    const uint32_t gen = atomic_load(&generation) + 1;
    /* Closed first (no item claimable, and a helper still holding the last call's function
     * finds the generation changed), then the call written, then opened. Sequentially
     * consistent throughout: a helper whose claim succeeds read this call's fields. */
    atomic_store(&ticket, (uint64_t)gen << 32 | UINT32_MAX);
    atomic_store(&job_fn, fn);
    atomic_store(&job_ctx, ctx);
    atomic_store(&job_items, items);
    atomic_store(&job_done, 0);
    atomic_store(&ticket, (uint64_t)gen << 32);
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0)
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(gen, fn, ctx, items, 0);
    /* Only items a helper has claimed and not finished are left: wait for those, giving
     * the core away now and then in case that helper is the one waiting for it. */
    for (unsigned spins = 1; atomic_load(&job_done) < items; spins++) {
        if (spins % 1024 == 0) sched_yield();
        spin_pause();
    }
    pthread_mutex_unlock(&caller);
    return 0;
}
