"""DoRA's training product with the row scale folded into the weights, W' made by an MLX multiply.

Development code (adapters issue). With rs = m / norm (a constant of the step, DoRA section 4.3),

    y = rs * (x W^T + s (x A) B) = x W'^T + s (x A) B',   W' = rs W (rows),  B' = B rs (columns),

so the product is LoRA's on W' and B', and m's gradient sum_t g y / (rs * norm) is the only
token-sized pass DoRA adds: adapted_linear's `row_scale`. meshtune's folded step
(kernels.FOLD_ROW_SCALE) has the row-norm kernel write W' beside the norm; here an MLX
multiply a layer makes it, so probe_dora_step.py can time what the kernel's W' saves.
"""

import mlx.core as mx

from meshtune.adapters.adapted_linear import adapted_linear


def scaled_weight_linear(x, weight, a, b, scale, m, norm, w_sq=None):
    """DoRA's rs * (x W^T + s (x A) B) for x (..., in), W (out, in), A (in, r), B (r, out), m and norm (out,),
    as LoRA's product on W' = rs W (an MLX multiply) and B' = B rs; the norm is a constant.
    `w_sq` (||w_i||^2) is the layer's own where the caller has it."""
    rs = mx.stop_gradient((m / norm).astype(x.dtype))
    if w_sq is None:
        w32 = weight.astype(mx.float32)
        w_sq = (w32 * w32).sum(-1)
    return adapted_linear(x, rs[:, None] * weight, a, b, scale, magnitude=m, w_sq=w_sq, norm=norm,
                          row_scale=rs.astype(mx.float32))
