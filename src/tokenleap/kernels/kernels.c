/* tokenleap CPU kernels: row-invariant GEMV-style linear and per-row attention.
 *
 * Every output element is computed by the same instruction sequence whatever the number of
 * rows in the call, so a forward over k+1 draft rows gives bit-identical results to k+1
 * single-row decode steps (DESIGN.md section 6). Weights (bf16 or fp32) are streamed once per
 * call for all rows, so verifying several tokens costs little more than one.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <immintrin.h>
#include <omp.h>

#define RB 4 /* input rows per register block */
#define OB 4 /* output rows per register block */

/* bf16 weights are consumed 32 at a time: one 64-byte load gives the even-indexed weights
 * (low halves shifted up) and the odd-indexed ones (high halves masked), two fp32 vectors for
 * two integer ops. The activations are de-interleaved once per call to match. */
static inline void load_w32(const void *w, int wbits, int64_t off, __m512 *lo, __m512 *hi) {
    if (wbits == 16) {
        __m512i raw = _mm512_loadu_si512((const void *)((const uint16_t *)w + off));
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000)));
    } else {
        *lo = _mm512_loadu_ps((const float *)w + off);
        *hi = _mm512_loadu_ps((const float *)w + off + 16);
    }
}

/* One register block: NR input rows x OB output rows (NR is a compile-time constant after
 * inlining, so the accumulators live in registers). */
static inline __attribute__((always_inline)) void block_rows(
        const float *x, const void *w, const float *b, float *y, int64_t m0, int64_t o0, int NO,
        int64_t in_dim, int64_t out_dim, int wbits, const int NR) {
    __m512 acc[RB][OB];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in_dim; i += 32) {
        __m512 lo[OB], hi[OB];
        for (int j = 0; j < NO; j++) load_w32(w, wbits, (o0 + j) * in_dim + i, &lo[j], &hi[j]);
        for (int r = 0; r < NR; r++) {
            __m512 xl = _mm512_loadu_ps(x + (m0 + r) * in_dim + i);
            __m512 xh = _mm512_loadu_ps(x + (m0 + r) * in_dim + i + 16);
            for (int j = 0; j < NO; j++) {
                acc[r][j] = _mm512_fmadd_ps(xl, lo[j], acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(xh, hi[j], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            float s = _mm512_reduce_add_ps(acc[r][j]);
            if (b) s += b[o0 + j];
            y[(m0 + r) * out_dim + o0 + j] = s;
        }
}

static inline __attribute__((always_inline)) void block_all_rows(
        const float *x, const void *w, const float *b, float *y, int64_t rows, int64_t o0, const int NO,
        int64_t in_dim, int64_t out_dim, int wbits) {
    int64_t m0 = 0;
    for (; m0 + RB <= rows; m0 += RB) block_rows(x, w, b, y, m0, o0, NO, in_dim, out_dim, wbits, RB);
    switch (rows - m0) {
        case 3: block_rows(x, w, b, y, m0, o0, NO, in_dim, out_dim, wbits, 3); break;
        case 2: block_rows(x, w, b, y, m0, o0, NO, in_dim, out_dim, wbits, 2); break;
        case 1: block_rows(x, w, b, y, m0, o0, NO, in_dim, out_dim, wbits, 1); break;
        default: break;
    }
}

#ifdef __AVX512BF16__
/* bf16 weights with AVX512-BF16 dot products: activations are rounded to bf16 once per call
 * (round to nearest even), then each (m, o) accumulates vdpbf16ps over 32-wide chunks of i in
 * order and is reduced with _mm512_reduce_add_ps. One instruction does 32 multiply-adds and the
 * weights need no conversion, so several rows cost little more than one. */
static inline __attribute__((always_inline)) void block_dp(
        const uint16_t *xb, const uint16_t *w, const float *b, float *y, int64_t m0, int64_t o0, int NO,
        int64_t in_dim, int64_t out_dim, const int NR) {
    __m512 acc[RB][OB];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in_dim; i += 32) {
        __m512bh wv[OB];
        for (int j = 0; j < NO; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + (o0 + j) * in_dim + i));
        for (int r = 0; r < NR; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + (m0 + r) * in_dim + i));
            for (int j = 0; j < NO; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            float s = _mm512_reduce_add_ps(acc[r][j]);
            if (b) s += b[o0 + j];
            y[(m0 + r) * out_dim + o0 + j] = s;
        }
}

static inline __attribute__((always_inline)) void block_dp_rows(
        const uint16_t *xb, const uint16_t *w, const float *b, float *y, int64_t rows, int64_t o0, const int NO,
        int64_t in_dim, int64_t out_dim) {
    int64_t m0 = 0;
    for (; m0 + RB <= rows; m0 += RB) block_dp(xb, w, b, y, m0, o0, NO, in_dim, out_dim, RB);
    switch (rows - m0) {
        case 3: block_dp(xb, w, b, y, m0, o0, NO, in_dim, out_dim, 3); break;
        case 2: block_dp(xb, w, b, y, m0, o0, NO, in_dim, out_dim, 2); break;
        case 1: block_dp(xb, w, b, y, m0, o0, NO, in_dim, out_dim, 1); break;
        default: break;
    }
}

static void linear_bf16_dp(const float *x, const uint16_t *w, const float *b, float *y, uint16_t *xb,
                           int64_t rows, int64_t in_dim, int64_t out_dim, int threads) {
    for (int64_t k = 0; k < rows * in_dim; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512((void *)(xb + k), (__m512i)v);
    }
    const int64_t nblocks = out_dim / OB;
    #pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t o0 = blk * OB;
        if (blk + 2 < nblocks) {
            const char *next = (const char *)(w + (o0 + 2 * OB) * in_dim);
            for (int64_t off = 0; off < OB * in_dim * 2; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
        }
        block_dp_rows(xb, w, b, y, rows, o0, OB, in_dim, out_dim);
    }
    for (int64_t o = nblocks * OB; o < out_dim; o++) block_dp_rows(xb, w, b, y, rows, o, 1, in_dim, out_dim);
}
#endif

int tl_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]); x, y fp32; w bf16 (wbits=16) or fp32 (wbits=32).
 * Each (m, o) has one accumulator, filled by FMAs over 32-wide chunks of i in order, then
 * reduced with _mm512_reduce_add_ps: the same arithmetic in every block shape, so a row's
 * result never depends on the other rows. in_dim must be a multiple of 32. `xp` is scratch
 * of rows * in_dim floats. */
void tl_linear(const float *x, const void *w, const float *b, float *y, float *xp,
               int64_t rows, int64_t in_dim, int64_t out_dim, int wbits, int threads) {
#ifdef __AVX512BF16__
    if (wbits == 16) {
        linear_bf16_dp(x, (const uint16_t *)w, b, y, (uint16_t *)xp, rows, in_dim, out_dim, threads);
        return;
    }
#endif
    if (wbits == 16) {
        for (int64_t m = 0; m < rows; m++)
            for (int64_t c = 0; c < in_dim; c += 32)
                for (int t = 0; t < 16; t++) {
                    xp[m * in_dim + c + t] = x[m * in_dim + c + 2 * t];
                    xp[m * in_dim + c + 16 + t] = x[m * in_dim + c + 2 * t + 1];
                }
        x = xp;
    }
    const int64_t nblocks = out_dim / OB;
    const int64_t wbytes = wbits / 8;
    #pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t o0 = blk * OB;
        if (blk + 2 < nblocks) {
            const char *next = (const char *)w + (o0 + 2 * OB) * in_dim * wbytes;
            for (int64_t off = 0; off < OB * in_dim * wbytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
        }
        block_all_rows(x, w, b, y, rows, o0, OB, in_dim, out_dim, wbits);
    }
    for (int64_t o = nblocks * OB; o < out_dim; o++) block_all_rows(x, w, b, y, rows, o, 1, in_dim, out_dim, wbits);
}

/* Attention of `rows` query rows over a KV cache layer.
 * q: [rows, heads, hd]; k, v: [kv_heads, cap, hd] (slot stride hd, head stride cap*hd);
 * row r sees slots slot_idx[slot_off[r] .. slot_off[r+1]) when slot_idx is non-NULL, else
 * slots 0 .. slot_end[r]-1. out: [rows, heads, hd]. scratch: threads * max_slots floats. */
void tl_attention(const float *q, const float *k, const float *v, float *out,
                  int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd, int64_t cap,
                  const int64_t *slot_end, const int64_t *slot_off, const int64_t *slot_idx,
                  float *scratch, int64_t max_slots, int threads) {
    const int64_t group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)hd);
    #pragma omp parallel for schedule(dynamic, 8) num_threads(threads)
    for (int64_t job = 0; job < rows * heads; job++) {
        const int64_t r = job / heads, h = job % heads, kh = h / group;
        float *scores = scratch + (int64_t)omp_get_thread_num() * max_slots;
        const float *qr = q + (r * heads + h) * hd;
        const float *kbase = k + kh * cap * hd, *vbase = v + kh * cap * hd;
        int64_t n = slot_idx ? slot_off[r + 1] - slot_off[r] : slot_end[r];
        const int64_t *idx = slot_idx ? slot_idx + slot_off[r] : NULL;
        float mx = -FLT_MAX;
        for (int64_t j = 0; j < n; j++) {
            const float *kj = kbase + (idx ? idx[j] : j) * hd;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < hd; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kj + d), acc);
            float s = _mm512_reduce_add_ps(acc) * scale;
            scores[j] = s;
            if (s > mx) mx = s;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) { float e = expf(scores[j] - mx); scores[j] = e; sum += e; }
        const float inv = 1.0f / sum;
        float *o = out + (r * heads + h) * hd;
        for (int64_t d = 0; d < hd; d += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const float *vj = vbase + (idx ? idx[j] : j) * hd;
                acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), _mm512_loadu_ps(vj + d), acc);
            }
            _mm512_storeu_ps(o + d, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
        }
    }
}
