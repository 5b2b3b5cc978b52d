/* tokenleap kernels: the thread pool shared by every instruction-set variant (kernels.c for
 * AVX-512, kernels_avx2.c for AVX2 + FMA). Included once per variant; everything is static. */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <immintrin.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------
 * Thread pool. A decode step makes ~150 kernel calls a few microseconds apart; an OpenMP
 * runtime either sleeps between them (OMP_WAIT_POLICY=passive: a futex wake-up per call,
 * measured +70 % per token here) or spins (fast alone, but 3-5x slower as soon as another
 * process wants the cores, because a spinning thread holds its core for a whole time slice).
 * This pool's workers spin briefly, then yield the core on each check (free when nobody else
 * wants it, polite when someone does), then sleep on a futex once idle. One job at a time:
 * callers from several threads are serialized by a mutex. */
#define TL_MAX_THREADS 64
#define TL_SPIN 1000   /* pause-spins before yielding (~25 us) */
#define TL_YIELDS 2000 /* sched_yield checks before sleeping (~1 ms when alone) */

typedef void (*tl_task)(void *ctx, int tid, int nthreads);

static struct {
    int n; /* threads including the caller; 1 until tl_init */
    _Atomic uint32_t gen; /* futex word, bumped per job */
    _Atomic int pending; /* workers yet to finish the current job */
    _Atomic int sleepers;
    tl_task fn;
    void *ctx;
    pthread_mutex_t lock; /* one job at a time */
} pool = {.n = 1, .lock = PTHREAD_MUTEX_INITIALIZER};

static void pool_wait_change(_Atomic uint32_t *word, uint32_t old) {
    for (int i = 0; i < TL_SPIN; i++) {
        if (atomic_load(word) != old) return;
        _mm_pause();
    }
    for (int i = 0; i < TL_YIELDS; i++) {
        if (atomic_load(word) != old) return;
        sched_yield();
    }
    atomic_fetch_add(&pool.sleepers, 1);
    while (atomic_load(word) == old) syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
    atomic_fetch_sub(&pool.sleepers, 1);
}

static uint32_t pool_start_gen; /* the job generation when the workers were created */

static void *pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    const char *delay = getenv("TOKENLEAP_POOL_START_DELAY_US"); /* tests: a worker that starts late */
    if (delay) usleep((useconds_t)atoi(delay));
    /* Not a fresh load of pool.gen: the caller may have posted its first job before this
     * thread ran, and a worker that took that job's generation as "seen" would sleep through
     * it while the caller waits for it forever. */
    uint32_t seen = pool_start_gen;
    for (;;) {
        pool_wait_change(&pool.gen, seen);
        seen = atomic_load(&pool.gen);
        pool.fn(pool.ctx, tid, pool.n);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

static void pool_after_fork_child(void) { pool.n = 1; } /* the workers did not survive the fork */

/* Start the workers (threads - 1 of them; the caller is thread 0). Idempotent. */
int tl_init(int threads) {
    pthread_mutex_lock(&pool.lock);
    if (pool.n == 1 && threads > 1) {
        static int atfork = 0;
        if (!atfork) { pthread_atfork(NULL, NULL, pool_after_fork_child); atfork = 1; }
        if (threads > TL_MAX_THREADS) threads = TL_MAX_THREADS;
        int started = 1;
        pool_start_gen = atomic_load(&pool.gen); /* no job runs while we hold the lock */
        for (int t = 1; t < threads; t++) {
            pthread_t th;
            if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)t) != 0) break;
            pthread_detach(th);
            started++;
        }
        pool.n = started;
    }
    const int n = pool.n;
    pthread_mutex_unlock(&pool.lock);
    return n;
}

/* Run fn(ctx, tid, n) on every pool thread (tid 0 is the caller) and wait for all. */
static void tl_parallel(tl_task fn, void *ctx) {
    pthread_mutex_lock(&pool.lock);
    if (pool.n <= 1) {
        fn(ctx, 0, 1);
        pthread_mutex_unlock(&pool.lock);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.pending, pool.n - 1);
    atomic_fetch_add(&pool.gen, 1);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    fn(ctx, 0, pool.n);
    for (int i = 0; atomic_load(&pool.pending) > 0; i++) {
        if (i < TL_SPIN) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

/* Dynamic scheduling over [0, count) in chunks: each thread takes the next chunk. */
typedef struct { _Atomic int64_t next; int64_t count, chunk; } tl_counter;
static inline int64_t tl_next(tl_counter *c, int64_t *end) {
    const int64_t start = atomic_fetch_add(&c->next, c->chunk);
    *end = start + c->chunk < c->count ? start + c->chunk : c->count;
    return start;
}
/* Guided scheduling (OpenMP's "guided"): each grab takes 1/(2n) of the chunks left, at least
 * c->chunk, so each thread's first runs are long (its weight stream unbroken) and the last ones
 * short, and the threads finish together (with grabs of an eighth of the call each, one idled
 * up to a whole grab at its end: small linears, Qwen2.5-0.5B's [1152, 896], took 0.86-0.95x the
 * time guided; decode 1.003-1.016x on AVX-512, 0.99-1.00x on AVX2: `benchmarks/prefill_ab.py
 * --decode`) */
static inline int64_t tl_next_guided(tl_counter *c, int64_t *end, int n) {
    int64_t start = atomic_load(&c->next);
    for (;;) {
        if (start >= c->count) {
            *end = c->count;
            return start;
        }
        int64_t size = (c->count - start) / (2 * (int64_t)n);
        if (size < c->chunk) size = c->chunk;
        if (atomic_compare_exchange_weak(&c->next, &start, start + size)) {
            *end = start + size < c->count ? start + size : c->count;
            return start;
        }
    }
}

