"""The training product of an adapted linear layer, with a hand-written backward.

    y = rs * (x W^T + s (x_lora A) B)        (rs: DoRA's row scale; None for LoRA)

Autodiff of the plain expression runs the low-rank branch in float32 (A and B are
float32, so x and the cotangent are upcast: two float32 copies of a tokens x width
array per layer), multiplies the tokens x out output and cotangent by rs, and takes
DoRA's d rs as a column reduction MLX runs slowly. Here every product runs in x's
dtype with the adapter factors cast down, as mixed-precision training does (the
factors, their gradients and the optimizer stay float32); rs rides on W's rows and
B's columns instead of on tokens x out arrays; and d rs is sum_t g * y / rs from the
output already kept, one pass (kernels.column_dot). On an H200, `meshtune bench
adapters --preset 1b` gave 88.9 ms for LoRA's step and 106.4 for DoRA's before this
product and 50.9 and 74.1 ms with it, before the rs folding (runs a session apart,
each beside stock mlx-lm); with the folding, one 6144 x 2048 layer at 4096 tokens
takes 0.910 ms for DoRA and 0.916 ms for LoRA in one run of
scripts/profile_adapted_linear.py.

W is frozen: it is closed over, not an input, so no gradient is formed for it.
"""

from __future__ import annotations

import mlx.core as mx

from .kernels import column_dot


def adapted_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *,
                   x_lora: mx.array | None = None, row_scale: mx.array | None = None) -> mx.array:
    """rs * (x W^T + s (x_lora A) B) for x (..., in), W (out, in), A (in, r), B (r, out).

    `x_lora` is the branch's input when it differs from x (dropout); `row_scale` (out,)
    in x's dtype is DoRA's m / ||W + s dW||, whose gradient this returns too.
    """
    lead = x.shape[:-1]
    two_inputs = x_lora is not None and x_lora is not x
    dt = x.dtype

    # rs * (x W^T + s xa B) = x (rs W)^T + s xa (B rs): with at least as many tokens as
    # input features the row scale rides on W's out x in rows and B's columns (rebuilt in
    # backward, not kept) rather than on the tokens x out output and cotangent.
    fold = row_scale is not None and x.size // x.shape[-1] >= weight.shape[-1]

    def factors(rs: mx.array | None, b: mx.array) -> tuple[mx.array, mx.array]:
        bc = b.astype(dt)
        return (weight * rs[:, None], bc * rs) if fold else (weight, bc)

    def forward(x2: mx.array, xl: mx.array, a: mx.array, b: mx.array, rs: mx.array | None) -> mx.array:
        w, bc = factors(rs, b)
        # Stock mlx-lm's order of operations, so a float32 step-0 LoRA forward matches it bit for bit.
        z = x2 @ w.T + (scale * ((xl @ a.astype(dt)) @ bc)).astype(dt)
        return rs * z if rs is not None and not fold else z

    def backward(primals: list, g: mx.array, y: mx.array) -> list:
        x2, xl, a, b, rs = primals
        w, bc = factors(rs, b)
        ac = a.astype(dt)
        gz = g * rs if rs is not None and not fold else g
        gxa = gz @ bc.T  # (T, r)
        ga = (scale * (xl.T @ gxa)).astype(a.dtype)
        gb = scale * ((xl @ ac).T @ gz)
        gb = (gb * rs if fold else gb).astype(b.dtype)
        if two_inputs:
            grads = [gz @ w, (scale * (gxa @ ac.T)).astype(dt), ga, gb]
        else:
            grads = [mx.addmm(gz @ w, gxa, ac.T, alpha=scale), ga, gb]
        if rs is not None:
            # y = rs * z, so d rs = sum_t g z = sum_t g y / rs; a zero row (m = 0) has y = 0 and gets 0.
            safe = mx.where(rs == 0, mx.ones_like(rs), rs).astype(mx.float32)
            grads.append((column_dot(g, y) / safe).astype(rs.dtype))
        return grads

    # mx.custom_function fixes the arity, so each combination gets its own signature.
    x2 = x.reshape(-1, x.shape[-1])
    xl = x_lora.reshape(-1, x.shape[-1]) if two_inputs else None
    args = [x2] + ([xl] if two_inputs else []) + [a, b] + ([row_scale] if row_scale is not None else [])

    def unpack(args: list) -> list:
        args = list(args)
        x2 = args.pop(0)
        xl = args.pop(0) if two_inputs else x2
        a, b = args.pop(0), args.pop(0)
        return [x2, xl, a, b, args.pop(0) if row_scale is not None else None]

    @mx.custom_function
    def product(*args: mx.array) -> mx.array:
        return forward(*unpack(args))

    @product.vjp
    def product_vjp(primals: list, cotangent: mx.array, output: mx.array) -> list:
        return backward(unpack(primals), cotangent, output)

    return product(*args).reshape(*lead, -1)
