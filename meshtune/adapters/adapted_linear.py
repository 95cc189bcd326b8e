"""The training product of an adapted linear layer, with a hand-written backward.

    y = rs * (x W^T + s (x_lora A) B),   rs = m / ||W + s (A B)^T||_row   (DoRA; rs = 1 for LoRA)

Autodiff of the plain expression runs the low-rank branch in float32 (A and B are
float32, so x and the cotangent are upcast: two float32 copies of a tokens x width
array per layer) and takes DoRA's d m as a column reduction MLX runs slowly. Here
every product runs in x's dtype with the adapter factors cast down, as mixed-precision
training does (the factors, their gradients and the optimizer stay float32).

DoRA's norm needs W A (out x r), the r columns of A through W. Computed on its own
that is a second pass over W per layer, as long as the base product itself at small
batches (CPU, decode-sized steps) and a poorly shaped skinny matmul on a GPU. Here A's
r columns ride as r extra rows on the activations' product, [x; A^T] W^T, so W is read
once. The norm is a constant (DoRA paper, section 4.3): m's gradient is
sum_t g * y / (rs * norm), from the output already kept, in the same pass over the
cotangent that scales it by rs. On MLX's CUDA build DoRA's extra work is kernels
(kernels.py): the norm in one pass over W (in a training step, every layer's at once
before the forward: step_norms.py), and the scaled cotangent with m's gradient by
chunks, then the chunks' sum; the row-scaled sum of the two products is MLX's fused
elementwise kernel, as LoRA's sum is.

W is frozen: it is closed over, not an input, so no gradient is formed for it.
"""

from __future__ import annotations

import mlx.core as mx

from . import kernels

# In MLX ops (on CUDA one kernel computes them, kernels.py), W A's r columns come as r extra rows on
# the activations' product ([x; A^T] W^T), so W is read once: on the CPU W's read is as long as the base
# product at small batches. The extended product's rows are zero-padded to a multiple of this: GEMM kernels tile rows, and
# a few zero rows cost less than a ragged tile.
ROW_MULTIPLE = 16


def adapted_row_norm(w_sq: mx.array, proj: mx.array, coef: mx.array, gram: mx.array,
                     scale: float) -> mx.array:
    """||w_i + s * coef_i @ V|| per row from ||w_i||^2, proj_i = w_i V^T and gram = V V^T.

    Shapes: w_sq (..., rows), proj and coef (..., rows, r), gram (..., r, r); float32.
    """
    # ||w_i + s c_i V||^2 = ||w_i||^2 + c_i . (2 s proj_i + s^2 c_i G): no out x in matrix
    # appears, only rows x r ones, and one reduction.
    sq = w_sq + (coef * ((2 * scale) * proj + (scale * scale) * (coef @ gram))).sum(axis=-1)
    # Rounding can push a near-zero square below zero; a norm cannot be negative.
    return mx.sqrt(mx.maximum(sq, 0.0))


def dora_row_scale(proj_rows: mx.array, a: mx.array, b: mx.array, w_sq: mx.array, m: mx.array,
                   scale: float, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """(||W + s (A B)^T||_row float32, rs = m / that norm in `dtype`) from proj_rows = A^T W^T (r, out), in MLX ops."""
    gram = a.T @ a.astype(mx.float32)
    norm = adapted_row_norm(w_sq, proj_rows.T.astype(mx.float32), b.T.astype(mx.float32), gram, scale)
    return norm, (m / norm).astype(dtype)


def dora_cotangent(g: mx.array, y: mx.array, rs: mx.array, norm: mx.array) -> tuple[mx.array, mx.array]:
    """(g * rs, d m float32) for y = rs z with rs = m / norm rounded to y's dtype, the norm constant.

    d m = sum_t g z / norm, and sum_t g z = sum_t g y / rs from the output already kept.
    A zero row scale (a zero base row, or m trained to 0) has y = 0 and gets 0, not NaN.
    """
    den = rs.astype(mx.float32) * norm
    total = (g.astype(mx.float32) * y.astype(mx.float32)).sum(axis=0)
    return g * rs, mx.where(den == 0, 0.0, total / mx.where(den == 0, 1.0, den))


def adapted_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *,
                   x_lora: mx.array | None = None, magnitude: mx.array | None = None,
                   w_sq: mx.array | None = None, norm: mx.array | None = None,
                   row_scale: mx.array | None = None, factors: tuple[mx.array, mx.array] | None = None,
                   merged: bool = False) -> mx.array:
    """rs * (x W^T + s (x_lora A) B) for x (..., in), W (out, in), A (in, r), B (r, out).

    `x_lora` is the branch's input when it differs from x (dropout). With `magnitude`
    (DoRA's m, (out,)) and `w_sq` (||w_i||^2 of the frozen base, (out,), float32), rs is
    m / ||W + s (A B)^T||_row and m gets its gradient; without them rs = 1 (LoRA).
    `norm` is that row norm when the caller has it already (a training step takes every
    layer's at once on CUDA, step_norms.py; with `row_scale` it may be a kernels.StackedNorm, its
    place in the step's launch); it is a constant, as the norm always is here.

    `row_scale` (with `magnitude` and `norm`; float32 (out,)): rs = m / norm rounded to x's dtype,
    already folded into W (W' = rs W by rows: kernels.row_norms_and_scaled_cuda writes both). The
    product is then LoRA's on W' and B' = B rs (no row-scale multiply, no g * rs pass; B's gradient
    takes rs in the multiply its scale already has) and m's gradient, sum_t g y / (rs * norm), is
    the only pass DoRA adds (kernels.magnitude_and_b_grad_cuda on CUDA).

    `factors` (with `row_scale`): (A, B' = B rs) already in x's dtype (the step's folded norm launches wrote them:
    kernels.row_norms_and_scaled_cuda), used in place of casting A and scaling B here; ignored in another dtype.

    `merged` (with `row_scale`, and no `x_lora` apart from x): W is the whole adapted weight,
    W' = rs (W + s (A B)^T) (a folded step's layers without dropout): y = x W'^T is one product and the input's
    gradient g W' another; A's, B's and m's gradients are the folded step's.
    """
    lead = x.shape[:-1]
    two_inputs = x_lora is not None and x_lora is not x
    dora = magnitude is not None
    if dora and w_sq is None:
        raise ValueError("adapted_linear: DoRA's magnitude needs w_sq, the base's squared row norms")
    folded = row_scale is not None
    if folded and (not dora or norm is None):
        raise ValueError("adapted_linear: a folded row scale needs DoRA's magnitude and the row norm it came from")
    if merged and (not folded or two_inputs):
        raise ValueError("adapted_linear: a merged weight needs the folded row scale and the branch taking x itself")
    dt = x.dtype
    rs_folded = None if row_scale is None else mx.stop_gradient(row_scale)
    tokens = x.size // x.shape[-1]
    # On CUDA the norm and the cotangent are kernels (kernels.py); elsewhere MLX ops.
    on_kernels = dora and kernels.on_cuda() and a.shape[-1] <= kernels.MAX_RANK
    # A StackedNorm (a step's launch wrote it) goes to the folded step's m-gradient kernel as it is; MLX ops take its view.
    if isinstance(norm, kernels.StackedNorm) and not (folded and on_kernels):
        norm = norm.view()
    given_norm = norm if norm is None or isinstance(norm, kernels.StackedNorm) else mx.stop_gradient(norm)

    given_factors = factors if folded and factors is not None and all(f.dtype == dt for f in factors) else None

    def cast_factors(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
        """A and B in x's dtype, B' = B rs where the row scale is folded."""
        if given_factors is not None:
            return given_factors
        return a.astype(dt), (b if rs_folded is None else b * rs_folded).astype(dt)

    def forward(x2: mx.array, xl: mx.array, a: mx.array, b: mx.array, m: mx.array | None) -> list[mx.array]:
        if merged:
            return [x2 @ weight.T]
        ac, bc = cast_factors(a, b)
        if not dora or folded:
            # Stock mlx-lm's order of operations, so a float32 step-0 LoRA forward matches it bit for bit.
            return [x2 @ weight.T + (scale * ((xl @ ac) @ bc)).astype(dt)]
        if given_norm is not None or on_kernels:
            # The norm given (a step's batched norms) or from one kernel, a pass over W (CUDA).
            norm = given_norm if given_norm is not None else kernels.row_norms_cuda([weight], [a], [b], [scale])[0]
            base, rs = x2 @ weight.T, (m / norm).astype(dt)
        else:
            rows = [x2, ac.T]  # the tokens' rows, then W A's r columns as rows, then zeros
            pad = -(tokens + ac.shape[-1]) % ROW_MULTIPLE
            if pad:
                rows.append(mx.zeros((pad, x2.shape[-1]), dtype=dt))
            both = mx.concatenate(rows) @ weight.T
            base = both[:tokens]
            norm, rs = dora_row_scale(both[tokens:tokens + ac.shape[-1]], a, b, w_sq, m, scale, dt)
        # rs * (base + s u) is one fused elementwise kernel where MLX compiles the step, in the
        # place of LoRA's base + s u (it beat a custom kernel for it). Kept for the backward: rs for
        # the MLX ops only (an output is an array of its own, a launch; the CUDA kernel forms
        # rs from m / norm), the norm unless given (the backward takes a given one from here).
        y = rs * (base + (scale * ((xl @ ac) @ bc)).astype(dt))
        return [y] + ([] if on_kernels else [rs]) + ([] if given_norm is not None else [norm])

    def backward(primals: list, g: mx.array, outputs: list) -> list:
        x2, xl, a, b, m = primals
        ac, bc = cast_factors(a, b)
        if not dora or folded:  # folded: rs rides in W' and B', so g itself (m's gradient below)
            gz, dm = g, None
        else:
            norm = given_norm if given_norm is not None else outputs[-1]
            gz, dm = (kernels.cotangent_cuda(g, outputs[0], m, norm) if on_kernels
                      else dora_cotangent(g, outputs[0], outputs[1], norm))
        gxa = gz @ bc.T  # (T, r)
        ga = (scale * (xl.T @ gxa)).astype(a.dtype)
        if folded and on_kernels:
            # m's gradient from the output kept, and d B = s (x A)^T g rs with (x A)^T g summed in the same pass
            # over g (no matmul for it): two launches.
            dm, gb = kernels.magnitude_and_b_grad_cuda(g, outputs[0], xl @ ac, m, given_norm, scale,
                                                       rs_dtype=weight.dtype)
        elif folded:
            dm = dora_cotangent(g, outputs[0], rs_folded.astype(dt), given_norm)[1]
            gb = scale * ((xl @ ac).T @ gz) * rs_folded
        else:
            gb = scale * ((xl @ ac).T @ gz)
        gb = gb.astype(b.dtype)
        if merged:
            grads = [gz @ weight, ga, gb]
        elif two_inputs:
            grads = [gz @ weight, (scale * (gxa @ ac.T)).astype(dt), ga, gb]
        else:
            grads = [mx.addmm(gz @ weight, gxa, ac.T, alpha=scale), ga, gb]
        return grads + [dm.astype(m.dtype)] if dora else grads

    # mx.custom_function fixes the arity, so each combination gets its own signature.
    x2 = x.reshape(-1, x.shape[-1])
    xl = x_lora.reshape(-1, x.shape[-1]) if two_inputs else None
    args = [x2] + ([xl] if two_inputs else []) + [a, b] + ([magnitude] if dora else [])

    def unpack(args: list) -> list:
        args = list(args)
        x2 = args.pop(0)
        xl = args.pop(0) if two_inputs else x2
        a, b = args.pop(0), args.pop(0)
        return [x2, xl, a, b, args.pop(0) if dora else None]

    @mx.custom_function
    def product(*args: mx.array) -> list[mx.array]:
        return forward(*unpack(args))

    @product.vjp
    def product_vjp(primals: list, cotangents: list, outputs: list) -> list:
        return backward(unpack(primals), cotangents[0], outputs)

    return product(*args)[0].reshape(*lead, -1)
