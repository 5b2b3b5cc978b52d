/* Single-thread throughput of the AVX2 quantized-linear tile loop (quant.h's q_groups, Q4X8 form
 * of Q4_0/Q4_1) on a weight resident in L2: G int8 MAC/s per core for 1..8 rows. A diagnostic for
 * BENCHMARKS.md ("An AVX2-only day"); it includes the kernel source itself, so it measures exactly
 * what the library runs.
 *
 *   gcc -O3 -march=native -ffp-contract=off -pthread -std=gnu11 -I src/tokenleap/kernels \
 *       benchmarks/quant_tile.c -o /tmp/quant_tile -lm && /tmp/quant_tile 1 2 4 8
 */
#include "kernels_avx2.c"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int64_t in_dim = 576, out_dim = 256, nb = in_dim / 32, gb = q_group_bytes(TLQ_Q4X8);
    uint8_t *w = aligned_alloc(64, out_dim / 8 * nb * gb);
    srand(1);
    for (int64_t i = 0; i < out_dim / 8 * nb * gb; i++) w[i] = (uint8_t)rand();
    for (int64_t g = 0; g < out_dim / 8 * nb; g++) { /* f16 scales d = m = 1.0 (random bits may be NaN) */
        uint16_t *s = (uint16_t *)(w + g * gb);
        for (int k = 0; k < 16; k++) s[k] = 0x3c00;
    }
    for (int a = 1; a < (argc > 1 ? argc : 2); a++) {
        const int rows = argc > 1 ? atoi(argv[a]) : 4;
        if (rows < 1) { fprintf(stderr, "rows must be >= 1, got %s\n", argv[a]); return 2; }
        int8_t *xq = aligned_alloc(64, rows * in_dim);
        float *xd = malloc(rows * nb * 4), *xs = malloc(rows * nb * 4), *y = malloc(rows * out_dim * 4);
        for (int64_t i = 0; i < rows * in_dim; i++) xq[i] = (int8_t)(rand() % 255 - 127);
        for (int64_t i = 0; i < rows * nb; i++) { xd[i] = 0.01f; xs[i] = 0.5f; }
        double best = 1e9;
        for (int rep = 0; rep < 200; rep++) {
            const double t = now();
            for (int it = 0; it < 20; it++) q_groups(xq, xd, xs, w, NULL, y, rows, 0, out_dim / 8, in_dim, out_dim, TLQ_Q4X8, 0);
            const double dt = (now() - t) / 20;
            best = dt < best ? dt : best;
        }
        printf("rows %d: %.2f us per [%ld, %ld] call, %.1f G MAC/s per core\n", rows, best * 1e6, (long)out_dim, (long)in_dim,
               (double)rows * in_dim * out_dim / best / 1e9);
        free(xq); free(xd); free(xs); free(y);
    }
    free(w);
    return 0;
}
