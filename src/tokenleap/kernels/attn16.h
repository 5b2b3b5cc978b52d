/* tokenleap kernels: attention over a bf16 KV cache in a slot-blocked layout, the parts both
 * variants share (the layout, the writes, token-tree tails, the jobs); each variant defines
 * attn16_task, the arithmetic (kernels.c: vdpbf16ps on 16 lanes; kernels_avx2.c: bf16 widened
 * to fp32 by a shift and a mask, FMAs on 8 lanes).
 *
 * Per (layer, kv head) the cache holds cap * hd bf16 values:
 *   K: [cap/16][hd/2][16][2]  a block of 16 slots; for each pair of dims, the 16 slots' pairs:
 *      64 bytes hold one dim pair of 16 slots' keys, so a query's scores of 16 slots need no
 *      horizontal sums.
 *   V: [cap/2][hd][2]         for each pair of slots, the pair's value of every dim: 64 bytes
 *      hold two slots' values of 16 dims.
 * Queries and probabilities are rounded to bf16 (as transformers does in bf16) and accumulate
 * in fp32 (a bf16 x bf16 product is exact in fp32). Rows of one sequence (a verified draft)
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

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    tl_counter ctr;
    const uint32_t *qb; /* [rows, heads, hd/2] bf16 pairs of the rotated queries */
    float *out;
    const int64_t *kv_base, *cap, *slot_end, *slot_lo, *mask_start, *chunk;
    const uint16_t *tail;
    int64_t tail_slots;
    float *scratch; /* AQ * max_slots floats per pool thread */
    int64_t layer, heads, kv_heads, hd, span, max_slots;
    float scale;
} attn16_ctx;

/* Where a job's K and V live: 16-slot blocks before `split` in the cache, from `split` on in
 * the row's tree tail. */
typedef struct { const uint16_t *k, *v, *tk, *tv; int64_t split; } kv_src;

/* One job: the queries (row, head) of chunk c that share kv head kh. Fills the sources, each
 * query's row, head and bf16 pairs; returns the number of queries, *nb the 16-slot blocks to read. */
static inline int64_t attn16_job(const attn16_ctx *a, int64_t job, kv_src *src, int64_t *qrow, int64_t *qhead,
                                 const uint32_t **qp, int64_t *nb) {
    const int64_t hd = a->hd, group = a->heads / a->kv_heads, span = a->span, jobs_per_chunk = a->heads / span;
    const int64_t c = job / jobs_per_chunk, h_first = (job % jobs_per_chunk) * span, kh = h_first / group;
    const int64_t r0 = a->chunk[c], nrows = a->chunk[c + 1] - r0, Q = nrows * span;
    const int64_t plane = a->kv_heads * a->cap[r0] * hd;
    const uint16_t *kbase = (const uint16_t *)a->kv_base[r0] + a->layer * 2 * plane + kh * a->cap[r0] * hd;
    *src = (kv_src){kbase, kbase + plane, NULL, NULL, INT64_MAX / 16};
    if (a->mask_start && a->mask_start[r0] >= 0) { /* a tree row (its own chunk): tail from its path */
        src->split = a->mask_start[r0] / 16;
        src->tk = a->tail + (r0 * a->kv_heads + kh) * 2 * a->tail_slots * hd;
        src->tv = src->tk + a->tail_slots * hd;
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

static void attn16_task(void *arg, int tid, int nthreads); /* the variant's arithmetic */

/* One decoder layer's attention for `rows` new tokens (of one or several sequences) over bf16
 * caches in the layout above. qkv: [rows, (heads + 2 kv_heads) * hd] fp32 (bias added); row r
 * is position pos[r] of the sequence whose cache ([layers, 2, kv_heads, cap[r] * hd] bf16,
 * zero-initialised, cap a multiple of 16) starts at kv_base[r]. Row r's rotated key and value
 * go to slot wslot[r] of `layer`, and the row attends to slots 0 .. slot_end[r]-1. Rows of one
 * sequence must be consecutive.
 * Token trees: when `mask` is given, a row with mask_start[r] = m >= 0 is a tree row: it sees
 * slots 0 .. m-1 and the tree slots m + j with mask[r * mask_w + j] != 0 (its ancestors and
 * itself, in order), and slot_end[r] = m + their count. Its attention runs over a virtual cache
 * whose slots from m on are exactly that path, copied to `tail` (rows * kv_heads * 2 *
 * tail_slots * hd halves, tail_slots a multiple of 16 >= 15 + mask_w), so that it computes
 * what decoding the path token by token computes, bit for bit.
 * qb: rows * heads * hd/2 uint32; chunk: rows + 1 int64; scratch: (pool threads) * AQ *
 * max_slots floats (max_slots a multiple of 16, >= every slot_end). out: [rows, heads * hd].
 * slot_lo (optional): row r sees no slot below slot_lo[r] (a sliding window; probability 0, as
 * for every slot it may not see).
 * hd 16, 32, 64, 128 or 256. */
void tl_attention_bf16(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
                       const int64_t *kv_base, const int64_t *cap, const int64_t *wslot, int64_t layer,
                       float *out, uint32_t *qb, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                       const int64_t *slot_end, const int64_t *slot_lo, const int64_t *mask_start, const uint8_t *mask, int64_t mask_w,
                       uint16_t *tail, int64_t tail_slots, int64_t *chunk, float *scratch, int64_t max_slots) {
    const int64_t group = heads / kv_heads, width = (heads + 2 * kv_heads) * hd;
    float tmp[256];
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + pos[r] * hd, *sn = sin + pos[r] * hd;
        const int64_t plane = kv_heads * cap[r] * hd, s = wslot[r];
        uint16_t *kl = (uint16_t *)kv_base[r] + layer * 2 * plane, *vl = kl + plane;
        for (int64_t h = 0; h < heads; h++) {
            rope_head(row + h * hd, tmp, c, sn, hd);
            uint32_t *dst = qb + (r * heads + h) * (hd / 2);
            for (int64_t i = 0; i < hd / 2; i++) dst[i] = (uint32_t)bf16_round(tmp[2 * i]) | ((uint32_t)bf16_round(tmp[2 * i + 1]) << 16);
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            rope_head(row + (heads + h) * hd, tmp, c, sn, hd);
            uint16_t *kh = kl + h * cap[r] * hd + (s / 16) * 16 * hd + (s % 16) * 2;
            for (int64_t d = 0; d < hd; d++) kh[(d / 2) * 32 + (d & 1)] = bf16_round(tmp[d]);
            const float *v = row + (heads + kv_heads + h) * hd;
            uint16_t *vh = vl + h * cap[r] * hd + (s / 2) * 2 * hd + (s & 1);
            for (int64_t d = 0; d < hd; d++) vh[d * 2] = bf16_round(v[d]);
        }
    }
    /* tree rows: the cached part of the block holding slot m, then the row's path, in order */
    for (int64_t r = 0; mask && r < rows; r++) {
        const int64_t m = mask_start[r];
        if (m < 0) continue;
        const int64_t base = m / 16 * 16, plane = kv_heads * cap[r] * hd;
        const uint16_t *kl = (const uint16_t *)kv_base[r] + layer * 2 * plane, *vl = kl + plane;
        for (int64_t h = 0; h < kv_heads; h++) {
            const uint16_t *kc = kl + h * cap[r] * hd, *vc = vl + h * cap[r] * hd;
            uint16_t *tk = tail + (r * kv_heads + h) * 2 * tail_slots * hd, *tv = tk + tail_slots * hd;
            memcpy(tk, kc + base * hd, (size_t)(16 * hd) * sizeof(uint16_t)); /* block of slots base..base+15 */
            memcpy(tv, vc + base * hd, (size_t)(16 * hd) * sizeof(uint16_t)); /* their 8 value pairs */
            int64_t t = m - base;
            for (int64_t j = 0; j < mask_w; j++) {
                if (!mask[r * mask_w + j]) continue;
                const int64_t src = m + j;
                for (int64_t d = 0; d < hd; d++) {
                    tk[(t / 16) * 16 * hd + (d / 2) * 32 + (t % 16) * 2 + (d & 1)] = kc[(src / 16) * 16 * hd + (d / 2) * 32 + (src % 16) * 2 + (d & 1)];
                    tv[(t / 2) * 2 * hd + d * 2 + (t & 1)] = vc[(src / 2) * 2 * hd + d * 2 + (src & 1)];
                }
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
                      tail, tail_slots, scratch, layer, heads, kv_heads, hd, span, max_slots,
                      1.0f / sqrtf((float)hd)};
    tl_parallel(attn16_task, &ctx);
}
