/* The benchmarks' clock and the memory's read rate: a monotonic clock, and a plain read of a
 * buffer by every thread of the kernels' pool (4 independent 256-bit add chains per thread), the
 * yardstick quant_stream.c and quant_roofline.c measure the kernels against. Included after the
 * kernel source (it uses pool.h's tl_parallel). */
#pragma once
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct { const uint8_t *b; int64_t n; int64_t sums[TL_MAX_THREADS]; } read_job;

static void read_task(void *ctx, int tid, int nthreads) {
    read_job *j = ctx;
    const int64_t per = j->n / nthreads / 128 * 128;
    const __m256i *p = (const __m256i *)(j->b + tid * per);
    __m256i a = _mm256_setzero_si256(), c = a, d = a, e = a;
    for (int64_t i = 0; i < per / 32; i += 4) {
        a = _mm256_add_epi64(a, _mm256_load_si256(p + i));
        c = _mm256_add_epi64(c, _mm256_load_si256(p + i + 1));
        d = _mm256_add_epi64(d, _mm256_load_si256(p + i + 2));
        e = _mm256_add_epi64(e, _mm256_load_si256(p + i + 3));
    }
    int64_t out[4];
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi64(_mm256_add_epi64(a, c), _mm256_add_epi64(d, e)));
    j->sums[tid] = out[0] + out[1] + out[2] + out[3];
}
