/* tokenleap CPU kernels for AVX2 + FMA machines (no AVX-512): the same row-invariant contract
 * as kernels.c, with 8-lane vectors.
 *
 * Every output element is computed by one fixed instruction sequence whatever the other rows of
 * the call are, so a forward over k+1 draft rows is bit-identical to k+1 single-row decode steps
 * (DESIGN.md section 6) on this machine too; without these kernels such a machine ran torch ops,
 * whose GEMM blocking depends on the row count, and greedy speculation could drift from plain
 * decoding. Exported symbols match kernels.c where they exist:
 *   tl_linear          fp32 activations x fp32 / bf16 row-major weights (8-lane FMA chains)
 *   tl_linear_packed   bf16 weights in the output-interleaved layout [out/16][in/2][16][2]
 *                      (kernels.c's PackedWeight): a 32-byte load holds an input pair of 8
 *                      outputs, widened to fp32 by a shift and a mask; activations stay fp32
 *   tl_rmsnorm, tl_silu_mul, tl_attention (fp32 KV cache), tl_init
 * There is no bf16 dot-product instruction here, so no blocked bf16 KV cache (tl_features). */
#include "pool.h"
#include "rope.h"
#include "norms.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kernels_avx2.c needs AVX2 and FMA"
#endif

int tl_has_bf16_dot(void) { return 0; }
int tl_features(void) { return 1; } /* 1: tl_linear_packed; no 2 (tl_attention_bf16) */

/* Sum of 8 lanes by one fixed tree. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) on 8 lanes: Cephes' expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp),
 * underflow to 0 below -87.3; 2^n built in the exponent bits. Deterministic. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    __m256 y = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n for n in [-126, 127]; below that y * 2^n underflows: split as 2^(n/2) * 2^(n - n/2) */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i h = _mm256_srai_epi32(ni, 1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}

/* ---------------------------------------------------------------------------------------
 * Row-major linear: y[m, o] = sum_i x[m, i] w[o, i] (+ b[o]). Each (m, o) has one 8-lane
 * accumulator filled by FMAs over 8-wide chunks of i in order, then hsum8: the same arithmetic
 * in every block shape. bf16 weights widen to fp32 (a shift of the zero-extended halves). */
#define RB 4
#define OB 2

static inline __m256 load_w8(const void *w, int wbits, int64_t off) {
    if (wbits == 16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + off))), 16));
    return _mm256_loadu_ps((const float *)w + off);
}

static inline __attribute__((always_inline)) void block_rows(
        const float *x, const void *w, const float *b, float *y, int64_t m0, int64_t o0, int NO,
        int64_t in_dim, int64_t out_dim, int wbits, const int NR) {
    __m256 acc[RB][OB];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < OB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in_dim; i += 8) {
        __m256 wv[OB];
        for (int j = 0; j < NO; j++) wv[j] = load_w8(w, wbits, (o0 + j) * in_dim + i);
        for (int r = 0; r < NR; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * in_dim + i);
            for (int j = 0; j < NO; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NO; j++) {
            float s = hsum8(acc[r][j]);
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
    int64_t end;
    for (int64_t blk = tl_next(&j->ctr, &end); blk < j->ctr.count; blk = tl_next(&j->ctr, &end))
        for (; blk < end; blk++) block_all_rows(j->x, j->w, j->b, j->y, j->rows, blk * OB, OB, j->in_dim, j->out_dim, j->wbits);
}

/* x, y fp32; w bf16 (wbits 16) or fp32 (32), row-major [out, in]; in_dim a multiple of 32
 * (as kernels.c); `xp` unused here (kernels.c's scratch). */
void tl_linear(const float *x, const void *w, const float *b, float *y, float *xp,
               int64_t rows, int64_t in_dim, int64_t out_dim, int wbits) {
    (void)xp;
    lin_job job = {{0, out_dim / OB, 8}, x, w, b, y, rows, in_dim, out_dim, wbits};
    tl_parallel(lin_task, &job);
    for (int64_t o = job.ctr.count * OB; o < out_dim; o++) block_all_rows(x, w, b, y, rows, o, 1, in_dim, out_dim, wbits);
}

/* ---------------------------------------------------------------------------------------
 * Packed bf16 linear. Block b of the weight holds outputs 16b..16b+15 as [in/2][16][2]; the
 * first 32 bytes of an input pair p are outputs 0-7 (each a 32-bit lane: w[o][2p] low, w[o][2p+1]
 * high), the next 32 bytes outputs 8-15. acc[o] += x[2p] * w[o][2p], then += x[2p+1] * w[o][2p+1],
 * for p in order: no horizontal sums, the same chain for every tile shape. A tile is NR rows x
 * NB 8-output halves. */
#define PR 6 /* rows per tile at most (with 2 halves: 12 accumulators) */
#define PH 4 /* 8-output halves per tile at most (with 1-2 rows) */

static inline __attribute__((always_inline)) void packed_tile(
        const float *x, const uint16_t *wp, const float *b, float *y, int64_t m0, int64_t h0,
        int64_t in_dim, int64_t out_dim, int accumulate, const int NR, const int NH) {
    const int64_t half_in = in_dim / 2;
    __m256 acc[PR][PH];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NH; j++) acc[r][j] = _mm256_setzero_ps();
    /* half h (8 outputs) of block h/2: element (p, lane) at wp + (h/2)*half_in*32 + p*32 + (h%2)*16 + 2*lane */
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000);
    for (int64_t p = 0; p < half_in; p++) {
        for (int j = 0; j < NH; j++) {
            const int64_t h = h0 + j;
            const uint16_t *src = wp + (h >> 1) * half_in * 32 + p * 32 + (h & 1) * 16;
            _mm_prefetch((const char *)(src + 16 * 32), _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)src);
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
            for (int r = 0; r < NR; r++) {
                const float *xr = x + (m0 + r) * in_dim + 2 * p;
                acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), we, acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), wo, acc[r][j]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < NH; j++) {
            __m256 v = acc[r][j];
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + (h0 + j) * 8));
            float *dst = y + (m0 + r) * out_dim + (h0 + j) * 8;
            if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
            _mm256_storeu_ps(dst, v);
        }
}

#define PACKED_NH(NR_, MAXH)                                                                              \
    switch (nh < (MAXH) ? nh : (MAXH)) {                                                                  \
        case 4: packed_tile(x, wp, b, y, m0, h, in_dim, out_dim, accumulate, NR_, 4); break;              \
        case 3: packed_tile(x, wp, b, y, m0, h, in_dim, out_dim, accumulate, NR_, 3); break;              \
        case 2: packed_tile(x, wp, b, y, m0, h, in_dim, out_dim, accumulate, NR_, 2); break;              \
        default: packed_tile(x, wp, b, y, m0, h, in_dim, out_dim, accumulate, NR_, 1); break;             \
    }

/* Halves [h_lo, h_hi) for all rows: 1-2 rows take 4 halves per tile (the weights stream once),
 * more rows take tiles of up to 6 rows x 2 halves (12 accumulators, each weight load used 6 times). */
static void packed_halves(const float *x, const uint16_t *wp, const float *b, float *y, int64_t rows,
                          int64_t h_lo, int64_t h_hi, int64_t in_dim, int64_t out_dim, int accumulate) {
    const int narrow = rows <= 2;
    const int64_t tile_h = narrow ? 4 : 2, tile_rows = narrow ? 2 : PR;
    for (int64_t h = h_lo; h < h_hi; h += tile_h) {
        const int nh = (int)(h_hi - h < tile_h ? h_hi - h : tile_h);
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
            switch (rows - m0 < tile_rows ? rows - m0 : tile_rows) {
                case 6: PACKED_NH(6, 2) break;
                case 5: PACKED_NH(5, 2) break;
                case 4: PACKED_NH(4, 2) break;
                case 3: PACKED_NH(3, 2) break;
                case 2: PACKED_NH(2, 4) break;
                default: PACKED_NH(1, 4) break;
            }
        }
    }
}

typedef struct {
    const float *x;
    const uint16_t *wp;
    const float *b;
    float *y;
    int64_t rows, nhalves, in_dim, out_dim;
    int accumulate;
} packed_job;

static void packed_task(void *ctx, int t, int nt) {
    const packed_job *j = (const packed_job *)ctx;
    /* contiguous ranges of whole 16-output blocks per thread */
    const int64_t nblk = j->nhalves / 2;
    packed_halves(j->x, j->wp, j->b, j->y, j->rows, 2 * (nblk * t / nt), 2 * (nblk * (t + 1) / nt), j->in_dim, j->out_dim, j->accumulate);
}

/* y[m, o] = sum_i x[m, i] * w[o, i] (+ b[o]) (with `accumulate`: y += that); w packed as above,
 * out_dim a multiple of 16, in_dim a multiple of 32; `xb` unused (kernels.c's bf16 scratch). */
void tl_linear_packed(const float *x, const uint16_t *wp, const float *b, float *y, uint16_t *xb,
                      int64_t rows, int64_t in_dim, int64_t out_dim, int accumulate) {
    (void)xb;
    packed_job job = {x, wp, b, y, rows, out_dim / 8, in_dim, out_dim, accumulate};
    tl_parallel(packed_task, &job);
}

/* ---------------------------------------------------------------------------------------
 * Norm and gating. */

/* y = x / rms(x) * w per row (RMSNorm, Zhang & Sennrich 2019). */
void tl_rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(y + r * dim + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), scale), _mm256_loadu_ps(w + i)));
    }
}

/* SwiGLU's gating: y[r, i] = silu(gu[r, i]) * gu[r, f + i], gu = [rows, 2f] (gate | up). */
void tl_silu_mul(const float *gu, float *y, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i += 8) {
            const __m256 g = _mm256_loadu_ps(gu + r * 2 * f + i), u = _mm256_loadu_ps(gu + r * 2 * f + f + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(y + r * f + i, _mm256_mul_ps(silu, u));
        }
}

/* ---------------------------------------------------------------------------------------
 * Attention over fp32 KV caches [layers, 2, kv_heads, cap, hd]. A job is one query row and a
 * span of heads sharing a kv head. Per (row, head): score of slot j = hsum8 of an 8-lane FMA
 * chain over hd, times 1/sqrt(hd); softmax with exp8 over the slots in chunks of 8 (lanes past
 * the last slot are -inf: exact zeros); P.V as an FMA chain over the slots in order. The same
 * sequence whatever the other rows or the job split. */


static inline __attribute__((always_inline)) void attn_head(
        const float *qr, const float *kbase, const float *vbase, float *orow, int64_t n, const int64_t *idx,
        float *scores, float scale, const int ND) {
    const int64_t hd = ND * 8;
    __m256 q[16];
    for (int d = 0; d < ND; d++) q[d] = _mm256_loadu_ps(qr + d * 8);
    float mx = -FLT_MAX;
    for (int64_t j = 0; j < n; j++) {
        const float *kj = kbase + (idx ? idx[j] : j) * hd;
        __m256 acc = _mm256_mul_ps(q[0], _mm256_loadu_ps(kj));
        for (int d = 1; d < ND; d++) acc = _mm256_fmadd_ps(q[d], _mm256_loadu_ps(kj + d * 8), acc);
        const float s = hsum8(acc) * scale;
        scores[j] = s;
        mx = s > mx ? s : mx;
    }
    const int64_t padded = (n + 7) & ~(int64_t)7;
    for (int64_t j = n; j < padded; j++) scores[j] = -INFINITY;
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < padded; j0 += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j0), mxv));
        /* exp8 clamps -inf to exp(-87.3) > 0: lanes past the last slot must be exact zeros */
        const __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(scores + j0), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m256 ez = _mm256_and_ps(e, keep);
        _mm256_storeu_ps(scores + j0, ez);
        sumv = _mm256_add_ps(sumv, ez);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sumv));
    __m256 o[16];
    for (int d = 0; d < ND; d++) o[d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *vj = vbase + (idx ? idx[j] : j) * hd;
        const __m256 pj = _mm256_set1_ps(scores[j]);
        for (int d = 0; d < ND; d++) o[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + d * 8), o[d]);
    }
    for (int d = 0; d < ND; d++) _mm256_storeu_ps(orow + d * 8, _mm256_mul_ps(o[d], inv));
}

typedef struct {
    tl_counter ctr;
    const float *qrot;
    float *out;
    const int64_t *kv_base, *cap, *slot_end, *slot_off, *slot_idx;
    float *scratch;
    int64_t layer, heads, kv_heads, hd, max_slots, span;
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
            for (int64_t h = h_first; h < h_first + a->span; h++) {
                const float *qr = a->qrot + (r * a->heads + h) * hd;
                float *orow = a->out + (r * a->heads + h) * hd;
                switch (hd) {
                    case 16: attn_head(qr, kbase, vbase, orow, n, idx, scores, a->scale, 2); break;
                    case 32: attn_head(qr, kbase, vbase, orow, n, idx, scores, a->scale, 4); break;
                    case 64: attn_head(qr, kbase, vbase, orow, n, idx, scores, a->scale, 8); break;
                    default: attn_head(qr, kbase, vbase, orow, n, idx, scores, a->scale, 16); break;
                }
            }
        }
}

/* The signature and layouts of kernels.c's tl_attention (see there); scratch holds
 * (pool threads) * 4 * max_slots floats, max_slots a multiple of 16. */
void tl_attention(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
                  const int64_t *kv_base, const int64_t *cap, const int64_t *wslot, int64_t layer,
                  float *out, float *qrot, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                  const int64_t *slot_end, const int64_t *slot_off, const int64_t *slot_idx,
                  float *scratch, int64_t max_slots) {
    const int64_t group = heads / kv_heads;
    const float scale = 1.0f / sqrtf((float)hd);
    rope_and_write_f32(qkv, pos, cos, sin, kv_base, cap, wslot, layer, qrot, rows, heads, kv_heads, hd);
    const int64_t span = rows * kv_heads < 4 * pool.n ? 1 : group;
    attn_ctx ctx = {{0, rows * heads / span, 1}, qrot, out, kv_base, cap, slot_end, slot_off, slot_idx, scratch,
                    layer, heads, kv_heads, hd, max_slots, span, scale};
    tl_parallel(attn_task, &ctx);
}

#include "quant.h"
#include "repack.h"

#define TL_HAS_PACKED 1 /* forward.h may call tl_linear_packed (no tl_attention_bf16 here) */
#include "forward.h"
