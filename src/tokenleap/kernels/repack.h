/* tokenleap kernels: GGUF blocks -> quant.h's interleaved groups, at load (the C form of
 * QuantWeight's numpy repack, which stays the tests' reference: the bytes must be equal).
 *
 * llama.cpp repacks its Q4_0 / Q4_K / Q8_0 tensors the same way at load
 * (ggml-cpu/repack.cpp): eight outputs' blocks side by side so a vector lane is an output.
 * Here each group of 8 outputs is rewritten independently (the pool's threads take runs of
 * groups), reading the file's bytes once: ~1-3 GB/s a core where numpy's strided passes
 * made 0.1-0.4 G weights/s, so an 8B file loads in seconds. Included once per variant after
 * quant.h (formats and group sizes). */
#pragma once
#include "pool.h"

/* GGML type ids of the blocks read here */
#define RP_Q4_0 2
#define RP_Q4_1 3
#define RP_Q5_0 6
#define RP_Q5_1 7
#define RP_Q8_0 8
#define RP_Q4_K 12
#define RP_Q5_K 13
#define RP_Q6_K 14
#define RP_IQ4_NL 20
#define RP_IQ4_XS 23
#define RP_Q3_K 11
#define RP_Q2_K 10

static inline float rp_f16(const uint8_t *p) { /* exact f16 -> f32 (F16C) */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4X8's 128 nibble bytes of one block from 8 outputs' values q[o][0..31] in 0..15 */
static inline void rp_nibbles(uint8_t q[8][32], uint8_t *dst) {
    for (int t = 0; t < 4; t++)
        for (int o = 0; o < 8; o++)
            for (int i = 0; i < 4; i++) dst[t * 32 + o * 4 + i] = (uint8_t)(q[o][4 * t + i] | q[o][16 + 4 * t + i] << 4);
}

/* one group of 8 outputs: src rows 8 g .. 8 g + 7 (row_bytes each) -> dst (the group's bytes) */
static void rp_group(const uint8_t *src, int64_t row_bytes, uint8_t *dst, int qtype, int64_t in_dim) {
    const int64_t nb = in_dim / 32;
    if (qtype == RP_Q4_0 || qtype == RP_Q4_1 || qtype == RP_IQ4_NL) { /* Q40X8 / IQ4NL (144), Q4X8 (160): d[8] (m[8]) nibbles */
        const int bb = qtype == RP_Q4_1 ? 20 : 18, gb = qtype == RP_Q4_1 ? 160 : 144;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + b * gb;
            for (int o = 0; o < 8; o++) {
                const uint8_t *blk = src + o * row_bytes + b * bb;
                memcpy(out + 2 * o, blk, 2);
                if (qtype == RP_Q4_1) memcpy(out + 16 + 2 * o, blk + 2, 2);
                const uint8_t *qs = blk + bb - 16; /* byte l: input l low, l + 16 high: one nibble byte as is */
                for (int t = 0; t < 4; t++) memcpy(out + gb - 128 + t * 32 + o * 4, qs + 4 * t, 4);
            }
        }
    } else if (qtype == RP_Q5_0 || qtype == RP_Q5_1) { /* Q50X8 (176) / Q51X8 (192): d[8] (m[8]) nibbles, fifth bits */
        const int q51 = qtype == RP_Q5_1, bb = q51 ? 24 : 22, gb = q51 ? 192 : 176, nib = q51 ? 32 : 16;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + b * gb;
            for (int o = 0; o < 8; o++) {
                const uint8_t *blk = src + o * row_bytes + b * bb;
                memcpy(out + 2 * o, blk, 2);
                if (q51) memcpy(out + 16 + 2 * o, blk + 2, 2);
                uint32_t qh;
                memcpy(&qh, blk + (q51 ? 4 : 2), 4); /* after d (and m) */
                const uint8_t *qs = blk + bb - 16; /* byte l: input l low, l + 16 high */
                for (int t = 0; t < 4; t++) memcpy(out + nib + t * 32 + o * 4, qs + 4 * t, 4);
                for (int i = 0; i < 4; i++) { /* byte (o, i): input 4 b + i's fifth bit at bit b */
                    uint8_t h = 0;
                    for (int bit = 0; bit < 8; bit++) h |= (uint8_t)(((qh >> (4 * bit + i)) & 1) << bit);
                    out[nib + 128 + o * 4 + i] = h;
                }
            }
        }
    } else if (qtype == RP_Q3_K) { /* Q3K (880 per superblock): d[8], scales 3 x (8 x 4), 8 blocks of 96 */
        for (int64_t s = 0; s < in_dim / 256; s++) {
            uint8_t *out = dst + s * TLQ_Q3K_SB;
            memset(out, 0, TLQ_Q3K_SB);
            for (int o = 0; o < 8; o++) {
                const uint8_t *sb = src + o * row_bytes + s * 110; /* hmask[32], qs[64], scales[12], f16 d */
                memcpy(out + 2 * o, sb + 108, 2);
                for (int v = 0; v < 3; v++) memcpy(out + 16 + 32 * v + 4 * o, sb + 96 + 4 * v, 4);
                for (int x = 0; x < 256; x++) { /* value x: ggml's dequantize_row_q3_K order */
                    const int n = x / 128, j = (x % 128) / 32, l = x % 32;
                    const int q = ((sb[32 + 32 * n + l] >> (2 * j)) & 3) | ((sb[l] >> (4 * n + j)) & 1) << 2;
                    const int b = x / 32, g = (x % 32) / 4, i = x % 4;
                    uint8_t *body = out + 112 + 96 * b;
                    body[32 * (g / 4) + 4 * o + i] |= (uint8_t)((q & 3) << (2 * (g % 4)));
                    body[64 + 4 * o + i] |= (uint8_t)((q >> 2) << g);
                }
            }
        }
    } else if (qtype == RP_Q2_K) { /* Q2K (672 per superblock): d[8], dmin[8], scales 4 x (8 x 4), 8 blocks of 64 */
        for (int64_t s = 0; s < in_dim / 256; s++) {
            uint8_t *out = dst + s * TLQ_Q2K_SB;
            memset(out, 0, TLQ_Q2K_SB);
            for (int o = 0; o < 8; o++) {
                const uint8_t *sb = src + o * row_bytes + s * 84; /* scales[16], qs[64], f16 d, f16 dmin */
                memcpy(out + 2 * o, sb + 80, 2);
                memcpy(out + 16 + 2 * o, sb + 82, 2);
                for (int v = 0; v < 4; v++) memcpy(out + 32 + 32 * v + 4 * o, sb + 4 * v, 4);
                for (int x = 0; x < 256; x++) { /* value x: ggml's dequantize_row_q2_K order */
                    const int n = x / 128, j = (x % 128) / 32, l = x % 32;
                    const int q = (sb[16 + 32 * n + l] >> (2 * j)) & 3;
                    const int b = x / 32, g = (x % 32) / 4, i = x % 4;
                    out[160 + 64 * b + 32 * (g / 4) + 4 * o + i] |= (uint8_t)(q << (2 * (g % 4)));
                }
            }
        }
    } else if (qtype == RP_IQ4_XS) { /* IQ4XS (1088 per superblock): d[8], scales_l[8][4], scales_h[8][2], 8 x 128 nibble bytes */
        for (int64_t s = 0; s < in_dim / 256; s++) {
            uint8_t *out = dst + s * TLQ_IQ4XS_SB;
            for (int o = 0; o < 8; o++) {
                const uint8_t *sb = src + o * row_bytes + s * 136; /* f16 d, u16 scales_h, u8 scales_l[4], qs[128] */
                memcpy(out + 2 * o, sb, 2);
                memcpy(out + 16 + 4 * o, sb + 4, 4);
                memcpy(out + 48 + 2 * o, sb + 2, 2);
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) memcpy(out + 64 + 128 * j + t * 32 + o * 4, sb + 8 + 16 * j + 4 * t, 4);
            }
        }
    } else if (qtype == RP_Q8_0) { /* Q8X8 (272): d[8], byte (g, o, i) = q[o][4 g + i] */
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + b * 272;
            for (int o = 0; o < 8; o++) {
                const uint8_t *blk = src + o * row_bytes + b * 34;
                memcpy(out + 2 * o, blk, 2);
                for (int g = 0; g < 8; g++) memcpy(out + 16 + g * 32 + o * 4, blk + 2 + 4 * g, 4);
            }
        }
    } else if (qtype == RP_Q4_K || qtype == RP_Q5_K) { /* Q4K (1152 per superblock) / Q5K (1408) */
        const int q5 = qtype == RP_Q5_K, bb = q5 ? 176 : 144, sub = q5 ? 160 : 128, qs0 = q5 ? 48 : 16;
        for (int64_t s = 0; s < in_dim / 256; s++) {
            uint8_t *out = dst + s * (128 + 8 * sub), q[8][8][32], sc[8][8], mn[8][8]; /* [j][o] */
            for (int o = 0; o < 8; o++) {
                const uint8_t *blk = src + o * row_bytes + s * bb, *k = blk + 4;
                memcpy(out + 2 * o, blk, 2);
                memcpy(out + 16 + 2 * o, blk + 2, 2);
                for (int j = 0; j < 4; j++) {
                    sc[j][o] = k[j] & 63, mn[j][o] = k[j + 4] & 63;
                    sc[j + 4][o] = (k[j + 8] & 15) | (k[j] >> 6) << 4;
                    mn[j + 4][o] = (k[j + 8] >> 4) | (k[j + 4] >> 6) << 4;
                }
                for (int c = 0; c < 4; c++)
                    for (int l = 0; l < 32; l++) { /* Q5_K: qh[l] holds sub-block j's 5th bit at bit j */
                        q[2 * c][o][l] = blk[qs0 + 32 * c + l] & 15;
                        q[2 * c + 1][o][l] = blk[qs0 + 32 * c + l] >> 4;
                        if (q5) {
                            q[2 * c][o][l] |= (uint8_t)(((blk[16 + l] >> (2 * c)) & 1) << 4);
                            q[2 * c + 1][o][l] |= (uint8_t)(((blk[16 + l] >> (2 * c + 1)) & 1) << 4);
                        }
                    }
            }
            for (int p = 0; p < 64; p++) out[32 + p] = (uint8_t)((sc[p / 8][p % 8] & 15) | (mn[p / 8][p % 8] & 15) << 4);
            for (int k = 0; k < 32; k++) {
                const int a = k, b = k + 32;
                const uint8_t ha = (uint8_t)(sc[a / 8][a % 8] >> 4 | (mn[a / 8][a % 8] >> 4) << 2);
                const uint8_t hb = (uint8_t)(sc[b / 8][b % 8] >> 4 | (mn[b / 8][b % 8] >> 4) << 2);
                out[96 + k] = (uint8_t)(ha | hb << 4);
            }
            for (int j = 0; j < 8; j++) {
                uint8_t lo[8][32], *body = out + 128 + sub * j;
                for (int o = 0; o < 8; o++)
                    for (int l = 0; l < 32; l++) lo[o][l] = q[j][o][l] & 15;
                rp_nibbles(lo, body);
                if (q5)
                    for (int o = 0; o < 8; o++)
                        for (int i = 0; i < 4; i++) {
                            uint8_t v = 0;
                            for (int t = 0; t < 4; t++)
                                v |= (uint8_t)((q[j][o][4 * t + i] >> 4) << t | (q[j][o][16 + 4 * t + i] >> 4) << (4 + t));
                            body[128 + o * 4 + i] = v;
                        }
            }
        }
    } else { /* RP_Q6_K -> Q6K (1680 per superblock) */
        for (int64_t s = 0; s < in_dim / 256; s++) {
            uint8_t *out = dst + s * 1680, q[8][8][32]; /* [j][o]: unsigned 0..63 */
            for (int o = 0; o < 8; o++) {
                const uint8_t *blk = src + o * row_bytes + s * 210;
                memcpy(out + 2 * o, blk + 208, 2);
                for (int k = 0; k < 16; k++) out[16 + k * 8 + o] = blk[192 + k];
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                    for (int l = 0; l < 32; l++) {
                        q[4 * h][o][l] = (uint8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
                        q[4 * h + 1][o][l] = (uint8_t)((ql[32 + l] & 15) | ((qh[l] >> 2) & 3) << 4);
                        q[4 * h + 2][o][l] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
                        q[4 * h + 3][o][l] = (uint8_t)((ql[32 + l] >> 4) | ((qh[l] >> 6) & 3) << 4);
                    }
                }
            }
            for (int j = 0; j < 8; j++) {
                uint8_t lo[8][32], *body = out + 144 + 192 * j;
                for (int o = 0; o < 8; o++)
                    for (int l = 0; l < 32; l++) lo[o][l] = q[j][o][l] & 15;
                rp_nibbles(lo, body);
                for (int u = 0; u < 2; u++)
                    for (int o = 0; o < 8; o++)
                        for (int i = 0; i < 4; i++) {
                            uint8_t v = 0;
                            for (int t = 0; t < 4; t++) v |= (uint8_t)((q[j][o][4 * (4 * u + t) + i] >> 4) << (2 * t));
                            body[128 + u * 32 + o * 4 + i] = v;
                        }
            }
        }
    }
}

typedef struct {
    tl_counter ctr;
    const uint8_t *src;
    uint8_t *dst;
    int64_t row_bytes, group_bytes, in_dim;
    int qtype;
} rp_job;

static void rp_task(void *ctx, int tid, int nthreads) {
    rp_job *j = (rp_job *)ctx;
    (void)tid; (void)nthreads;
    int64_t end;
    for (int64_t g = tl_next(&j->ctr, &end); g < j->ctr.count; g = tl_next(&j->ctr, &end))
        for (; g < end && g < j->ctr.count; g++)
            rp_group(j->src + 8 * g * j->row_bytes, j->row_bytes, j->dst + g * j->group_bytes, j->qtype, j->in_dim);
}

/* src: a GGUF tensor's bytes [out_dim rows of in_dim / block * block bytes]; dst: out_dim / 8
 * groups of in_dim / 32 * (the format's bytes per 32 inputs). Returns 0, or -1 for a type or
 * shape this cannot repack (out_dim % 8, in_dim % 32, or % 256 for the K-quants). */
int tl_repack(const uint8_t *src, uint8_t *dst, int qtype, int64_t out_dim, int64_t in_dim) {
    const tlq_format *f = NULL;
    for (int i = 0; i < TLQ_NFORMATS; i++)
        if (tlq_formats[i].ggml_id == qtype) f = &tlq_formats[i];
    if (!f) return -1;
    const int format = f->kernel_id, bb = f->file_bytes, block = f->block_weights;
    if (out_dim % 8 || in_dim % block) return -1;
    const int64_t groups = out_dim / 8;
    rp_job job = {{0, groups, groups / (8 * pool.n) > 1 ? groups / (8 * pool.n) : 1}, src, dst, in_dim / block * bb,
                  in_dim / 32 * q_group_bytes(format), in_dim, qtype};
    tl_parallel(rp_task, &job);
    return 0;
}

/* Rows `ids` of a repacked weight, dequantized to fp32 `out` [n, in_dim] (a token-table lookup:
 * llama.cpp's get_rows): the values QuantWeight.dequantize gives, computed in the same float
 * steps (q * d + m; the K-quants' d * sc and -(dmin * m) first), so the bits are its bits. */
void tl_quant_rows(const uint8_t *w, int format, int64_t in_dim, const int64_t *ids, int64_t n, float *out) {
    const int64_t nb = in_dim / 32, group_stride = nb * q_group_bytes(format);
    for (int64_t r = 0; r < n; r++) {
        const int o = (int)(ids[r] % 8);
        const uint8_t *base = w + ids[r] / 8 * group_stride;
        float *y = out + r * in_dim;
        if (format == TLQ_Q4X8 || format == TLQ_Q40X8 || format == TLQ_IQ4NL || format == TLQ_Q8X8 || format == TLQ_Q50X8 || format == TLQ_Q51X8) {
            const int64_t gb = q_group_bytes(format);
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = base + b * gb;
                const float d = rp_f16(blk + 2 * o);
                float *yb = y + 32 * b;
                if (format == TLQ_Q8X8) {
                    for (int x = 0; x < 32; x++) yb[x] = (float)(int8_t)blk[16 + (x / 4) * 32 + o * 4 + x % 4] * d;
                    continue;
                }
                const int stored_m = format == TLQ_Q4X8 || format == TLQ_Q51X8, q5 = format == TLQ_Q50X8 || format == TLQ_Q51X8;
                const float m = stored_m ? rp_f16(blk + 16 + 2 * o) : d * (format == TLQ_Q50X8 ? -16.0f : -8.0f);
                const uint8_t *nib = blk + (stored_m ? 32 : 16);
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = nib[t * 32 + o * 4 + i];
                        if (q5) {
                            const uint8_t h = nib[128 + o * 4 + i];
                            yb[4 * t + i] = (float)((v & 15) | ((h >> t) & 1) << 4) * d + m;
                            yb[16 + 4 * t + i] = (float)((v >> 4) | ((h >> (4 + t)) & 1) << 4) * d + m;
                            continue;
                        }
                        if (format == TLQ_IQ4NL) {
                            yb[4 * t + i] = (float)tlq_iq4nl[v & 15] * d;
                            yb[16 + 4 * t + i] = (float)tlq_iq4nl[v >> 4] * d;
                            continue;
                        }
                        yb[4 * t + i] = (float)(v & 15) * d + m;
                        yb[16 + 4 * t + i] = (float)(v >> 4) * d + m;
                    }
            }
            continue;
        }
        const int64_t sb_bytes = 8 * q_group_bytes(format);
        for (int64_t s = 0; s < in_dim / 256; s++) {
            const uint8_t *sb = base + s * sb_bytes;
            const float d = rp_f16(sb + 2 * o);
            for (int j = 0; j < 8; j++) {
                float *yb = y + 256 * s + 32 * j;
                uint8_t q[32];
                const uint8_t *body = sb + (format == TLQ_Q6K ? 144 + 192 * j : format == TLQ_IQ4XS ? 64 + 128 * j : 128 + (format == TLQ_Q5K ? 160 : 128) * j);
                if (format == TLQ_Q2K) { /* w = d sc q - dmin m per 16 inputs */
                    const uint8_t *b2 = sb + 160 + 64 * j;
                    const float dmin = rp_f16(sb + 16 + 2 * o);
                    for (int x = 0; x < 32; x++) {
                        const int g = x / 4, i = x % 4, k = 2 * j + x / 16;
                        const int q = (b2[32 * (g / 4) + 4 * o + i] >> (2 * (g % 4))) & 3;
                        const uint8_t scm = sb[32 + 32 * (k / 4) + 4 * o + k % 4];
                        yb[x] = d * (float)(scm & 15) * (float)q - dmin * (float)(scm >> 4);
                    }
                    continue;
                }
                if (format == TLQ_Q3K) { /* w = d (sc - 32) (q - 4) per 16 inputs */
                    const uint8_t *b3 = sb + 112 + 96 * j;
                    for (int x = 0; x < 32; x++) {
                        const int g = x / 4, i = x % 4, k = 2 * j + x / 16;
                        const int q = ((b3[32 * (g / 4) + 4 * o + i] >> (2 * (g % 4))) & 3) | ((b3[64 + 4 * o + i] >> g) & 1) << 2;
                        uint32_t lw, hw;
                        memcpy(&lw, sb + 16 + 32 * ((k % 8) / 4) + 4 * o, 4);
                        memcpy(&hw, sb + 80 + 4 * o, 4);
                        const int sc = (int)((lw >> (8 * (k % 4) + 4 * (k / 8))) & 15 | ((hw >> (8 * (k % 4) + 2 * (k / 4))) & 3) << 4);
                        yb[x] = d * (float)(sc - 32) * (float)(q - 4);
                    }
                    continue;
                }
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = body[t * 32 + o * 4 + i];
                        q[4 * t + i] = v & 15, q[16 + 4 * t + i] = v >> 4;
                    }
                if (format == TLQ_IQ4XS) {
                    uint32_t sl;
                    uint16_t sh;
                    memcpy(&sl, sb + 16 + 4 * o, 4);
                    memcpy(&sh, sb + 48 + 2 * o, 2);
                    const float dl = d * (float)((int)((sl >> (4 * j)) & 15 | ((sh >> (2 * j)) & 3) << 4) - 32);
                    for (int x = 0; x < 32; x++) yb[x] = (float)tlq_iq4nl[q[x]] * dl;
                    continue;
                }
                if (format == TLQ_Q6K) {
                    const float lo = d * (float)(int8_t)sb[16 + (2 * j) * 8 + o], hi = d * (float)(int8_t)sb[16 + (2 * j + 1) * 8 + o];
                    for (int x = 0; x < 32; x++) {
                        const int g = x / 4, h = (body[128 + (g / 4) * 32 + o * 4 + x % 4] >> (2 * (g % 4))) & 3;
                        yb[x] = ((float)(q[x] | h << 4) - 32.0f) * (x < 16 ? lo : hi);
                    }
                    continue;
                }
                const int p = j * 8 + o, low = sb[32 + p], hi4 = (sb[96 + p % 32] >> (4 * (p / 32))) & 15;
                const float scale = d * (float)((low & 15) | (hi4 & 3) << 4);
                const float shift = -(rp_f16(sb + 16 + 2 * o) * (float)((low >> 4) | (hi4 >> 2) << 4));
                if (format == TLQ_Q5K)
                    for (int t = 0; t < 4; t++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t hb = body[128 + o * 4 + i];
                            q[4 * t + i] |= (uint8_t)(((hb >> t) & 1) << 4);
                            q[16 + 4 * t + i] |= (uint8_t)(((hb >> (4 + t)) & 1) << 4);
                        }
                for (int x = 0; x < 32; x++) yb[x] = (float)q[x] * scale + shift;
            }
        }
    }
}
