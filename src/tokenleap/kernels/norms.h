/* tokenleap kernels: the per-row normalisations Gemma 3 adds around attention and the MLP
 * (Team Gemma, 2025: QK-norm, post-attention and post-feed-forward RMSNorms), fused into one
 * call per layer each instead of ~8 small torch ops, shared by both variants. Plain C loops in
 * a fixed order: each row's result depends on that row alone. */
#pragma once
#include <math.h>
#include <stdint.h>

/* The MLP gates' kinds (tl_linear_q's and forward.h's `glu`) and GeGLU's constants: exp's
 * argument -2 sqrt(2 / pi) (g + 0.044715 g^3) = g (A + B g^2) (tl_gelu_mul, each variant). */
#define TL_GLU_SILU 1
#define TL_GLU_GELU_TANH 2
#define TL_GELU_A (-1.5957691216057308f)  /* -2 sqrt(2 / pi) */
#define TL_GELU_B (-0.07135481627260025f) /* -2 sqrt(2 / pi) * 0.044715 */

static inline float tl_row_rms_scale(const float *x, int64_t dim, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* In place, for each of `rows` rows of `width` floats: the `heads` head_dim-wide vectors from
 * column `offset` on are RMSNormed with weight w [hd] and multiplied by `mult` (QK-norm, and
 * the query scale folded in). */
void tl_head_norm(float *x, int64_t rows, int64_t width, int64_t offset, int64_t heads, int64_t hd,
                  const float *w, float eps, float mult) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * width + offset + h * hd;
            const float s = tl_row_rms_scale(v, hd, eps);
            for (int64_t i = 0; i < hd; i++) v[i] = v[i] * s * w[i] * mult;
        }
}

/* x[r] += RMSNorm(o[r]) * w for rows of `dim` floats (a post-norm and its residual add). */
void tl_rmsnorm_add(float *x, const float *o, const float *w, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *orow = o + r * dim;
        const float s = tl_row_rms_scale(orow, dim, eps);
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += orow[i] * s * w[i];
    }
}
