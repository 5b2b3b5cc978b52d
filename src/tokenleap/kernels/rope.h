/* tokenleap kernels: rotary embedding and the fp32 KV-cache write shared by both variants. */
#pragma once
#include "pool.h"

/* Rotary embedding (Su et al., 2021), half-split layout: x*cos + rotate_half(x)*sin. */
static inline void rope_head(const float *x, float *y, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        y[i] = x[i] * cos[i] - x[i + half] * sin[i];
        y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* For tl_attention over fp32 caches [layers, 2, kv_heads, cap, hd]: rotate every row's query
 * heads into qrot, and write its rotated keys and its values to slot wslot[r] of `layer`. */
static void rope_and_write_f32(const float *qkv, const int64_t *pos, const float *cos, const float *sin,
                               const int64_t *kv_base, const int64_t *cap, const int64_t *wslot, int64_t layer,
                               float *qrot, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd) {
    const int64_t width = (heads + 2 * kv_heads) * hd;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + pos[r] * hd, *sn = sin + pos[r] * hd;
        float *kvr = (float *)kv_base[r];
        const int64_t plane = kv_heads * cap[r] * hd;
        float *kl = kvr + layer * 2 * plane, *vl = kl + plane;
        for (int64_t h = 0; h < heads; h++) rope_head(row + h * hd, qrot + (r * heads + h) * hd, c, sn, hd);
        for (int64_t h = 0; h < kv_heads; h++) {
            rope_head(row + (heads + h) * hd, kl + (h * cap[r] + wslot[r]) * hd, c, sn, hd);
            memcpy(vl + (h * cap[r] + wslot[r]) * hd, row + (heads + kv_heads + h) * hd, (size_t)hd * sizeof(float));
        }
    }
}
