"""DoRA's training product with the row scale folded into the weights, for the probes to time.

Development code (adapters issue): not used by meshtune. DoRA's step on an H200 carries ~1.9 ms
of GPU time per 1024 tokens over LoRA's, and the token-sized passes it adds (the forward's row
scale, the cotangent's g * rs) explain about half of it (docs/bench/overlapped_batches_h200.txt).
Here those passes go: with rs = m / norm (a constant of the step, DoRA section 4.3),

    y = rs * (x W^T + s (x A) B) = x W'^T + s (x A) B',   W' = rs W (rows),  B' = B rs (columns),

so the forward and backward are LoRA's on W' and B' (dx = g W' + s (g B'^T) A^T, dA = s x^T (g B'^T),
dB = s ((x A)^T g) rs), and m's gradient sum_t g y / (rs * norm) is the only token-sized pass
DoRA adds (kernels.magnitude_grad_cuda on CUDA). Here W' is an MLX multiply a layer; meshtune's
own folded step (kernels.FOLD_ROW_SCALE) has the row-norm kernel write it beside the norm.
"""

import mlx.core as mx

from meshtune.adapters import kernels as K
from meshtune.adapters.adapted_linear import dora_cotangent

def magnitude_grad(g, y, m, norm):
    """sum_t g * y / (rs * norm) float32 with rs = m / norm rounded to g's dtype (0 where that is 0)."""
    if not K.on_cuda():
        return dora_cotangent(g, y, (m / norm).astype(g.dtype), norm)[1]
    return K.magnitude_grad_cuda(g, y, m, norm)


def scaled_weight_linear(x, weight, a, b, scale, m, norm, w_scaled=None):
    """DoRA's rs * (x W^T + s (x A) B) for x (..., in), W (out, in), A (in, r), B (r, out), m and norm (out,),
    as LoRA's product on W' = rs W and B' = B rs; the norm is a constant. `w_scaled` is W' where
    the caller has it; otherwise an MLX multiply makes it."""
    lead, dt = x.shape[:-1], x.dtype
    norm = mx.stop_gradient(norm)
    x2 = x.reshape(-1, x.shape[-1])
    given = w_scaled

    @mx.custom_function
    def product(x2, a, b, m):
        rs = (m / norm).astype(dt)
        w_scaled = given if given is not None else rs[:, None] * weight
        b_scaled = (b * rs.astype(mx.float32)).astype(dt)
        return [x2 @ w_scaled.T + (scale * ((x2 @ a.astype(dt)) @ b_scaled)).astype(dt), w_scaled, b_scaled]

    @product.vjp
    def product_vjp(primals, cotangents, outputs):
        x2, a, b, m = primals
        g, (y, w_scaled, b_scaled) = cotangents[0], outputs
        rs = (m / norm).astype(dt)
        ac = a.astype(dt)
        gxa = g @ b_scaled.T
        ga = (scale * (x2.T @ gxa)).astype(a.dtype)
        gb = ((scale * ((x2 @ ac).T @ g)).astype(mx.float32) * rs.astype(mx.float32)).astype(b.dtype)
        dx = mx.addmm(g @ w_scaled, gxa, ac.T, alpha=scale)
        return [dx, ga, gb, magnitude_grad(g, y, m, norm).astype(m.dtype)]

    return product(x2, a, b, m)[0].reshape(*lead, -1)

