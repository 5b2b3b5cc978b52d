/* tokenleap kernels: a whole forward's decoder layers in one C call (the fused path: Llama,
 * Qwen2/3, Mistral, Gemma 3).
 *
 * A decode step of the default model makes ~150 kernel calls (per layer: the fused QKV linear,
 * attention, the output linear, the gate/up linear and the down linear); from Python each costs
 * ~4-10 us outside the kernel (argument conversion by ctypes, checks, output allocation), ~0.7-1.2
 * ms of a 3.5-8 ms step. `tl_forward_layers` runs the same sequence of the same kernel calls
 * on the same inputs in C, so its bits are exactly those of the per-call loop in
 * `LlamaModel.forward_batch` (tests/kernels/test_fused.py compares them).
 *
 * The attention's entry point is here too: tl_attention_run, its arguments one struct
 * (tl_attn_desc, mirrored by kernels/abi.py), which tl_forward_desc embeds.
 *
 * Included once per variant after quant.h; the variant defines TL_HAS_PACKED (tl_linear_packed)
 * and TL_HAS_ATTN_BF16 (tl_attention_bf16) when it has them. */
#pragma once
#include <stddef.h>
#include "pool.h"

#define TL_LIN_F32 0    /* dense fp32 [out, in] (tl_linear, wbits 32) */
#define TL_LIN_BF16 1   /* dense bf16 [out, in] (tl_linear, wbits 16) */
#define TL_LIN_PACKED 2 /* PackedWeight (tl_linear_packed) */
#define TL_LIN_QUANT 3  /* QuantWeight blocks (tl_linear_q) */

typedef struct {
    const void *w;
    const float *bias; /* fp32 [out] or NULL */
    int64_t out_dim;
    int32_t kind;   /* TL_LIN_* */
    int32_t format; /* TL_LIN_QUANT: the blocks' TLQ_* format */
} tl_lin_desc;

typedef struct {
    tl_lin_desc qkv, wo, gate_up, down;
    const float *attn_norm, *mlp_norm;           /* fp32 [dim] */
    const float *q_norm, *k_norm;                /* QK-norm (Qwen3, Gemma 3): fp32 [hd] each, or NULL */
    const float *post_attn_norm, *post_mlp_norm; /* post-norms (Gemma 3): fp32 [dim] each, or NULL */
    int32_t local;                               /* 1: a sliding-window layer (tl_forward_desc.attn_local) */
} tl_layer_desc;

/* One layer's attention for a forward's rows: the arguments of tl_attention (fp32 caches) or
 * tl_attention_bf16 (blocked bf16 / q8_0 caches), see there; the exported entry point is
 * tl_attention_run, and tl_forward_desc holds one. */
typedef struct {
    int32_t kv; /* the caches: 0 fp32 (tl_attention), 1 + TL_KV_* blocked (tl_attention_bf16) */
    int64_t rows, heads, kv_heads, hd;
    const int64_t *pos;
    const float *cos, *sin;
    const int64_t *kv_base, *cap, *wslot;
    void *qbuf;
    const int64_t *slot_end, *slot_off, *slot_idx, *slot_lo, *mask_start;
    const uint8_t *mask;
    int64_t mask_w;
    uint16_t *tail;
    int64_t tail_slots;
    int64_t *chunk;
    float *scratch;
    int64_t max_slots;
} tl_attn_desc;

/* out = attention of the rows of qkv ([rows, (heads + 2 kv_heads) * hd] fp32) at `layer`,
 * their K/V written to their cache slots. Returns 0, or -1 (before any work) when this build
 * lacks the kernel the caches need. */
int tl_attention_run(const tl_attn_desc *t, const float *qkv, int64_t layer, float *out) {
    if (t->kv < 0 || t->kv > 2) return -1;
    if (t->kv) {
#ifdef TL_HAS_ATTN_BF16
        tl_attention_bf16(qkv, t->pos, t->cos, t->sin, t->kv_base, t->cap, t->wslot, layer, out, (uint32_t *)t->qbuf, t->rows,
                          t->heads, t->kv_heads, t->hd, t->slot_end, t->slot_lo, t->mask_start, t->mask, t->mask_w, t->tail,
                          t->tail_slots, t->chunk, t->scratch, t->max_slots, t->kv - 1);
        return 0;
#else
        return -1;
#endif
    }
    tl_attention(qkv, t->pos, t->cos, t->sin, t->kv_base, t->cap, t->wslot, layer, out, (float *)t->qbuf, t->rows, t->heads,
                 t->kv_heads, t->hd, t->slot_end, t->slot_off, t->slot_idx, t->scratch, t->max_slots);
    return 0;
}

typedef struct {
    float *x; /* fp32 [rows, dim], the residual stream, updated in place */
    int64_t rows, dim, inter; /* inter: the MLP's width (gate_up has 2 * inter outputs) */
    float eps;
    float q_mult; /* the queries' factor after their QK-norm (Gemma 3's query scale; 1 without) */
    int32_t glu;  /* the MLP's gate: TL_GLU_SILU (SwiGLU) or TL_GLU_GELU_TANH (GeGLU) */
    int64_t n_layers;
    const tl_layer_desc *layers;
    float **hidden_out; /* per layer: where to copy x after it (NULL entries: none), or NULL */
    /* work buffers: qkv [rows, qkv out], a [rows, heads * hd], gu [rows, 2 inter], tmp (the
     * formed input of a non-quantized linear, rows * max(dim, inter) floats), acc (a dense
     * linear's result before it is added, or a post-normed linear's, rows * dim floats),
     * scratch (the linears' own) */
    float *qkv, *a, *gu, *tmp, *acc;
    uint8_t *scratch;
    tl_attn_desc attn;       /* its rows are these rows */
    tl_attn_desc attn_local; /* the sliding-window layers' (their rope tables and slot bounds) */
} tl_forward_desc;

/* y (+)= linear(input) where the input is x, RMSNorm(x) * norm_w (norm_w set) or
 * act(gate) * up of x = (gate | up) (glu, f->glu's act; then in_dim is the half width): what
 * CpuKernels.linear does for each kind of weight, call for call (kinds this build lacks are
 * refused by tl_forward_layers before any work). */
static void fwd_linear(const tl_forward_desc *f, const tl_lin_desc *l, const float *x, const float *norm_w, int glu,
                      float *y, int accumulate, int64_t in_dim) {
    const int64_t rows = f->rows;
    if (l->kind == TL_LIN_QUANT) {
        tl_linear_q(x, glu ? NULL : norm_w, f->eps, glu ? f->glu : 0, f->scratch, (const uint8_t *)l->w, l->format, l->bias, y, rows,
                    in_dim, l->out_dim, accumulate);
        return;
    }
    if (glu) {
        tl_glu_mul(x, f->tmp, rows, in_dim, f->glu);
        x = f->tmp;
    } else if (norm_w) {
        tl_rmsnorm(x, norm_w, f->tmp, rows, in_dim, f->eps);
        x = f->tmp;
    }
    if (l->kind == TL_LIN_PACKED) {
#ifdef TL_HAS_PACKED
        tl_linear_packed(x, (const uint16_t *)l->w, l->bias, y, (uint16_t *)f->scratch, rows, in_dim, l->out_dim, accumulate);
#endif
        return;
    }
    const int wbits = l->kind == TL_LIN_BF16 ? 16 : 32;
    if (!accumulate) {
        tl_linear(x, l->w, l->bias, y, (float *)f->scratch, rows, in_dim, l->out_dim, wbits);
        return;
    }
    tl_linear(x, l->w, l->bias, f->acc, (float *)f->scratch, rows, in_dim, l->out_dim, wbits);
    for (int64_t i = 0; i < rows * l->out_dim; i++) y[i] += f->acc[i]; /* as torch's add_: one rounding each */
}

/* x += linear(input) (`post` NULL: the add inside the linear's call), or x += RMSNorm(o) * post
 * where o = linear(input) (Gemma 3's post-norms: tl_rmsnorm_add, as CpuKernels.rmsnorm_add). */
static void fwd_residual(const tl_forward_desc *f, const tl_lin_desc *l, const float *in, int glu, const float *post,
                         int64_t in_dim) {
    if (!post) {
        fwd_linear(f, l, in, NULL, glu, f->x, 1, in_dim);
        return;
    }
    fwd_linear(f, l, in, NULL, glu, f->acc, 0, in_dim);
    tl_rmsnorm_add(f->x, f->acc, post, f->rows, f->dim, f->eps);
}

/* Every decoder layer of the fused path over x (in place):
 *   qkv = linear(RMSNorm(x), wqkv) (then each head of Q and K RMSNormed when the layer has
 *   QK-norm, the queries times q_mult); a = attention(qkv) (a sliding-window layer with
 *   attn_local); x += linear(a, wo) (RMSNormed first when the layer has post-norms);
 *   gu = linear(RMSNorm(x), w_gate_up); x += linear(act(gate) * up, w_down) (likewise).
 * Returns 0, or -1 (before any work) when a layer needs a kernel this build lacks. */
int tl_forward_layers(const tl_forward_desc *f) {
#ifndef TL_HAS_ATTN_BF16
    if (f->attn.kv) return -1;
#endif
    if (f->attn.kv < 0 || f->attn.kv > 2 || f->attn.rows != f->rows) return -1;
    if (f->glu != TL_GLU_SILU && f->glu != TL_GLU_GELU_TANH) return -1;
    for (int64_t i = 0; i < f->n_layers; i++) {
        const tl_layer_desc *l = &f->layers[i];
        const tl_lin_desc *lins[4] = {&l->qkv, &l->wo, &l->gate_up, &l->down};
        for (int k = 0; k < 4; k++) {
            const int kind = lins[k]->kind;
#ifndef TL_HAS_PACKED
            if (kind == TL_LIN_PACKED) return -1;
#endif
            if (kind < TL_LIN_F32 || kind > TL_LIN_QUANT) return -1;
        }
        if (l->local && (f->attn_local.kv != f->attn.kv || f->attn_local.rows != f->rows)) return -1;
    }
    const int64_t heads = f->attn.heads, kv_heads = f->attn.kv_heads, hd = f->attn.hd, q_width = heads * hd;
    for (int64_t i = 0; i < f->n_layers; i++) {
        const tl_layer_desc *l = &f->layers[i];
        fwd_linear(f, &l->qkv, f->x, l->attn_norm, 0, f->qkv, 0, f->dim);
        if (l->q_norm && l->k_norm) {
            const int64_t width = l->qkv.out_dim;
            tl_head_norm(f->qkv, f->rows, width, 0, heads, hd, l->q_norm, f->eps, f->q_mult);
            tl_head_norm(f->qkv, f->rows, width, q_width, kv_heads, hd, l->k_norm, f->eps, 1.0f);
        }
        tl_attention_run(l->local ? &f->attn_local : &f->attn, f->qkv, i, f->a);
        fwd_residual(f, &l->wo, f->a, 0, l->post_attn_norm, q_width);
        fwd_linear(f, &l->gate_up, f->x, l->mlp_norm, 0, f->gu, 0, f->dim);
        fwd_residual(f, &l->down, f->gu, 1, l->post_mlp_norm, f->inter);
        if (f->hidden_out && f->hidden_out[i]) memcpy(f->hidden_out[i], f->x, (size_t)(f->rows * f->dim) * sizeof(float));
    }
    return 0;
}

/* The structs' sizes and some field offsets, for the test of their ctypes mirrors (abi.py):
 * writes them to out (at least 8 int64) and returns how many. */
int64_t tl_abi_layout(int64_t *out) {
    const int64_t v[] = {sizeof(tl_lin_desc), sizeof(tl_layer_desc), sizeof(tl_attn_desc), sizeof(tl_forward_desc),
                         offsetof(tl_attn_desc, rows), offsetof(tl_attn_desc, max_slots), offsetof(tl_forward_desc, attn),
                         offsetof(tl_forward_desc, eps), offsetof(tl_layer_desc, local), offsetof(tl_forward_desc, glu),
                         offsetof(tl_forward_desc, attn_local)};
    for (int i = 0; i < 11; i++) out[i] = v[i];
    return 11;
}
