/* A decode's quantized linears as the memory sees them: one row through a sequence of distinct
 * cold weights of one shape (tl_linear_q, the library's own kernel source, 2 threads), then a
 * plain two-thread read of 256 MB in the same moment, so the kernel's rate is given as a
 * fraction of what the memory delivered just then (the host's bandwidth swings ~30-55 GB/s
 * within minutes). Driven by benchmarks/quant_stream.py, which builds it per kernel revision:
 *
 *   gcc -O3 -march=native -ffp-contract=off -pthread -std=gnu11 -I src/tokenleap/kernels \
 *       benchmarks/quant_stream.c -o /tmp/quant_stream -lm
 *   /tmp/quant_stream FORMAT OUT IN MB REPS ROWS THREADS   (FORMAT: quant.h's TLQ_Q4K = 5, ...)
 *
 * Prints one line: "gbps G read R ratio G/R us_per_call U" (best of REPS for both). */
#include KERNELS_SOURCE
#include "read_rate.h"
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

int main(int argc, char **argv) {
    if (argc != 8 && argc != 9) {
        fprintf(stderr, "usage: %s FORMAT OUT IN MB REPS ROWS THREADS [HUGE]\n", argv[0]);
        return 2;
    }
    const int fmt = atoi(argv[1]), reps = atoi(argv[5]), rows = atoi(argv[6]);
    const int64_t out_dim = atoll(argv[2]), in_dim = atoll(argv[3]);
    const double mb = atof(argv[4]);
    const int kq = fmt == TLQ_Q4K || fmt == TLQ_Q5K || fmt == TLQ_Q6K;
    if (!tl_quant_group_bytes(fmt) || out_dim % 8 || in_dim % (kq ? 256 : 32) || reps < 1 || rows < 1 || rows > 64) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    tl_init(atoi(argv[7]));
    tl_quant_vnni(-1);
    /* a group's bytes: per block of 32 (32-input formats) or superblock of 256 (K-quants) */
    const int64_t nblk = kq ? in_dim / 256 : in_dim / 32, blk = kq ? 8 * q_group_bytes(fmt) : q_group_bytes(fmt);
    const int64_t bytes = out_dim / 8 * nblk * blk;
    const int64_t nw = mb * 1e6 / bytes > 1 ? (int64_t)(mb * 1e6 / bytes) : 1;
    const size_t wsize = (size_t)((bytes * nw + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    uint8_t *w = aligned_alloc(2 << 20, wsize);
    /* HUGE 1: the weights on transparent huge pages (as the library's weight arena), else 4 KiB pages */
    madvise(w, wsize, argc == 9 && atoi(argv[8]) ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (int64_t i = 0; i < bytes * nw; i++) w[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    for (int64_t g = 0; g < out_dim / 8 * nblk * nw; g++) { /* f16 factors 1.0 (random bits may be NaN) */
        uint16_t *s = (uint16_t *)(w + g * blk);
        for (int k = 0; k < (fmt == TLQ_Q4K || fmt == TLQ_Q5K || fmt == TLQ_Q4X8 ? 16 : 8); k++) s[k] = 0x3c00;
    }
    const int64_t rn = (int64_t)256 << 20;
    uint8_t *rb = aligned_alloc(64, (size_t)rn);
    for (int64_t i = 0; i < rn; i++) rb[i] = (uint8_t)i;
    float *x = malloc(sizeof(float) * rows * in_dim), *y = malloc(sizeof(float) * rows * out_dim);
    for (int64_t i = 0; i < rows * in_dim; i++) x[i] = (float)((i * 7919) % 1000 - 500) / 300.0f;
    uint8_t *scratch = aligned_alloc(64, (size_t)((8 * rows * in_dim + 4095) / 4096 * 4096));
    double best = 1e30, best_read = 1e30;
    for (int r = 0; r < reps; r++) {
        double t = now();
        for (int64_t k = 0; k < nw; k++) tl_linear_q(x, NULL, 0, 0, scratch, w + k * bytes, fmt, NULL, y, rows, in_dim, out_dim, 0);
        double dt = now() - t;
        if (dt < best) best = dt;
        read_job j = {rb, rn, {0}};
        t = now();
        tl_parallel(read_task, &j);
        dt = now() - t;
        if (dt < best_read) best_read = dt;
    }
    const double gbps = bytes * nw / best / 1e9, read = rn / best_read / 1e9;
    printf("gbps %.4f read %.4f ratio %.6f us_per_call %.1f\n", gbps, read, gbps / read, best / nw * 1e6);
    return 0;
}
