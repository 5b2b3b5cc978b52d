/* tokenleap CPU kernels for AVX2 + FMA machines (no AVX-512): the same row-invariant contract
 * as kernels.c, with 8-lane vectors.
 *
 * Every output element is computed by one fixed instruction sequence whatever the other rows of
 * the call are, so a forward over k+1 draft rows is bit-identical to k+1 single-row decode steps
 * (ARCHITECTURE.md, "The exactness contract") on this machine too; without these kernels such a machine ran torch ops,
 * whose GEMM blocking depends on the row count, and greedy speculation could drift from plain
 * decoding. Exported symbols match kernels.c where they exist:
 *   tl_linear          fp32 activations x fp32 / bf16 row-major weights (8-lane FMA chains)
 *   tl_linear_packed   bf16 weights in the output-interleaved layout [out/16][in/2][16][2]
 *                      (kernels.c's PackedWeight): a 32-byte load holds an input pair of 8
 *                      outputs, widened to fp32 by a shift and a mask; activations stay fp32
 *   tl_rmsnorm, tl_silu_mul, tl_attention (fp32 KV cache), tl_init
 *   tl_attention_bf16  the blocked bf16 KV cache of attn16.h, bf16 widened by a shift and a mask */
#include "pool.h"
#include "rope.h"
#include "norms.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "kernels_avx2.c needs AVX2 and FMA"
#endif

int tl_has_bf16_dot(void) { return 0; }
int tl_features(void) { return 3; } /* 1: tl_linear_packed, 2: tl_attention_bf16 */

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

/* GeGLU's gating (Gemma): y[r, i] = gelu_tanh(gu[r, i]) * gu[r, f + i] as g / (1 + exp(-2k)),
 * k = sqrt(2 / pi) (g + 0.044715 g^3) (see kernels.c). */
void tl_gelu_mul(const float *gu, float *y, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < f; i += 8) {
            const __m256 g = _mm256_loadu_ps(gu + r * 2 * f + i), u = _mm256_loadu_ps(gu + r * 2 * f + f + i);
            const __m256 z = _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(TL_GELU_B), _mm256_set1_ps(TL_GELU_A)));
            const __m256 gelu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(z)));
            _mm256_storeu_ps(y + r * f + i, _mm256_mul_ps(gelu, u));
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
static void tl_attention(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
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

/* ---------------------------------------------------------------------------------------
 * Attention over a bf16 KV cache in the slot-blocked layout of attn16.h, without a bf16 dot
 * product: 32 bytes of K hold one dim pair of 8 slots, widened to two fp32 vectors (the even
 * dim by a shift, the odd one by a mask) for two FMAs into 8 slots' scores; 32 bytes of V hold
 * two slots' values of 8 dims, two FMAs add them to 8 output dims. Half the bytes of the fp32
 * cache, and a verified draft reads K and V once for all its rows. Per query one fixed chain
 * whatever the other queries and tiles (score: dim pairs in order, even then odd; P.V: slot
 * pairs in order), so a verified row equals the decoded one bit for bit (on this variant: its
 * bits are not kernels.c's, whose vdpbf16ps and exp differ). */
#include "attn16.h"

static inline void bf16_split8(const uint16_t *p, __m256 *even, __m256 *odd) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xFFFF0000)));
}

/* Scores of QN queries over NB 16-slot blocks from b0: acc[(g * NB + b) * 2 + h] holds slots
 * h*8 .. h*8+7 of block b0+b. qf: the queries widened to fp32. */
static inline __attribute__((always_inline)) void score_tile8(
        const float *const *qf, const kv_src *src, int64_t b0, int64_t hd, __m256 *acc, const int QN, const int NB) {
    __m256 t[8]; /* local, so that the accumulators stay in registers */
    for (int i = 0; i < 2 * QN * NB; i++) t[i] = _mm256_setzero_ps();
    const uint16_t *kp[4];
    for (int b = 0; b < NB; b++)
        kp[b] = b0 + b < src->split ? (const uint16_t *)src->k + (b0 + b) * 16 * hd : (const uint16_t *)src->tk + (b0 + b - src->split) * 16 * hd;
    for (int64_t dp = 0; dp < hd / 2; dp++)
        for (int b = 0; b < NB; b++) {
            __m256 ke0, ko0, ke1, ko1;
            bf16_split8(kp[b] + dp * 32, &ke0, &ko0);
            bf16_split8(kp[b] + dp * 32 + 16, &ke1, &ko1);
            for (int g = 0; g < QN; g++) {
                const __m256 qe = _mm256_broadcast_ss(qf[g] + 2 * dp), qo = _mm256_broadcast_ss(qf[g] + 2 * dp + 1);
                const int i = (g * NB + b) * 2;
                t[i] = _mm256_fmadd_ps(qe, ke0, t[i]);
                t[i + 1] = _mm256_fmadd_ps(qe, ke1, t[i + 1]);
                t[i] = _mm256_fmadd_ps(qo, ko0, t[i]);
                t[i + 1] = _mm256_fmadd_ps(qo, ko1, t[i + 1]);
            }
        }
    for (int i = 0; i < 2 * QN * NB; i++) acc[i] = t[i];
}

/* P.V of QN queries for NC 8-dim chunks from chunk c0 over slot pairs p0 .. p1-1, continuing
 * the sums in o (query g's row at o + g * hd): o[d] += p_even . V_even + p_odd . V_odd per pair,
 * in order. pf: the probabilities (bf16 values as fp32). */
static inline __attribute__((always_inline)) void pv_tile8(
        const float *const *pf, const kv_src *src, int64_t p0, int64_t p1, int64_t hd, int64_t c0, float *o,
        const int QN, const int NC) {
    __m256 t[8]; /* local, so that the accumulators stay in registers */
    for (int g = 0; g < QN; g++)
        for (int c = 0; c < NC; c++) t[g * NC + c] = _mm256_loadu_ps(o + g * hd + (c0 + c) * 8);
    const int64_t psplit = src->split * 8;
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *vp = (p < psplit ? (const uint16_t *)src->v + p * 2 * hd : (const uint16_t *)src->tv + (p - psplit) * 2 * hd) + c0 * 16;
        for (int c = 0; c < NC; c++) {
            __m256 ve, vo;
            bf16_split8(vp + c * 16, &ve, &vo);
            for (int g = 0; g < QN; g++) {
                t[g * NC + c] = _mm256_fmadd_ps(_mm256_broadcast_ss(pf[g] + 2 * p), ve, t[g * NC + c]);
                t[g * NC + c] = _mm256_fmadd_ps(_mm256_broadcast_ss(pf[g] + 2 * p + 1), vo, t[g * NC + c]);
            }
        }
    }
    for (int g = 0; g < QN; g++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(o + g * hd + (c0 + c) * 8, t[g * NC + c]);
}

/* K and V are read in runs that stay in L1/L2 while every query tile of a job passes over them
 * (a 16-slot block of a 128-wide head is 4 KB): BLK blocks for the scores, PAIRS slot pairs
 * for P.V. The order of the runs changes no sum: a score is one block's own chain, and a P.V
 * sum continues from where the previous run stored it. */
#define BLK 16
#define PAIRS 64

/* A query's probabilities over nb 16-slot blocks of scores s (its maximum's lanes in mxv):
 * exp(s - max) in place, 0 for the slots it may not see, rounded to bf16 (kept as fp32; bf16 =
 * 1) or fp32; returns 1 / their sum (fp32, lane-wise in order). */
static inline __attribute__((always_inline)) float softmax_row8(float *s, __m256 mxv, int64_t nb, const int bf16) {
    const __m256 mx = _mm256_set1_ps(hmax8(mxv));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb * 16; j += 8) {
        const __m256 v = _mm256_loadu_ps(s + j);
        const __m256 ok = _mm256_cmp_ps(v, _mm256_set1_ps(-FLT_MAX), _CMP_NEQ_OQ);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, mx)), ok);
        sum = _mm256_add_ps(sum, e);
        if (bf16) {
            __m256i u = _mm256_castps_si256(e); /* round to nearest even at bit 16 (e >= 0, finite) */
            u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
            _mm256_storeu_ps(s + j, _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000))));
        } else {
            _mm256_storeu_ps(s + j, e);
        }
    }
    return 1.0f / hsum8(sum);
}

/* Scores of queries q0 .. q0+qn-1 over blocks b0 .. b0+bn-1 (acc[(g * BT + b) * 2 + half]),
 * scaled, the slots a row may not see set to -FLT_MAX, into sc[query][slot]; maxima in mxv. */
static inline void store_scores8(const attn16_ctx *a, const __m256 *acc, const int64_t *qrow, int64_t q0, int qn,
                                 int64_t b0, int bn, int BT, float *sc, __m256 *mxv) {
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int g = 0; g < qn; g++) {
        const int64_t qi = q0 + g, r = qrow[qi];
        for (int b = 0; b < bn; b++) {
            const int64_t j0 = (b0 + b) * 16;
            const uint32_t valid = attn16_valid(a->slot_end[r], a->slot_lo ? a->slot_lo[r] : 0, j0);
            for (int h = 0; h < 2; h++) {
                const __m256i bits = _mm256_and_si256(_mm256_set1_epi32((int)(valid >> (8 * h))), lane_bit);
                const __m256 ok = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bit));
                __m256 sv = _mm256_mul_ps(acc[(g * BT + b) * 2 + h], _mm256_set1_ps(a->scale));
                sv = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), sv, ok);
                _mm256_storeu_ps(sc + qi * a->max_slots + j0 + 8 * h, sv);
                mxv[qi] = _mm256_max_ps(mxv[qi], sv);
            }
        }
    }
}

static void attn16_task(void *arg, int tid, int nthreads) {
    attn16_ctx *a = (attn16_ctx *)arg;
    (void)nthreads;
    const int64_t hd = a->hd, nc_all = hd / 8;
    float *sc = a->scratch + (int64_t)tid * AQ * a->max_slots;
    float qbuf[AQ * 256], obuf[AQ * 256];
    int64_t end;
    for (int64_t job = tl_next(&a->ctr, &end); job < a->ctr.count; job = tl_next(&a->ctr, &end))
        for (; job < end; job++) {
            kv_src src;
            const uint32_t *qp[AQ];
            int64_t qrow[AQ], qhead[AQ], nb;
            const int64_t Q = attn16_job(a, job, &src, qrow, qhead, qp, &nb);
            const float *qf[AQ];
            __m256 mxv[AQ];
            for (int64_t i = 0; i < Q; i++) {
                float *dst = qbuf + i * hd;
                for (int64_t dp = 0; dp < hd / 2; dp++) {
                    const uint32_t lo = qp[i][dp] << 16, hi = qp[i][dp] & 0xffff0000u;
                    memcpy(dst + 2 * dp, &lo, 4);
                    memcpy(dst + 2 * dp + 1, &hi, 4);
                }
                qf[i] = dst;
                mxv[i] = _mm256_set1_ps(-FLT_MAX);
            }
            /* pass 1: scaled, masked scores into sc[query][slot] */
            for (int64_t run = 0; run < nb; run += BLK)
            for (int64_t q0 = 0; q0 < Q; q0 += 4) {
                const int qn = (int)(Q - q0 < 4 ? Q - q0 : 4);
                const int BT = qn >= 3 ? 1 : qn == 2 ? 2 : 4;
                const int64_t run_end = run + BLK < nb ? run + BLK : nb;
                for (int64_t b0 = run; b0 < run_end; b0 += BT) {
                    const int bn = (int)(run_end - b0 < BT ? run_end - b0 : BT);
                    __m256 acc[8];
                    if (bn == BT) {
                        switch (qn) {
                            case 1: score_tile8(qf + q0, &src, b0, hd, acc, 1, 4); break;
                            case 2: score_tile8(qf + q0, &src, b0, hd, acc, 2, 2); break;
                            case 3: score_tile8(qf + q0, &src, b0, hd, acc, 3, 1); break;
                            default: score_tile8(qf + q0, &src, b0, hd, acc, 4, 1); break;
                        }
                    } else {
                        for (int b = 0; b < bn; b++) {
                            __m256 one[4];
                            switch (qn) {
                                case 1: score_tile8(qf + q0, &src, b0 + b, hd, one, 1, 1); break;
                                default: score_tile8(qf + q0, &src, b0 + b, hd, one, 2, 1); break;
                            }
                            for (int g = 0; g < qn; g++) {
                                acc[(g * BT + b) * 2] = one[g * 2];
                                acc[(g * BT + b) * 2 + 1] = one[g * 2 + 1];
                            }
                        }
                    }
                    store_scores8(a, acc, qrow, q0, qn, b0, bn, BT, sc, mxv);
                }
            }
            /* pass 2: probabilities exp(s - max), rounded to bf16 (kept as fp32) in place; 1 / sum */
            float inv[AQ];
            for (int64_t qi = 0; qi < Q; qi++) inv[qi] = softmax_row8(sc + qi * a->max_slots, mxv[qi], nb, 1);
            /* pass 3: P.V in runs of PAIRS slot pairs, the sums kept in obuf between runs */
            for (int64_t i = 0; i < Q * hd; i++) obuf[i] = 0.0f;
            for (int64_t run = 0; run < nb * 8; run += PAIRS) {
                const int64_t run_end = run + PAIRS < nb * 8 ? run + PAIRS : nb * 8;
                for (int64_t q0 = 0; q0 < Q;) {
                    const int qn = Q - q0 >= 4 ? 4 : Q - q0 >= 2 ? 2 : 1;
                    const int64_t NC = qn == 4 ? 2 : qn == 2 ? 4 : 8;
                    const float *pf[4];
                    for (int g = 0; g < qn; g++) pf[g] = sc + (q0 + g) * a->max_slots;
                    float *o = obuf + q0 * hd;
                    for (int64_t c0 = 0; c0 < nc_all; c0 += NC) {
                        const int nc = (int)(nc_all - c0 < NC ? nc_all - c0 : NC);
                        if (qn == 4) pv_tile8(pf, &src, run, run_end, hd, c0, o, 4, 2);
                        else if (qn == 2 && nc == 4) pv_tile8(pf, &src, run, run_end, hd, c0, o, 2, 4);
                        else if (qn == 2) pv_tile8(pf, &src, run, run_end, hd, c0, o, 2, 2);
                        else if (nc == 8) pv_tile8(pf, &src, run, run_end, hd, c0, o, 1, 8);
                        else if (nc == 4) pv_tile8(pf, &src, run, run_end, hd, c0, o, 1, 4);
                        else pv_tile8(pf, &src, run, run_end, hd, c0, o, 1, 2);
                    }
                    q0 += qn;
                }
            }
            for (int64_t qi = 0; qi < Q; qi++) {
                float *orow = a->out + (qrow[qi] * a->heads + qhead[qi]) * hd;
                for (int64_t d = 0; d < hd; d += 8)
                    _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(obuf + qi * hd + d), _mm256_set1_ps(inv[qi])));
            }
        }
}

/* ---------------------------------------------------------------------------------------
 * Attention over a q8_0 KV cache (attn16.h's layout) on AVX2: 32 bytes of K hold 4 dims of 8
 * slots; vpmaddubsw of the query's |q| and the keys signed by q (llama.cpp's q8_0 dot product)
 * and vpmaddwd by ones add them to 8 slots' integer sums; each 32-dim block's exact sum times
 * the key's and the query's scales is added to the score in block order. P.V widens 8 int8
 * values to fp32 and adds them times p * d in slot order. Per query one fixed chain whatever
 * the other queries and tiles (its bits are not kernels.c's: the exp differs). */

/* Scores of QN queries over NB 16-slot blocks from b0 (QN * NB <= 2): acc[(g * NB + b) * 2 + h]
 * holds slots h*8 .. h*8+7 of block b0+b. */
static inline __attribute__((always_inline)) void score_q8_tile8(
        const uint8_t *const *qp, const kv_src *src, int64_t b0, int64_t hd, int64_t rb, __m256 *acc, const int QN,
        const int NB) {
    __m256 t[4];
    for (int i = 0; i < 2 * QN * NB; i++) t[i] = _mm256_setzero_ps();
    const uint8_t *kp[2];
    for (int b = 0; b < NB; b++)
        kp[b] = b0 + b < src->split ? src->k + (b0 + b) * 16 * rb : src->tk + (b0 + b - src->split) * 16 * rb;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t blk = 0; blk < hd / 32; blk++) {
        __m256i is[4];
        for (int i = 0; i < 2 * QN * NB; i++) is[i] = _mm256_setzero_si256();
        for (int dg = 0; dg < 8; dg++)
            for (int b = 0; b < NB; b++) {
                const __m256i k0 = _mm256_loadu_si256((const __m256i *)(kp[b] + (blk * 8 + dg) * 64));
                const __m256i k1 = _mm256_loadu_si256((const __m256i *)(kp[b] + (blk * 8 + dg) * 64 + 32));
                for (int g = 0; g < QN; g++) {
                    int32_t q4;
                    memcpy(&q4, qp[g] + blk * 32 + dg * 4, 4);
                    const __m256i qv = _mm256_set1_epi32(q4), aq = _mm256_sign_epi8(qv, qv);
                    const int i = (g * NB + b) * 2;
                    is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(k0, qv)), ones));
                    is[i + 1] = _mm256_add_epi32(is[i + 1], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(k1, qv)), ones));
                }
            }
        for (int g = 0; g < QN; g++) {
            const __m256 dq = _mm256_set1_ps(q8_query_scales(qp[g], hd)[blk]);
            for (int b = 0; b < NB; b++)
                for (int h = 0; h < 2; h++) {
                    const int i = (g * NB + b) * 2 + h;
                    const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kp[b] + 16 * hd + blk * 32 + h * 16)));
                    t[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i]), _mm256_mul_ps(dk, dq), t[i]);
                }
        }
    }
    for (int i = 0; i < 2 * QN * NB; i++) acc[i] = t[i];
}

/* P.V of QN queries for NC 8-dim chunks from chunk c0 over the 16-slot blocks b0 .. b1-1 of
 * q8_0 V, continuing the sums in o (query g's row at o + g * hd): o[d] += (p[s] * d[s][block])
 * * q[s][d], slot by slot; a block's weights p * d are vector products per query and dim block. */
static inline __attribute__((always_inline)) void pv_q8_tile8(
        const float *const *pf, const kv_src *src, int64_t b0, int64_t b1, int64_t hd, int64_t rb, int64_t c0, float *o,
        const int QN, const int NC) {
    __m256 t[8];
    for (int g = 0; g < QN; g++)
        for (int c = 0; c < NC; c++) t[g * NC + c] = _mm256_loadu_ps(o + g * hd + (c0 + c) * 8);
    const int64_t blk0 = c0 / 4, nblk = (c0 + NC + 3) / 4 - blk0;
    float w[4][2][16];
    for (int64_t bb = b0; bb < b1; bb++) {
        const uint8_t *vb = bb < src->split ? src->v + bb * 16 * rb : src->tv + (bb - src->split) * 16 * rb;
        const uint16_t *vd = (const uint16_t *)(vb + 16 * hd) + blk0 * 16;
        for (int64_t j = 0; j < nblk; j++)
            for (int h = 0; h < 2; h++) {
                const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vd + j * 16 + h * 8)));
                for (int g = 0; g < QN; g++) _mm256_storeu_ps(w[g][j] + h * 8, _mm256_mul_ps(_mm256_loadu_ps(pf[g] + bb * 16 + h * 8), dv));
            }
        for (int s = 0; s < 16; s++) {
            const uint8_t *row = vb + s * hd + c0 * 8;
            for (int c = 0; c < NC; c++) {
                const __m256 vf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c * 8))));
                for (int g = 0; g < QN; g++)
                    t[g * NC + c] = _mm256_fmadd_ps(_mm256_set1_ps(w[g][(c0 + c) / 4 - blk0][s]), vf, t[g * NC + c]);
            }
        }
    }
    for (int g = 0; g < QN; g++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(o + g * hd + (c0 + c) * 8, t[g * NC + c]);
}

#define VBLK 8 /* 16-slot blocks per P.V run over a q8_0 V */

static void attn_q8_task(void *arg, int tid, int nthreads) {
    attn16_ctx *a = (attn16_ctx *)arg;
    (void)nthreads;
    const int64_t hd = a->hd, rb = a->rb, nc_all = hd / 8;
    float *sc = a->scratch + (int64_t)tid * AQ * a->max_slots;
    float obuf[AQ * 256];
    int64_t end;
    for (int64_t job = tl_next(&a->ctr, &end); job < a->ctr.count; job = tl_next(&a->ctr, &end))
        for (; job < end; job++) {
            kv_src src;
            const uint32_t *qw[AQ];
            const uint8_t *qp[AQ];
            int64_t qrow[AQ], qhead[AQ], nb;
            const int64_t Q = attn16_job(a, job, &src, qrow, qhead, qw, &nb);
            __m256 mxv[AQ];
            for (int64_t i = 0; i < Q; i++) {
                qp[i] = (const uint8_t *)qw[i];
                mxv[i] = _mm256_set1_ps(-FLT_MAX);
            }
            /* pass 1: scaled, masked scores into sc[query][slot], in runs of BLK blocks */
            for (int64_t run = 0; run < nb; run += BLK)
                for (int64_t q0 = 0; q0 < Q; q0 += 2) {
                    const int qn = Q - q0 >= 2 ? 2 : 1, BT = qn == 2 ? 1 : 2;
                    const int64_t run_end = run + BLK < nb ? run + BLK : nb;
                    for (int64_t b0 = run; b0 < run_end; b0 += BT) {
                        const int bn = (int)(run_end - b0 < BT ? run_end - b0 : BT);
                        __m256 acc[4];
                        if (qn == 2) score_q8_tile8(qp + q0, &src, b0, hd, rb, acc, 2, 1);
                        else if (bn == 2) score_q8_tile8(qp + q0, &src, b0, hd, rb, acc, 1, 2);
                        else score_q8_tile8(qp + q0, &src, b0, hd, rb, acc, 1, 1);
                        store_scores8(a, acc, qrow, q0, qn, b0, bn, BT, sc, mxv);
                    }
                }
            /* pass 2: probabilities exp(s - max) in place (fp32); 1 / sum */
            float inv[AQ];
            for (int64_t qi = 0; qi < Q; qi++) inv[qi] = softmax_row8(sc + qi * a->max_slots, mxv[qi], nb, 0);
            /* pass 3: P.V in runs of VBLK blocks, the sums kept in obuf between runs */
            for (int64_t i = 0; i < Q * hd; i++) obuf[i] = 0.0f;
            for (int64_t run = 0; run < nb; run += VBLK) {
                const int64_t run_end = run + VBLK < nb ? run + VBLK : nb;
                for (int64_t q0 = 0; q0 < Q;) {
                    const int qn = Q - q0 >= 4 ? 4 : Q - q0 >= 2 ? 2 : 1;
                    const int64_t NC = qn == 4 ? 2 : qn == 2 ? 4 : 8;
                    const float *pf[4];
                    for (int g = 0; g < qn; g++) pf[g] = sc + (q0 + g) * a->max_slots;
                    float *o = obuf + q0 * hd;
                    for (int64_t c0 = 0; c0 < nc_all; c0 += NC) {
                        const int nc = (int)(nc_all - c0 < NC ? nc_all - c0 : NC);
                        if (qn == 4) pv_q8_tile8(pf, &src, run, run_end, hd, rb, c0, o, 4, 2);
                        else if (qn == 2 && nc == 4) pv_q8_tile8(pf, &src, run, run_end, hd, rb, c0, o, 2, 4);
                        else if (qn == 2) pv_q8_tile8(pf, &src, run, run_end, hd, rb, c0, o, 2, 2);
                        else if (nc == 8) pv_q8_tile8(pf, &src, run, run_end, hd, rb, c0, o, 1, 8);
                        else pv_q8_tile8(pf, &src, run, run_end, hd, rb, c0, o, 1, 4);
                    }
                    q0 += qn;
                }
            }
            for (int64_t qi = 0; qi < Q; qi++) {
                float *orow = a->out + (qrow[qi] * a->heads + qhead[qi]) * hd;
                for (int64_t d = 0; d < hd; d += 8)
                    _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(obuf + qi * hd + d), _mm256_set1_ps(inv[qi])));
            }
        }
}

#include "quant.h"
#include "repack.h"

#define TL_HAS_PACKED 1    /* forward.h may call tl_linear_packed */
#define TL_HAS_ATTN_BF16 1 /* and tl_attention_bf16 */
#include "forward.h"
