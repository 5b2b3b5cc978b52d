/* The quantized linears' roofline, one core: how long tl_linear_q (the library's own kernel
 * source) takes per call for 1..R rows with its weights resident in cache (L2-sized, reused
 * call after call: the compute time), and with them streamed from memory (a new copy each
 * call, 128 MB of copies: what a forward sees), against how long a plain read of the same bytes
 * from memory takes on one core while the other core reads too (the decode's situation). A row
 * count whose in-cache time is under the memory time is free: verifying that many rows costs
 * what one row costs, if the cold run keeps up.
 * Driven by benchmarks/quant_roofline.py, which builds it per ISA:
 *
 *   gcc -O3 -march=native -ffp-contract=off -pthread -std=gnu11 -I src/tokenleap/kernels \
 *       -DKERNELS_SOURCE='"kernels_avx2.c"' benchmarks/quant_roofline.c -o /tmp/quant_roofline -lm
 *   /tmp/quant_roofline FORMAT OUT IN ROWS...   (FORMAT: quant.h's TLQ_* kernel format)
 *
 * Prints "read_gbps_per_core R" (two threads reading 256 MB, best of 5, halved), then one line
 * per row count: "rows N hot_ns H cold_ns C bytes B" (hot: best of 31 rounds of 50 calls; cold:
 * best of 3 passes over the copies, per call). */
#include KERNELS_SOURCE
#include "read_rate.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s FORMAT OUT IN ROWS...\n", argv[0]);
        return 2;
    }
    const int fmt = atoi(argv[1]);
    const int64_t out_dim = atoll(argv[2]), in_dim = atoll(argv[3]);
    const int kq = q_is_k(fmt) || fmt == TLQ_Q3K || fmt == TLQ_Q2K || fmt == TLQ_IQ4XS;
    if (!tl_quant_group_bytes(fmt) || out_dim % 8 || in_dim % (kq ? 256 : 32)) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    tl_init(2);
    const int64_t rn = (int64_t)256 << 20;
    uint8_t *rb = aligned_alloc(64, (size_t)rn);
    for (int64_t i = 0; i < rn; i++) rb[i] = (uint8_t)i;
    double best_read = 1e30;
    for (int r = 0; r < 5; r++) {
        read_job j = {rb, rn, {0}};
        const double t = now();
        tl_parallel(read_task, &j);
        const double dt = now() - t;
        if (dt < best_read) best_read = dt;
    }
    free(rb);
    printf("read_gbps_per_core %.4f\n", rn / best_read / 1e9 / 2);
    pool.n = 1; /* one core for the kernel's timings: tl_init only grows the pool (before 2026-11-28 this
                 * called tl_init(1), which left both threads running the timed calls) */
    tl_quant_vnni(-1);
    const int64_t bytes = out_dim / 8 * (in_dim / 32) * q_group_bytes(fmt), stride = (bytes + 63) / 64 * 64;
    const int64_t copies = ((int64_t)128 << 20) / stride > 2 ? ((int64_t)128 << 20) / stride : 2;
    uint8_t *w = aligned_alloc(64, (size_t)(stride * copies));
    for (int64_t i = 0; i < bytes; i++) w[i] = (uint8_t)((uint64_t)i * 2654435761u >> 13);
    /* f16 factors 1.0 where each format keeps them (random bits may be NaN or inf) */
    const int64_t nblk = kq ? in_dim / 256 : in_dim / 32, blk = kq ? 8 * q_group_bytes(fmt) : q_group_bytes(fmt);
    const int nf = fmt == TLQ_Q4K || fmt == TLQ_Q5K || fmt == TLQ_Q4X8 || fmt == TLQ_Q2K ? 16 : 8;
    for (int64_t g = 0; g < out_dim / 8 * nblk; g++) {
        uint16_t *s = (uint16_t *)(w + g * blk);
        for (int k = 0; k < nf; k++) s[k] = 0x3c00;
    }
    for (int64_t c = 1; c < copies; c++) memcpy(w + c * stride, w, (size_t)bytes);
    for (int a = 4; a < argc; a++) {
        const int rows = atoi(argv[a]);
        if (rows < 1 || rows > 64) { fprintf(stderr, "rows must be in 1..64, got %s\n", argv[a]); return 2; }
        float *x = malloc(sizeof(float) * rows * in_dim), *y = malloc(sizeof(float) * rows * out_dim);
        for (int64_t i = 0; i < rows * in_dim; i++) x[i] = (float)((i * 7919) % 1000 - 500) / 300.0f;
        uint8_t *scratch = aligned_alloc(64, (size_t)((8 * rows * in_dim + 4095) / 4096 * 4096));
        double best = 1e30;
        for (int round = 0; round < 31; round++) {
            const double t = now();
            for (int it = 0; it < 50; it++) tl_linear_q(x, NULL, 0, 0, scratch, w, fmt, NULL, y, rows, in_dim, out_dim, 0);
            const double dt = (now() - t) / 50;
            if (dt < best) best = dt;
        }
        double cold = 1e30;
        for (int pass = 0; pass < 3; pass++) {
            const double t = now();
            for (int64_t c = 0; c < copies; c++) tl_linear_q(x, NULL, 0, 0, scratch, w + c * stride, fmt, NULL, y, rows, in_dim, out_dim, 0);
            const double dt = (now() - t) / copies;
            if (dt < cold) cold = dt;
        }
        printf("rows %d hot_ns %.1f cold_ns %.1f bytes %lld\n", rows, best * 1e9, cold * 1e9, (long long)bytes);
        free(x); free(y); free(scratch);
    }
    return 0;
}
