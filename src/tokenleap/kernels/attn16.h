/* tokenleap kernels: attention over a blocked KV cache, bf16 or q8_0, in a slot-blocked layout,
 * the parts both variants share (the layouts, the writes, token-tree tails, the jobs); each
 * variant defines attn16_task, the arithmetic (kernels.c: vdpbf16ps / vpdpbusd on 16 lanes;
 * kernels_avx2.c: bf16 widened to fp32 by a shift and a mask, int8 by vpmaddubsw, FMAs on 8 lanes).
 *
 * Per (layer, kv head) the cache holds cap slots of rb bytes each (cap a multiple of 16):
 * bf16 (rb = 2 hd):
 *   K: [cap/16][hd/2][16][2]  a block of 16 slots; for each pair of dims, the 16 slots' pairs:
 *      64 bytes hold one dim pair of 16 slots' keys, so a query's scores of 16 slots need no
 *      horizontal sums.
 *   V: [cap/2][hd][2]         for each pair of slots, the pair's value of every dim: 64 bytes
 *      hold two slots' values of 16 dims.
 * q8_0 (rb = hd + hd/16: ggml's q8_0, 32 int8 values and one fp16 scale per 32 dims):
 *   K: [cap/16] blocks of 16 rb bytes: int8 [hd/4][16][4] (64 bytes hold 4 dims of 16 slots,
 *      one vpdpbusd per query adds them to 16 slots' integer sums), then fp16 scales [hd/32][16].
 *   V: [cap/16] blocks of 16 rb bytes: int8 [16][hd] (a slot's values in a row), then fp16
 *      scales [hd/32][16] (a block's 16 weights p * d of a dim block are one vector product).
 *   A value x of a 32-dim block is q * d: d = fp16(max |x| / 127), q = round-to-even(x / d)
 *   (q8_quantize; KVCache.write quantizes the same way in torch, bit for bit). Queries are
 *   quantized the same way (as llama.cpp does for a q8_0 K), so a score is a chain over the
 *   dim blocks of exact integer sums times the two scales; probabilities stay fp32, and P.V
 *   widens each value to fp32 and adds p * d * q in slot order.
 * bf16: queries and probabilities are rounded to bf16 (as transformers does in bf16) and
 * accumulate in fp32 (a bf16 x bf16 product is exact in fp32). Rows of one sequence (a verified draft)
 * are processed together, so its K and V are read once for up to AQ (row, head) queries
 * sharing a kv head instead of once per row; the work per query is the same instruction
 * sequence whatever the other queries are (the scores of a slot: a fixed chain over dim pairs;
 * softmax: a fixed lane-wise max and sum over the blocks in order; P.V: a fixed chain over slot
 * pairs). Slots a row may not see get probability 0, which adds exact zeros, so a verified row
 * equals the decoded one bit for bit. Storage must start zeroed (0 x garbage could be NaN). */
#pragma once
#include "pool.h"
#include "rope.h"

#define AQ 32 /* queries per job at most */
#define TL_KV_BF16 0 /* the cache's formats (tl_attention_bf16's kv_type) */
#define TL_KV_Q8_0 1

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One 32-value block to q8_0: q[i] = round-to-even(x[i] / d), d = fp16(max |x| / 127) (its
 * fp16 bits to *dh), clamped to [-127, 127]; all zero when d is 0. Plain IEEE float steps
 * (the build has -ffp-contract=off), so torch's quantization in KVCache.write gives the same
 * bits. Returns d as fp32. */
static inline float q8_quantize(const float *x, int8_t *q, uint16_t *dh) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    *dh = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const float d = _cvtsh_ss(*dh);
    for (int i = 0; i < 32; i++) {
        const float v = d == 0.0f ? 0.0f : nearbyintf(x[i] / d);
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
    }
    return d;
}

typedef struct {
    tl_counter ctr;
    const uint32_t *qb; /* per (row, head) 2 hd bytes: the rotated query as hd/2 bf16 pairs, or (q8_0) q8_query */
    float *out;
    const int64_t *kv_base, *cap, *slot_end, *slot_lo, *mask_start, *chunk;
    const uint16_t *tail;
    int64_t tail_slots;
    float *scratch; /* AQ * max_slots floats per pool thread */
    int64_t layer, heads, kv_heads, hd, span, max_slots;
    int64_t rb; /* bytes of a slot of one kv head (2 hd, or hd + hd/16 for q8_0) */
    float scale;
} attn16_ctx;

/* A query over a q8_0 cache, in the 2 hd bytes of its (row, head) in qb: int8 q[hd], fp32
 * scales d[hd/32], int32 block sums of q [hd/32] (for vpdpbusd's unsigned operand). */
static inline const float *q8_query_scales(const uint8_t *q, int64_t hd) { return (const float *)(q + hd); }
static inline const int32_t *q8_query_sums(const uint8_t *q, int64_t hd) { return (const int32_t *)(q + hd + hd / 8); }

/* Where a job's K and V live: 16-slot blocks before `split` in the cache, from `split` on in
 * the row's tree tail (byte addresses of the (layer, kv head) planes). */
typedef struct { const uint8_t *k, *v, *tk, *tv; int64_t split; } kv_src;

/* One job: the queries (row, head) of chunk c that share kv head kh. Fills the sources, each
 * query's row, head and bf16 pairs; returns the number of queries, *nb the 16-slot blocks to read. */
static inline int64_t attn16_job(const attn16_ctx *a, int64_t job, kv_src *src, int64_t *qrow, int64_t *qhead,
                                 const uint32_t **qp, int64_t *nb) {
    const int64_t hd = a->hd, group = a->heads / a->kv_heads, span = a->span, jobs_per_chunk = a->heads / span;
    const int64_t c = job / jobs_per_chunk, h_first = (job % jobs_per_chunk) * span, kh = h_first / group;
    const int64_t r0 = a->chunk[c], nrows = a->chunk[c + 1] - r0, Q = nrows * span;
    const int64_t plane = a->kv_heads * a->cap[r0] * a->rb;
    const uint8_t *kbase = (const uint8_t *)a->kv_base[r0] + a->layer * 2 * plane + kh * a->cap[r0] * a->rb;
    *src = (kv_src){kbase, kbase + plane, NULL, NULL, INT64_MAX / 16};
    if (a->mask_start && a->mask_start[r0] >= 0) { /* a tree row (its own chunk): tail from its path */
        src->split = a->mask_start[r0] / 16;
        src->tk = (const uint8_t *)a->tail + (r0 * a->kv_heads + kh) * 2 * a->tail_slots * a->rb;
        src->tv = src->tk + a->tail_slots * a->rb;
    }
    int64_t nmax = 0;
    for (int64_t r = r0; r < r0 + nrows; r++) nmax = a->slot_end[r] > nmax ? a->slot_end[r] : nmax;
    *nb = (nmax + 15) / 16;
    for (int64_t i = 0; i < Q; i++) {
        qrow[i] = r0 + i / span;
        qhead[i] = h_first + i % span;
        qp[i] = a->qb + (qrow[i] * a->heads + qhead[i]) * (hd / 2);
    }
    return Q;
}

/* Which of the 16 slots j0 .. j0+15 a row sees: below slot_end, not below slot_lo. */
static inline uint32_t attn16_valid(int64_t send, int64_t lo, int64_t j0) {
    uint32_t valid = send - j0 >= 16 ? 0xffffu : send > j0 ? (1u << (send - j0)) - 1u : 0u;
    if (lo > j0) valid &= lo - j0 >= 16 ? 0u : ~((1u << (lo - j0)) - 1u); /* below a sliding window */
    return valid;
}

static void attn16_task(void *arg, int tid, int nthreads);  /* the variant's arithmetic: bf16 */
static void attn_q8_task(void *arg, int tid, int nthreads); /* and q8_0 */

/* Row r's rotated query, key and value (tmp: room for hd floats): bf16 or q8_0 into the query
 * buffer and slot s of the (layer) planes kl / vl of its cache (cap slots a kv head). */
static void attn16_write_row(const float *row, const float *c, const float *sn, uint8_t *kl, uint8_t *vl, uint8_t *qdst,
                             int64_t s, int64_t cap, int64_t heads, int64_t kv_heads, int64_t hd, int64_t rb, int kv_type) {
    float tmp[256];
    for (int64_t h = 0; h < heads; h++) {
        rope_head(row + h * hd, tmp, c, sn, hd);
        uint8_t *dst = qdst + h * 2 * hd;
        if (kv_type == TL_KV_Q8_0) {
            float *d = (float *)(dst + hd);
            int32_t *sum = (int32_t *)(dst + hd + hd / 8);
            for (int64_t b = 0; b < hd / 32; b++) {
                uint16_t dh;
                int8_t *q = (int8_t *)dst + b * 32;
                d[b] = q8_quantize(tmp + b * 32, q, &dh);
                int32_t t = 0;
                for (int i = 0; i < 32; i++) t += q[i];
                sum[b] = t;
            }
        } else {
            uint32_t *pairs = (uint32_t *)dst;
            for (int64_t i = 0; i < hd / 2; i++) pairs[i] = (uint32_t)bf16_round(tmp[2 * i]) | ((uint32_t)bf16_round(tmp[2 * i + 1]) << 16);
        }
    }
    for (int64_t h = 0; h < kv_heads; h++) {
        rope_head(row + (heads + h) * hd, tmp, c, sn, hd);
        const float *v = row + (heads + kv_heads + h) * hd;
        uint8_t *kp = kl + h * cap * rb + (s / 16) * 16 * rb, *vp = vl + h * cap * rb;
        if (kv_type == TL_KV_Q8_0) {
            int8_t q[256];
            uint8_t *vb = vp + (s / 16) * 16 * rb;
            uint16_t *kscale = (uint16_t *)(kp + 16 * hd), *vscale = (uint16_t *)(vb + 16 * hd);
            for (int64_t b = 0; b < hd / 32; b++) {
                q8_quantize(tmp + b * 32, q + b * 32, &kscale[b * 16 + s % 16]);
                q8_quantize(v + b * 32, (int8_t *)vb + (s % 16) * hd + b * 32, &vscale[b * 16 + s % 16]);
            }
            for (int64_t d = 0; d < hd; d++) kp[(d / 4) * 64 + (s % 16) * 4 + (d & 3)] = (uint8_t)q[d];
        } else {
            uint16_t *kh = (uint16_t *)kp + (s % 16) * 2, *vh = (uint16_t *)vp + (s / 2) * 2 * hd + (s & 1);
            for (int64_t d = 0; d < hd; d++) kh[(d / 2) * 32 + (d & 1)] = bf16_round(tmp[d]);
            for (int64_t d = 0; d < hd; d++) vh[d * 2] = bf16_round(v[d]);
        }
    }
}

/* Slot `src` of a cache plane (K kc, V vc) to slot t of a tail plane (tk, tv), in either format. */
static void attn16_copy_slot(const uint8_t *kc, const uint8_t *vc, int64_t src, uint8_t *tk, uint8_t *tv, int64_t t,
                             int64_t hd, int64_t rb, int kv_type) {
    if (kv_type == TL_KV_Q8_0) {
        const uint8_t *ks = kc + (src / 16) * 16 * rb, *vs = vc + (src / 16) * 16 * rb;
        uint8_t *kd = tk + (t / 16) * 16 * rb, *vd = tv + (t / 16) * 16 * rb;
        for (int64_t g = 0; g < hd / 4; g++) memcpy(kd + g * 64 + (t % 16) * 4, ks + g * 64 + (src % 16) * 4, 4);
        memcpy(vd + (t % 16) * hd, vs + (src % 16) * hd, (size_t)hd);
        for (int64_t b = 0; b < hd / 32; b++) {
            memcpy(kd + 16 * hd + (b * 16 + t % 16) * 2, ks + 16 * hd + (b * 16 + src % 16) * 2, 2);
            memcpy(vd + 16 * hd + (b * 16 + t % 16) * 2, vs + 16 * hd + (b * 16 + src % 16) * 2, 2);
        }
        return;
    }
    const uint16_t *k16 = (const uint16_t *)kc, *v16 = (const uint16_t *)vc;
    uint16_t *tk16 = (uint16_t *)tk, *tv16 = (uint16_t *)tv;
    for (int64_t d = 0; d < hd; d++) {
        tk16[(t / 16) * 16 * hd + (d / 2) * 32 + (t % 16) * 2 + (d & 1)] = k16[(src / 16) * 16 * hd + (d / 2) * 32 + (src % 16) * 2 + (d & 1)];
        tv16[(t / 2) * 2 * hd + d * 2 + (t & 1)] = v16[(src / 2) * 2 * hd + d * 2 + (src & 1)];
    }
}

/* One decoder layer's attention for `rows` new tokens (of one or several sequences) over
 * blocked caches in a layout above (kv_type TL_KV_BF16 or TL_KV_Q8_0; q8_0 needs hd a multiple
 * of 32). qkv: [rows, (heads + 2 kv_heads) * hd] fp32 (bias added); row r
 * is position pos[r] of the sequence whose cache ([layers, 2, kv_heads, cap[r] slots] of rb
 * bytes, zero-initialised, cap a multiple of 16) starts at kv_base[r]. Row r's rotated key and value
 * go to slot wslot[r] of `layer`, and the row attends to slots 0 .. slot_end[r]-1. Rows of one
 * sequence must be consecutive.
 * Token trees: when `mask` is given, a row with mask_start[r] = m >= 0 is a tree row: it sees
 * slots 0 .. m-1 and the tree slots m + j with mask[r * mask_w + j] != 0 (its ancestors and
 * itself, in order), and slot_end[r] = m + their count. Its attention runs over a virtual cache
 * whose slots from m on are exactly that path, copied to `tail` (rows * kv_heads * 2 *
 * tail_slots * rb bytes, tail_slots a multiple of 16 >= 15 + mask_w), so that it computes
 * what decoding the path token by token computes, bit for bit.
 * qb: rows * heads * hd/2 uint32; chunk: rows + 1 int64; scratch: (pool threads) * AQ *
 * max_slots floats (max_slots a multiple of 16, >= every slot_end). out: [rows, heads * hd].
 * slot_lo (optional): row r sees no slot below slot_lo[r] (a sliding window; probability 0, as
 * for every slot it may not see).
 * hd 16, 32, 64, 128 or 256. */
static void tl_attention_bf16(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
                       const int64_t *kv_base, const int64_t *cap, const int64_t *wslot, int64_t layer,
                       float *out, uint32_t *qb, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                       const int64_t *slot_end, const int64_t *slot_lo, const int64_t *mask_start, const uint8_t *mask, int64_t mask_w,
                       uint16_t *tail, int64_t tail_slots, int64_t *chunk, float *scratch, int64_t max_slots, int64_t kv_type) {
    const int64_t group = heads / kv_heads, width = (heads + 2 * kv_heads) * hd;
    const int64_t rb = kv_type == TL_KV_Q8_0 ? hd + hd / 16 : 2 * hd;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t plane = kv_heads * cap[r] * rb;
        uint8_t *kl = (uint8_t *)kv_base[r] + layer * 2 * plane;
        attn16_write_row(qkv + r * width, cos + pos[r] * hd, sin + pos[r] * hd, kl, kl + plane, (uint8_t *)qb + r * heads * 2 * hd,
                         wslot[r], cap[r], heads, kv_heads, hd, rb, (int)kv_type);
    }
    /* tree rows: the cached part of the block holding slot m, then the row's path, in order */
    for (int64_t r = 0; mask && r < rows; r++) {
        const int64_t m = mask_start[r];
        if (m < 0) continue;
        const int64_t base = m / 16 * 16, plane = kv_heads * cap[r] * rb;
        const uint8_t *kl = (const uint8_t *)kv_base[r] + layer * 2 * plane, *vl = kl + plane;
        for (int64_t h = 0; h < kv_heads; h++) {
            const uint8_t *kc = kl + h * cap[r] * rb, *vc = vl + h * cap[r] * rb;
            uint8_t *tk = (uint8_t *)tail + (r * kv_heads + h) * 2 * tail_slots * rb, *tv = tk + tail_slots * rb;
            memcpy(tk, kc + base * rb, (size_t)(16 * rb)); /* block of slots base..base+15 */
            memcpy(tv, vc + base * rb, (size_t)(16 * rb)); /* their values */
            int64_t t = m - base;
            for (int64_t j = 0; j < mask_w; j++) {
                if (!mask[r * mask_w + j]) continue;
                attn16_copy_slot(kc, vc, m + j, tk, tv, t, hd, rb, (int)kv_type);
                t++;
            }
        }
    }
    /* chunks: runs of consecutive rows of one sequence, at most AQ / group rows each; a tree
     * row is a chunk of its own */
    const int64_t max_rows = AQ / group > 0 ? AQ / group : 1;
    int64_t nchunks = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int tree = mask && mask_start[r] >= 0, prev_tree = r > 0 && mask && mask_start[r - 1] >= 0;
        if (r == 0 || tree || prev_tree || kv_base[r] != kv_base[r - 1] || r - chunk[nchunks - 1] >= max_rows) chunk[nchunks++] = r;
    }
    chunk[nchunks] = rows;
    /* Few jobs (decoding one sequence): one per query head, so both threads get work; else one
     * per kv head, reading K and V once for the heads that share them (unless more than AQ
     * heads share one). Same arithmetic. */
    const int64_t span = nchunks * kv_heads < 2 * pool.n || group > AQ ? 1 : group;
    attn16_ctx ctx = {{0, nchunks * heads / span, 1}, qb, out, kv_base, cap, slot_end, slot_lo, mask ? mask_start : NULL, chunk,
                      tail, tail_slots, scratch, layer, heads, kv_heads, hd, span, max_slots, rb,
                      1.0f / sqrtf((float)hd)};
    tl_parallel(kv_type == TL_KV_Q8_0 ? attn_q8_task : attn16_task, &ctx);
}
