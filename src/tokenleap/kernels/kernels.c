/* tokenleap CPU kernels: row-invariant GEMV-style linear and per-row attention.
 *
 * Every output element is computed by the same instruction sequence whatever the number of
 * rows in the call, so a forward over k+1 draft rows gives bit-identical results to k+1
 * single-row decode steps (ARCHITECTURE.md, "The exactness contract"). Weights (bf16 or fp32) are streamed once per
 * call for all rows, so verifying several tokens costs little more than one.
 */
#include "pool.h"
#include "rope.h"
#include "norms.h"

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

typedef struct {
    tl_counter ctr;
    const uint16_t *xb, *w;
    const float *b;
    float *y;
    int64_t rows, in_dim, out_dim;
} dp_job;

static void dp_task(void *ctx, int tid, int nthreads) {
    dp_job *j = (dp_job *)ctx;
    (void)tid; (void)nthreads;
    int64_t end;
    for (int64_t blk = tl_next(&j->ctr, &end); blk < j->ctr.count; blk = tl_next(&j->ctr, &end))
        for (; blk < end; blk++) {
            const int64_t o0 = blk * OB;
            if (blk + 2 < j->ctr.count) {
                const char *next = (const char *)(j->w + (o0 + 2 * OB) * j->in_dim);
                for (int64_t off = 0; off < OB * j->in_dim * 2; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
            }
            block_dp_rows(j->xb, j->w, j->b, j->y, j->rows, o0, OB, j->in_dim, j->out_dim);
        }
}

static void linear_bf16_dp(const float *x, const uint16_t *w, const float *b, float *y, uint16_t *xb,
                           int64_t rows, int64_t in_dim, int64_t out_dim) {
    for (int64_t k = 0; k < rows * in_dim; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512((void *)(xb + k), (__m512i)v);
    }
    dp_job job = {{0, out_dim / OB, 8}, xb, w, b, y, rows, in_dim, out_dim};
    tl_parallel(dp_task, &job);
    for (int64_t o = job.ctr.count * OB; o < out_dim; o++) block_dp_rows(xb, w, b, y, rows, o, 1, in_dim, out_dim);
}
#endif

#ifdef __AVX512BF16__
/* Packed bf16 weights, output-interleaved: block b holds outputs 16b..16b+15 as
 * [in/2][16][2] (for each input pair p, the pair (w[o][2p], w[o][2p+1]) of each of the 16
 * outputs), so one 64-byte load feeds one vdpbf16ps that advances 16 outputs by two inputs,
 * with the input pair broadcast from the activations. No horizontal reductions: output o's
 * accumulator takes the pairs p = 0, 1, ... in order, whatever the tile shape, so a row's
 * result is the same in any call. A tile is NR rows x NB blocks of accumulators. */
#define PR 8 /* at most this many rows per packed tile (then at most 3 blocks: 24 accumulators) */
#define PB 4 /* at most this many 16-output blocks per packed tile (then at most 4 rows) */
#ifndef PF_DIST
#define PF_DIST 16
#endif

static inline __attribute__((always_inline)) void packed_tile(
        const uint32_t *xp, const uint16_t *wp, const float *b, float *y, int64_t m0, int64_t blk0,
        int64_t half_in, int64_t out_dim, int accumulate, const int NR, const int NB) {
    __m512 acc[PR][PB];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *wt = wp + blk0 * half_in * 32;
    for (int64_t p = 0; p < half_in; p++) {
        __m512bh wv[PB];
        for (int j = 0; j < NB; j++) {
            _mm_prefetch((const char *)(wt + (j * half_in + p + PF_DIST) * 32), _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(wt + (j * half_in + p) * 32));
        }
        for (int r = 0; r < NR; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[(m0 + r) * half_in + p]);
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NB; j++) {
            __m512 v = acc[r][j];
            if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + (blk0 + j) * 16));
            float *dst = y + (m0 + r) * out_dim + (blk0 + j) * 16;
            if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(dst), v);
            _mm512_storeu_ps(dst, v);
        }
}

#define PACKED_NB4(NR_)                                                                                 \
    switch (nb) {                                                                                       \
        case 4: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 4); break;       \
        case 3: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 3); break;       \
        case 2: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 2); break;       \
        default: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 1); break;      \
    }
#define PACKED_NB3(NR_)                                                                                 \
    switch (nb) {                                                                                       \
        case 3: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 3); break;       \
        case 2: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 2); break;       \
        default: packed_tile(xp, wp, b, y, m0, blk, half_in, out_dim, accumulate, NR_, 1); break;      \
    }

/* Tiles of up to 4 rows x 4 blocks for calls of up to 4 rows (decode: the weights stream from
 * memory once), else up to 8 rows x 3 blocks (verification, batches: twice the arithmetic per
 * weight load, and the weights of a tile stream from memory once per 8 rows). */
static void packed_blocks(const uint32_t *xp, const uint16_t *wp, const float *b, float *y, int64_t rows,
                          int64_t blk_lo, int64_t blk_hi, int64_t half_in, int64_t out_dim, int accumulate) {
    const int wide = rows > 4;
    const int64_t tile_blocks = wide ? 3 : 4, tile_rows = wide ? 8 : 4;
    for (int64_t blk = blk_lo; blk < blk_hi; blk += tile_blocks) {
        const int nb = (int)(blk_hi - blk < tile_blocks ? blk_hi - blk : tile_blocks);
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
            switch (rows - m0 < tile_rows ? rows - m0 : tile_rows) {
                case 8: PACKED_NB3(8); break;
                case 7: PACKED_NB3(7); break;
                case 6: PACKED_NB3(6); break;
                case 5: PACKED_NB3(5); break;
                case 4: PACKED_NB4(4); break;
                case 3: PACKED_NB4(3); break;
                case 2: PACKED_NB4(2); break;
                default: PACKED_NB4(1); break;
            }
        }
    }
}

typedef struct {
    const uint32_t *xp;
    const uint16_t *wp;
    const float *b;
    float *y;
    int64_t rows, nblk, half_in, out_dim;
    int accumulate;
} packed_job;

static void packed_task(void *ctx, int t, int nt) {
    const packed_job *j = (const packed_job *)ctx;
    packed_blocks(j->xp, j->wp, j->b, j->y, j->rows, j->nblk * t / nt, j->nblk * (t + 1) / nt, j->half_in, j->out_dim, j->accumulate);
}

/* y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]) with w packed as above (out_dim a multiple of 16,
 * in_dim a multiple of 32); with `accumulate`, y[m, o] += that sum (a fused residual add).
 * The activations are rounded to bf16 (nearest even) into `xb` (rows * in_dim halves); the
 * output blocks are split into one contiguous range per thread. */
void tl_linear_packed(const float *x, const uint16_t *wp, const float *b, float *y, uint16_t *xb,
                      int64_t rows, int64_t in_dim, int64_t out_dim, int accumulate) {
    for (int64_t k = 0; k < rows * in_dim; k += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
        _mm512_storeu_si512((void *)(xb + k), (__m512i)v);
    }
    packed_job job = {(const uint32_t *)xb, wp, b, y, rows, out_dim / 16, in_dim / 2, out_dim, accumulate};
    tl_parallel(packed_task, &job);
}
#endif

int tl_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* What this build offers beyond tl_linear / tl_attention: 1 = tl_linear_packed (PackedWeight),
 * 2 = tl_attention_bf16 (the blocked bf16 KV cache). */
int tl_features(void) {
#ifdef __AVX512BF16__
    return 3;
#else
    return 0;
#endif
}

typedef struct {
    tl_counter ctr;
    const float *x;
    const void *w;
    const float *b;
    float *y;
    int64_t rows, in_dim, out_dim;
    int wbits;
} lin_job;

static void lin_task(void *ctx, int tid, int nthreads) {
    lin_job *j = (lin_job *)ctx;
    (void)tid; (void)nthreads;
    const int64_t wbytes = j->wbits / 8;
    int64_t end;
    for (int64_t blk = tl_next(&j->ctr, &end); blk < j->ctr.count; blk = tl_next(&j->ctr, &end))
        for (; blk < end; blk++) {
            const int64_t o0 = blk * OB;
            if (blk + 2 < j->ctr.count) {
                const char *next = (const char *)j->w + (o0 + 2 * OB) * j->in_dim * wbytes;
                for (int64_t off = 0; off < OB * j->in_dim * wbytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
            }
            block_all_rows(j->x, j->w, j->b, j->y, j->rows, o0, OB, j->in_dim, j->out_dim, j->wbits);
        }
}

/* y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]); x, y fp32; w bf16 (wbits=16) or fp32 (wbits=32).
 * Each (m, o) has one accumulator, filled by FMAs over 32-wide chunks of i in order, then
 * reduced with _mm512_reduce_add_ps: the same arithmetic in every block shape, so a row's
 * result never depends on the other rows. in_dim must be a multiple of 32. `xp` is scratch
 * of rows * in_dim floats. */
void tl_linear(const float *x, const void *w, const float *b, float *y, float *xp,
               int64_t rows, int64_t in_dim, int64_t out_dim, int wbits) {
#ifdef __AVX512BF16__
    if (wbits == 16) {
        linear_bf16_dp(x, (const uint16_t *)w, b, y, (uint16_t *)xp, rows, in_dim, out_dim);
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
    lin_job job = {{0, out_dim / OB, 8}, x, w, b, y, rows, in_dim, out_dim, wbits};
    tl_parallel(lin_task, &job);
    for (int64_t o = job.ctr.count * OB; o < out_dim; o++) block_all_rows(x, w, b, y, rows, o, 1, in_dim, out_dim, wbits);
}

/* exp(x) as 16 lanes (underflows to 0 below -87.3, overflows to inf): Cephes' expf (range reduction by ln 2, degree-6 polynomial,
 * about 1 ulp), scaled by 2^n with vscalefps. Deterministic, so attention stays row-invariant. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* Sums each of 16 vectors v[0..15] into lane j of the result, by one fixed shuffle tree
 * (the same tree for every lane, so a slot's score never depends on its neighbours). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

/* One attention job: query row r, the G heads h0..h0+G-1 that share kv head kh, ND 16-wide
 * chunks of head_dim. K and V are streamed once for the G heads (they are shared under GQA).
 * Per head: scores 16 slots at a time (per-slot partial dot products summed by hsum16),
 * softmax with exp16, then P.V over the slots in order. The arithmetic of a (row, head) is
 * the same whatever G, the job split or the other rows are. */
static inline __attribute__((always_inline)) void attn_job(
        const float *q, const float *kbase, const float *vbase, float *out, int64_t r, int64_t h0,
        int64_t heads, int64_t n, const int64_t *idx, float *scores, int64_t max_slots, float scale,
        const int G, const int ND) {
    const int64_t hd = ND * 16;
    __m512 mxv[G];
    for (int g = 0; g < G; g++) mxv[g] = _mm512_set1_ps(-FLT_MAX);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t cnt = n - j0 < 16 ? n - j0 : 16;
        const __mmask16 valid = (__mmask16)((1u << cnt) - 1u);
        for (int g = 0; g < G; g++) {
            const float *qr = q + (r * heads + h0 + g) * hd;
            __m512 acc[16];
            for (int64_t t = 0; t < 16; t++) {
                acc[t] = _mm512_setzero_ps();
                if (t < cnt) {
                    const float *kj = kbase + (idx ? idx[j0 + t] : j0 + t) * hd;
                    for (int d = 0; d < ND; d++)
                        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d * 16), _mm512_loadu_ps(kj + d * 16), acc[t]);
                }
            }
            __m512 sv = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
            sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX), sv);
            _mm512_storeu_ps(scores + g * max_slots + j0, sv);
            mxv[g] = _mm512_max_ps(mxv[g], sv);
        }
    }
    float inv[G];
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * max_slots;
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv[g]));
        __m512 sumv = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const __mmask16 valid = (__mmask16)((1u << (n - j0 < 16 ? n - j0 : 16)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j0), mx)));
            _mm512_storeu_ps(sc + j0, e);
            sumv = _mm512_add_ps(sumv, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sumv);
    }
    __m512 o[G][ND];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < ND; d++) o[g][d] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *vj = vbase + (idx ? idx[j] : j) * hd;
        for (int d = 0; d < ND; d++) {
            const __m512 vv = _mm512_loadu_ps(vj + d * 16);
            for (int g = 0; g < G; g++) o[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * max_slots + j]), vv, o[g][d]);
        }
    }
    for (int g = 0; g < G; g++) {
        float *orow = out + (r * heads + h0 + g) * hd;
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(orow + d * 16, _mm512_mul_ps(o[g][d], _mm512_set1_ps(inv[g])));
    }
}

/* y = x / rms(x) * w per row (RMSNorm, Zhang & Sennrich 2019), fp32; one pass per row. */
void tl_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 16)
            _mm512_storeu_ps(y + r * dim + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), scale), _mm512_loadu_ps(w + i)));
    }
}

/* SwiGLU's gating: y[r, i] = silu(gu[r, i]) * gu[r, f + i], gu = [rows, 2f] (gate | up). */
void tl_silu_mul(const float *gu, float *y, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i += 16) {
            const __m512 g = _mm512_loadu_ps(gu + r * 2 * f + i), u = _mm512_loadu_ps(gu + r * 2 * f + f + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(y + r * f + i, _mm512_mul_ps(silu, u));
        }
}

/* GeGLU's gating (Gemma): y[r, i] = gelu_tanh(gu[r, i]) * gu[r, f + i], gu = [rows, 2f]. The
 * tanh form 0.5 g (1 + tanh(k)), k = sqrt(2 / pi) (g + 0.044715 g^3), is g / (1 + exp(-2k)):
 * silu's shape with exp16 (1-2 ulp from torch's gelu(approximate="tanh")); large |g| give g or -0. */
void tl_gelu_mul(const float *gu, float *y, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i += 16) {
            const __m512 g = _mm512_loadu_ps(gu + r * 2 * f + i), u = _mm512_loadu_ps(gu + r * 2 * f + f + i);
            const __m512 z = _mm512_mul_ps(g, _mm512_fmadd_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(TL_GELU_B), _mm512_set1_ps(TL_GELU_A)));
            const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(z)));
            _mm512_storeu_ps(y + r * f + i, _mm512_mul_ps(gelu, u));
        }
}


typedef struct {
    tl_counter ctr;
    const float *qrot;
    float *out;
    const int64_t *kv_base, *cap, *slot_end, *slot_off, *slot_idx;
    float *scratch;
    int64_t layer, heads, kv_heads, hd, max_slots, span; /* span: heads per job (1 or group) */
    float scale;
} attn_ctx;

static void attn_task(void *arg, int tid, int nthreads) {
    attn_ctx *a = (attn_ctx *)arg;
    (void)nthreads;
    const int64_t group = a->heads / a->kv_heads, hd = a->hd, jobs_per_row = a->heads / a->span;
    float *scores = a->scratch + (int64_t)tid * 4 * a->max_slots;
    int64_t end;
    for (int64_t job = tl_next(&a->ctr, &end); job < a->ctr.count; job = tl_next(&a->ctr, &end))
        for (; job < end; job++) {
            const int64_t r = job / jobs_per_row, h_first = (job % jobs_per_row) * a->span, kh = h_first / group;
            const int64_t plane = a->kv_heads * a->cap[r] * hd;
            const float *kbase = (const float *)a->kv_base[r] + a->layer * 2 * plane + kh * a->cap[r] * hd;
            const float *vbase = kbase + plane;
            const int64_t n = a->slot_idx ? a->slot_off[r + 1] - a->slot_off[r] : a->slot_end[r];
            const int64_t *idx = a->slot_idx ? a->slot_idx + a->slot_off[r] : NULL;
            for (int64_t h0 = h_first; h0 < h_first + a->span;) {
                const int64_t left = h_first + a->span - h0;
                const int G = left >= 4 ? 4 : (int)left;
#define ATTN_G(ND_)                                                                                               \
                switch (G) {                                                                                      \
                    case 4: attn_job(a->qrot, kbase, vbase, a->out, r, h0, a->heads, n, idx, scores, a->max_slots, a->scale, 4, ND_); break; \
                    case 3: attn_job(a->qrot, kbase, vbase, a->out, r, h0, a->heads, n, idx, scores, a->max_slots, a->scale, 3, ND_); break; \
                    case 2: attn_job(a->qrot, kbase, vbase, a->out, r, h0, a->heads, n, idx, scores, a->max_slots, a->scale, 2, ND_); break; \
                    default: attn_job(a->qrot, kbase, vbase, a->out, r, h0, a->heads, n, idx, scores, a->max_slots, a->scale, 1, ND_); break; \
                }
                switch (hd) {
                    case 16: ATTN_G(1) break;
                    case 32: ATTN_G(2) break;
                    case 64: ATTN_G(4) break;
                    default: ATTN_G(8) break;
                }
#undef ATTN_G
                h0 += G;
            }
        }
}

/* One decoder layer's attention for `rows` new tokens that may belong to different sequences.
 * qkv: [rows, (heads + 2 kv_heads) * hd] (the fused projection, bias added); row r is token
 * position pos[r] of a sequence whose KV cache is the fp32 tensor at kv_base[r] with layout
 * [layers, 2, kv_heads, cap[r], hd]. The rotated key and the value of row r are written to slot
 * wslot[r] of `layer`; then row r attends to slot_idx[slot_off[r] .. slot_off[r+1]) (tree rows)
 * or to slots 0 .. slot_end[r]-1. cos/sin: [positions, hd] tables. out: [rows, heads * hd].
 * qrot: rows * heads * hd floats; scratch: (pool threads) * 4 * max_slots floats (max_slots a
 * multiple of 16); hd 16, 32, 64 or 128. */
static void tl_attention(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
                  const int64_t *kv_base, const int64_t *cap, const int64_t *wslot, int64_t layer,
                  float *out, float *qrot, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                  const int64_t *slot_end, const int64_t *slot_off, const int64_t *slot_idx,
                  float *scratch, int64_t max_slots) {
    const int64_t group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)hd);
    rope_and_write_f32(qkv, pos, cos, sin, kv_base, cap, wslot, layer, qrot, rows, heads, kv_heads, hd);
    /* Few rows (decoding): one job per query head, so 2 threads share 9 heads evenly; more
     * rows: one job per (row, kv head), streaming K and V once for the heads that share them.
     * A head's arithmetic is the same either way. */
    const int64_t span = rows * kv_heads < 4 * pool.n ? 1 : group;
    attn_ctx ctx = {{0, rows * heads / span, 1}, qrot, out, kv_base, cap, slot_end, slot_off, slot_idx, scratch,
                    layer, heads, kv_heads, hd, max_slots, span, scale};
    tl_parallel(attn_task, &ctx);
}

#ifdef __AVX512BF16__
/* ---------------------------------------------------------------------------------------
 * Attention over a bf16 KV cache in a slot-blocked layout (attn16.h), several query rows at
 * once: one 64-byte load and one vdpbf16ps per dim pair add that pair's contribution to 16
 * slots' scores of a query; one vdpbf16ps adds two slots' probability-weighted values to 16
 * output dims. */
#include "attn16.h"

/* Scores of QN queries over NB consecutive 16-slot blocks starting at block b0 (QN * NB
 * independent accumulator chains hide the vdpbf16ps latency). */
static inline __attribute__((always_inline)) void score_tile(
        const uint32_t *const *qp, const kv_src *src, int64_t b0, int64_t hd, __m512 *acc, const int QN, const int NB) {
    for (int i = 0; i < QN * NB; i++) acc[i] = _mm512_setzero_ps();
    const uint16_t *kp[8];
    for (int b = 0; b < NB; b++)
        kp[b] = b0 + b < src->split ? (const uint16_t *)src->k + (b0 + b) * 16 * hd : (const uint16_t *)src->tk + (b0 + b - src->split) * 16 * hd;
    for (int64_t dp = 0; dp < hd / 2; dp++) {
        __m512bh kv[8];
        for (int b = 0; b < NB; b++) kv[b] = (__m512bh)_mm512_loadu_si512((const void *)(kp[b] + dp * 32));
        for (int g = 0; g < QN; g++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[g][dp]);
            for (int b = 0; b < NB; b++) acc[g * NB + b] = _mm512_dpbf16_ps(acc[g * NB + b], qv, kv[b]);
        }
    }
}

/* P.V for QN queries: out[g][d] = sum over slot pairs p (in order) of probs[g][p] . V[p][d], for
 * the ND 16-wide dim chunks d0 .. d0+ND-1 of a head of NT chunks (NT > 8: a 256-wide head runs in
 * two halves, each dim's chain over the slot pairs unchanged). */
static inline __attribute__((always_inline)) void pv_tile(
        const uint32_t *const *pp, const kv_src *src, int64_t npairs, __m512 *o, const int QN, const int ND,
        const int64_t NT, const int64_t d0) {
    for (int i = 0; i < QN * ND; i++) o[i] = _mm512_setzero_ps();
    const int64_t psplit = src->split * 8;
    for (int64_t p = 0; p < npairs; p++) {
        const uint16_t *vp = (p < psplit ? (const uint16_t *)src->v + p * 32 * NT : (const uint16_t *)src->tv + (p - psplit) * 32 * NT) + d0 * 32;
        __m512bh vv[8];
        for (int d = 0; d < ND; d++) vv[d] = (__m512bh)_mm512_loadu_si512((const void *)(vp + d * 32));
        for (int g = 0; g < QN; g++) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp[g][p]);
            for (int d = 0; d < ND; d++) o[g * ND + d] = _mm512_dpbf16_ps(o[g * ND + d], pv, vv[d]);
        }
    }
}

/* Scores of queries q0 .. q0+qn-1 over blocks b0 .. b0+bn-1 (acc[g * BT + b]), scaled, the
 * slots a row may not see set to -FLT_MAX, into sc[query][slot]; running maxima in mxv. */
static inline void store_scores16(const attn16_ctx *a, const __m512 *acc, const int64_t *qrow, int64_t q0, int qn,
                                  int64_t b0, int bn, int BT, float *sc, __m512 *mxv) {
    for (int g = 0; g < qn; g++) {
        const int64_t qi = q0 + g, r = qrow[qi], send = a->slot_end[r], lo = a->slot_lo ? a->slot_lo[r] : 0;
        for (int b = 0; b < bn; b++) {
            const int64_t j0 = (b0 + b) * 16;
            const uint32_t valid = attn16_valid(send, lo, j0);
            __m512 sv = _mm512_mul_ps(acc[g * BT + b], _mm512_set1_ps(a->scale));
            sv = _mm512_mask_blend_ps((__mmask16)valid, _mm512_set1_ps(-FLT_MAX), sv);
            _mm512_storeu_ps(sc + qi * a->max_slots + j0, sv);
            mxv[qi] = _mm512_max_ps(mxv[qi], sv);
        }
    }
}

/* A query's probabilities over nb 16-slot blocks of scores s (its maximum's lanes in mxv):
 * exp(s - max) in place, 0 for the slots it may not see, as bf16 pairs (bf16 = 1: s's first
 * nb * 8 floats then hold them) or fp32; returns 1 / their sum (fp32, lane-wise in block order). */
static inline __attribute__((always_inline)) float softmax_row16(float *s, __m512 mxv, int64_t nb, const int bf16) {
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512 v = _mm512_loadu_ps(s + b * 16);
        const __mmask16 ok = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-FLT_MAX), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(ok, exp16(_mm512_sub_ps(v, mx)));
        sum = _mm512_add_ps(sum, e);
        if (bf16) _mm256_storeu_si256((__m256i *)(s + b * 8), (__m256i)_mm512_cvtneps_pbh(e));
        else _mm512_storeu_ps(s + b * 16, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

static void attn16_task(void *arg, int tid, int nthreads) {
    attn16_ctx *a = (attn16_ctx *)arg;
    (void)nthreads;
    const int64_t hd = a->hd;
    const int ND = (int)(hd / 16);
    float *sc = a->scratch + (int64_t)tid * AQ * a->max_slots;
    int64_t end;
    for (int64_t job = tl_next(&a->ctr, &end); job < a->ctr.count; job = tl_next(&a->ctr, &end))
        for (; job < end; job++) {
            kv_src src;
            const uint32_t *qp[AQ];
            int64_t qrow[AQ], qhead[AQ], nb;
            const int64_t Q = attn16_job(a, job, &src, qrow, qhead, qp, &nb);
            __m512 mxv[AQ];
            for (int64_t i = 0; i < Q; i++) mxv[i] = _mm512_set1_ps(-FLT_MAX);
            /* pass 1: scaled, masked scores into sc[query][slot] */
            const int QT = Q >= 8 ? 8 : (int)Q;
            for (int64_t q0 = 0; q0 < Q; q0 += QT) {
                const int qn = (int)(Q - q0 < QT ? Q - q0 : QT);
                const int BT = qn >= 5 ? 1 : qn >= 3 ? 2 : qn == 2 ? 4 : 8;
                for (int64_t b0 = 0; b0 < nb; b0 += BT) {
                    const int bn = (int)(nb - b0 < BT ? nb - b0 : BT);
                    __m512 acc[8];
#define SCORE(QN_, NB_) score_tile(qp + q0, &src, b0, hd, acc, QN_, NB_)
                    if (bn == BT) {
                        switch (qn) {
                            case 1: SCORE(1, 8); break;
                            case 2: SCORE(2, 4); break;
                            case 3: SCORE(3, 2); break;
                            case 4: SCORE(4, 2); break;
                            case 5: SCORE(5, 1); break;
                            case 6: SCORE(6, 1); break;
                            case 7: SCORE(7, 1); break;
                            default: SCORE(8, 1); break;
                        }
                    } else {
                        for (int b = 0; b < bn; b++) {
                            __m512 one[8];
                            switch (qn) {
                                case 1: score_tile(qp + q0, &src, b0 + b, hd, one, 1, 1); break;
                                case 2: score_tile(qp + q0, &src, b0 + b, hd, one, 2, 1); break;
                                case 3: score_tile(qp + q0, &src, b0 + b, hd, one, 3, 1); break;
                                default: score_tile(qp + q0, &src, b0 + b, hd, one, 4, 1); break;
                            }
                            for (int g = 0; g < qn; g++) acc[g * BT + b] = one[g];
                        }
                    }
#undef SCORE
                    store_scores16(a, acc, qrow, q0, qn, b0, bn, BT, sc, mxv);
                }
            }
            /* pass 2: probabilities exp(s - max), rounded to bf16 pairs in place; 1 / sum */
            float inv[AQ];
            for (int64_t qi = 0; qi < Q; qi++) inv[qi] = softmax_row16(sc + qi * a->max_slots, mxv[qi], nb, 1);
            /* pass 3: P.V, QV queries at a time */
            const int QV = ND >= 8 ? 3 : ND == 4 ? 6 : 8;
            const int NH = ND > 8 ? 8 : ND; /* dim chunks per pass (a 256-wide head: two passes of 8) */
            for (int64_t q0 = 0; q0 < Q; q0 += QV) {
                const int qn = (int)(Q - q0 < QV ? Q - q0 : QV);
                const uint32_t *pp[8];
                for (int g = 0; g < qn; g++) pp[g] = (const uint32_t *)(sc + (q0 + g) * a->max_slots);
                for (int64_t d0 = 0; d0 < ND; d0 += NH) {
                    __m512 o[24];
#define PV_ND(ND_, QMAX_)                                                                          \
                    switch (qn < QMAX_ ? qn : QMAX_) {                                            \
                        case 1: pv_tile(pp, &src, nb * 8, o, 1, ND_, ND, d0); break;              \
                        case 2: pv_tile(pp, &src, nb * 8, o, 2, ND_, ND, d0); break;              \
                        case 3: pv_tile(pp, &src, nb * 8, o, 3, ND_, ND, d0); break;              \
                        case 4: pv_tile(pp, &src, nb * 8, o, 4 < QMAX_ ? 4 : QMAX_, ND_, ND, d0); break; \
                        case 5: pv_tile(pp, &src, nb * 8, o, 5 < QMAX_ ? 5 : QMAX_, ND_, ND, d0); break; \
                        case 6: pv_tile(pp, &src, nb * 8, o, 6 < QMAX_ ? 6 : QMAX_, ND_, ND, d0); break; \
                        case 7: pv_tile(pp, &src, nb * 8, o, 7 < QMAX_ ? 7 : QMAX_, ND_, ND, d0); break; \
                        default: pv_tile(pp, &src, nb * 8, o, 8 < QMAX_ ? 8 : QMAX_, ND_, ND, d0); break; \
                    }
                    switch (NH) {
                        case 1: PV_ND(1, 8) break;
                        case 2: PV_ND(2, 8) break;
                        case 4: PV_ND(4, 6) break;
                        default: PV_ND(8, 3) break;
                    }
#undef PV_ND
                    for (int g = 0; g < qn; g++) {
                        const int64_t qi = q0 + g;
                        float *orow = a->out + (qrow[qi] * a->heads + qhead[qi]) * hd + d0 * 16;
                        for (int d = 0; d < NH; d++) _mm512_storeu_ps(orow + d * 16, _mm512_mul_ps(o[g * NH + d], _mm512_set1_ps(inv[qi])));
                    }
                }
            }
        }
}


/* ---------------------------------------------------------------------------------------
 * Attention over a q8_0 KV cache (attn16.h's layout): one 64-byte load of K (4 dims of 16
 * slots, offset to unsigned by a xor) and one vpdpbusd per query add 16 slots' integer sums
 * against the query's int8 values; each 32-dim block's exact sum (less 128 times the query's
 * block sum) times the key's and the query's scales is added to the score in block order. P.V
 * widens each slot's 16 int8 values to fp32 and adds them times p * d in slot order. Per
 * query one fixed chain whatever the other queries and tiles. */

/* Scores of QN queries over NB 16-slot blocks from b0 (as score_tile, over q8_0 K). */
static inline __attribute__((always_inline)) void score_q8_tile(
        const uint8_t *const *qp, const kv_src *src, int64_t b0, int64_t hd, int64_t rb, __m512 *acc, const int QN,
        const int NB) {
    for (int i = 0; i < QN * NB; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *kp[8];
    for (int b = 0; b < NB; b++)
        kp[b] = b0 + b < src->split ? src->k + (b0 + b) * 16 * rb : src->tk + (b0 + b - src->split) * 16 * rb;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int64_t blk = 0; blk < hd / 32; blk++) {
        __m512i is[8];
        for (int i = 0; i < QN * NB; i++) is[i] = _mm512_setzero_si512();
        for (int dg = 0; dg < 8; dg++) {
            __m512i kv[8];
            for (int b = 0; b < NB; b++) kv[b] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(kp[b] + (blk * 8 + dg) * 64)), bias);
            for (int g = 0; g < QN; g++) {
                int32_t q4;
                memcpy(&q4, qp[g] + blk * 32 + dg * 4, 4);
                const __m512i qv = _mm512_set1_epi32(q4);
                for (int b = 0; b < NB; b++) is[g * NB + b] = _mm512_dpbusd_epi32(is[g * NB + b], kv[b], qv);
            }
        }
        for (int g = 0; g < QN; g++) {
            const __m512 dq = _mm512_set1_ps(q8_query_scales(qp[g], hd)[blk]);
            const __m512i corr = _mm512_set1_epi32(128 * q8_query_sums(qp[g], hd)[blk]);
            for (int b = 0; b < NB; b++) {
                const __m512 dk = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kp[b] + 16 * hd + blk * 32)));
                const __m512 isum = _mm512_cvtepi32_ps(_mm512_sub_epi32(is[g * NB + b], corr));
                acc[g * NB + b] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dk, dq), acc[g * NB + b]);
            }
        }
    }
}

/* P.V for QN queries over q8_0 V, dim chunks d0 .. d0+ND-1 (16 wide): out[g][d] = sum over
 * slots s (in order) of (p[g][s] * d[s][block]) * q[s][d]; the weights p * d of a 16-slot
 * block are one vector product per query and dim block. */
static inline __attribute__((always_inline)) void pv_q8_tile(
        const float *const *pp, const kv_src *src, int64_t nb, int64_t hd, int64_t rb, __m512 *o, const int QN,
        const int ND, const int64_t d0) {
    for (int i = 0; i < QN * ND; i++) o[i] = _mm512_setzero_ps();
    float w[8][4][16];
    for (int64_t bb = 0; bb < nb; bb++) {
        const uint8_t *vb = bb < src->split ? src->v + bb * 16 * rb : src->tv + (bb - src->split) * 16 * rb;
        const uint16_t *vd = (const uint16_t *)(vb + 16 * hd) + (d0 / 2) * 16;
        for (int j = 0; j < ND / 2; j++) {
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vd + j * 16)));
            for (int g = 0; g < QN; g++) _mm512_storeu_ps(w[g][j], _mm512_mul_ps(_mm512_loadu_ps(pp[g] + bb * 16), dv));
        }
        for (int s = 0; s < 16; s++) {
            const uint8_t *row = vb + s * hd + d0 * 16;
            for (int d = 0; d < ND; d++) {
                const __m512 vf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d * 16))));
                for (int g = 0; g < QN; g++) o[g * ND + d] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][d / 2][s]), vf, o[g * ND + d]);
            }
        }
    }
}

static void attn_q8_task(void *arg, int tid, int nthreads) {
    attn16_ctx *a = (attn16_ctx *)arg;
    (void)nthreads;
    const int64_t hd = a->hd, rb = a->rb;
    const int ND = (int)(hd / 16);
    float *sc = a->scratch + (int64_t)tid * AQ * a->max_slots;
    int64_t end;
    for (int64_t job = tl_next(&a->ctr, &end); job < a->ctr.count; job = tl_next(&a->ctr, &end))
        for (; job < end; job++) {
            kv_src src;
            const uint32_t *qw[AQ];
            const uint8_t *qp[AQ];
            int64_t qrow[AQ], qhead[AQ], nb;
            const int64_t Q = attn16_job(a, job, &src, qrow, qhead, qw, &nb);
            __m512 mxv[AQ];
            for (int64_t i = 0; i < Q; i++) {
                qp[i] = (const uint8_t *)qw[i];
                mxv[i] = _mm512_set1_ps(-FLT_MAX);
            }
            /* pass 1: scaled, masked scores into sc[query][slot] */
            const int QT = Q >= 8 ? 8 : (int)Q;
            for (int64_t q0 = 0; q0 < Q; q0 += QT) {
                const int qn = (int)(Q - q0 < QT ? Q - q0 : QT);
                const int BT = qn >= 5 ? 1 : qn >= 3 ? 2 : qn == 2 ? 4 : 8;
                for (int64_t b0 = 0; b0 < nb; b0 += BT) {
                    const int bn = (int)(nb - b0 < BT ? nb - b0 : BT);
                    __m512 acc[8];
                    if (bn == BT) {
                        switch (qn) {
                            case 1: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 1, 8); break;
                            case 2: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 2, 4); break;
                            case 3: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 3, 2); break;
                            case 4: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 4, 2); break;
                            case 5: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 5, 1); break;
                            case 6: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 6, 1); break;
                            case 7: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 7, 1); break;
                            default: score_q8_tile(qp + q0, &src, b0, hd, rb, acc, 8, 1); break;
                        }
                    } else {
                        for (int b = 0; b < bn; b++) {
                            __m512 one[8];
                            switch (qn) {
                                case 1: score_q8_tile(qp + q0, &src, b0 + b, hd, rb, one, 1, 1); break;
                                case 2: score_q8_tile(qp + q0, &src, b0 + b, hd, rb, one, 2, 1); break;
                                case 3: score_q8_tile(qp + q0, &src, b0 + b, hd, rb, one, 3, 1); break;
                                default: score_q8_tile(qp + q0, &src, b0 + b, hd, rb, one, 4, 1); break;
                            }
                            for (int g = 0; g < qn; g++) acc[g * BT + b] = one[g];
                        }
                    }
                    store_scores16(a, acc, qrow, q0, qn, b0, bn, BT, sc, mxv);
                }
            }
            /* pass 2: probabilities exp(s - max) in place (fp32); 1 / sum */
            float inv[AQ];
            for (int64_t qi = 0; qi < Q; qi++) inv[qi] = softmax_row16(sc + qi * a->max_slots, mxv[qi], nb, 0);
            /* pass 3: P.V, QV queries at a time, over 8 dim chunks at most per pass */
            const int QV = ND >= 8 ? 3 : ND == 4 ? 6 : 8;
            const int NH = ND > 8 ? 8 : ND;
            for (int64_t q0 = 0; q0 < Q; q0 += QV) {
                const int qn = (int)(Q - q0 < QV ? Q - q0 : QV);
                const float *pp[8];
                for (int g = 0; g < qn; g++) pp[g] = sc + (q0 + g) * a->max_slots;
                for (int64_t d0 = 0; d0 < ND; d0 += NH) {
                    __m512 o[24];
#define PVQ(ND_, QMAX_)                                                                                      \
                    switch (qn < QMAX_ ? qn : QMAX_) {                                                      \
                        case 1: pv_q8_tile(pp, &src, nb, hd, rb, o, 1, ND_, d0); break;                \
                        case 2: pv_q8_tile(pp, &src, nb, hd, rb, o, 2, ND_, d0); break;                \
                        case 3: pv_q8_tile(pp, &src, nb, hd, rb, o, 3, ND_, d0); break;                \
                        case 4: pv_q8_tile(pp, &src, nb, hd, rb, o, 4 < QMAX_ ? 4 : QMAX_, ND_, d0); break; \
                        case 5: pv_q8_tile(pp, &src, nb, hd, rb, o, 5 < QMAX_ ? 5 : QMAX_, ND_, d0); break; \
                        case 6: pv_q8_tile(pp, &src, nb, hd, rb, o, 6 < QMAX_ ? 6 : QMAX_, ND_, d0); break; \
                        case 7: pv_q8_tile(pp, &src, nb, hd, rb, o, 7 < QMAX_ ? 7 : QMAX_, ND_, d0); break; \
                        default: pv_q8_tile(pp, &src, nb, hd, rb, o, 8 < QMAX_ ? 8 : QMAX_, ND_, d0); break; \
                    }
                    switch (NH) {
                        case 2: PVQ(2, 8) break;
                        case 4: PVQ(4, 6) break;
                        default: PVQ(8, 3) break;
                    }
#undef PVQ
                    for (int g = 0; g < qn; g++) {
                        const int64_t qi = q0 + g;
                        float *orow = a->out + (qrow[qi] * a->heads + qhead[qi]) * hd + d0 * 16;
                        for (int d = 0; d < NH; d++) _mm512_storeu_ps(orow + d * 16, _mm512_mul_ps(o[g * NH + d], _mm512_set1_ps(inv[qi])));
                    }
                }
            }
        }
}
#endif

#define TLQ_ALLOW_VNNI 1 /* this variant may use AVX-512 VNNI in quant.h */
#include "quant.h"
#include "repack.h"

#ifdef __AVX512BF16__
#define TL_HAS_PACKED 1    /* forward.h may call tl_linear_packed */
#define TL_HAS_ATTN_BF16 1 /* and tl_attention_bf16 */
#endif
#include "forward.h"
