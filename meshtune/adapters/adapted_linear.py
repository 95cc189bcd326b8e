"""The training product of an adapted linear layer, one function per variant, each with a hand-written backward.

    y = rs * (x W^T + s (x_lora A) B),   rs = m / ||W + s (A B)^T||_row   (DoRA; rs = 1 for LoRA)

`lora_linear` (rs = 1), `dora_linear` (rs from the norm, taken here or given by the step),
`folded_dora_linear` (rs already in W' = rs W and B' = B rs: step_norms.py's folded step) and
`merged_dora_linear` (W' the whole adapted weight). Every product runs in x's dtype with the factors
cast down, as mixed-precision training does: autodiff of the plain expression would upcast x and the
cotangent to float32 and take DoRA's d m as a slow column reduction. The norm is a constant (DoRA
paper, section 4.3), so m's gradient is sum_t g y / (rs * norm), from the output kept. On MLX's CUDA
build DoRA's extra work is kernels (kernels.py). W is frozen: closed over, not an input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from . import kernels

Backward = Callable[[list, mx.array, list], list]  # (primals, cotangent, outputs) -> the primals' gradients

# In MLX ops (on CUDA one kernel computes them, kernels.py), W A's r columns come as r extra rows on
# the activations' product ([x; A^T] W^T), so W is read once: on the CPU W's read is as long as the base
# product at small batches. The extended product's rows are zero-padded to a multiple of this: GEMM
# kernels tile rows, and a few zero rows cost less than a ragged tile.
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


def _on_kernels(a: mx.array) -> bool:
    """Whether DoRA's norms and folds run on meshtune's CUDA kernels: on CUDA, at a rank they take."""
    return kernels.on_cuda() and a.shape[-1] <= kernels.MAX_RANK


def lora_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *,
                x_lora: mx.array | None = None) -> mx.array:
    """LoRA's x W^T + s (x_lora A) B for x (..., in), W (out, in), A (in, r), B (r, out); `x_lora` is the
    branch's input where it differs from x (dropout)."""
    dt, two_inputs = x.dtype, _differs(x, x_lora)

    def forward(x2: mx.array, xl: mx.array, a: mx.array, b: mx.array, _m: None) -> list[mx.array]:
        # Stock mlx-lm's order of operations, so a float32 step-0 LoRA forward matches it bit for bit.
        return [x2 @ weight.T + (scale * ((xl @ a.astype(dt)) @ b.astype(dt))).astype(dt)]

    def backward(primals: list, g: mx.array, _outputs: list) -> list[mx.array]:
        _, xl, a, b, _ = primals
        ac, bc = a.astype(dt), b.astype(dt)
        gxa = g @ bc.T  # (T, r)
        gb = (scale * ((xl @ ac).T @ g)).astype(b.dtype)
        return _input_grads(g, weight, gxa, ac, scale, two_inputs, dt) + [_a_grad(xl, gxa, a, scale), gb]

    return _custom_product(x, x_lora, a, b, None, forward, backward)


def dora_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *, magnitude: mx.array,
                w_sq: mx.array, x_lora: mx.array | None = None,
                norm: mx.array | kernels.StackedNorm | None = None) -> mx.array:
    """DoRA's rs * (x W^T + s (x_lora A) B), rs = m / ||W + s (A B)^T||_row, and m's gradient.

    `magnitude` is m (out,); `w_sq` ||w_i||^2 of the frozen base (out,), float32. `norm` is the row
    norm where the caller has it already (a training step takes every layer's at once on CUDA,
    step_norms.py); a constant, as the norm always is here. Without it the norm comes from one
    kernel on CUDA, else from r extra rows on the activations' product (_base_with_norm_rows).
    """
    dt, two_inputs = x.dtype, _differs(x, x_lora)
    on_kernels = _on_kernels(a)
    if isinstance(norm, kernels.StackedNorm):  # MLX ops (and the cotangent kernel) take its view
        norm = norm.view()
    given_norm = None if norm is None else mx.stop_gradient(norm)

    def forward(x2: mx.array, xl: mx.array, a: mx.array, b: mx.array, m: mx.array) -> list[mx.array]:
        ac, bc = a.astype(dt), b.astype(dt)
        if given_norm is not None or on_kernels:
            # The norm given (a step's batched norms) or from one kernel, a pass over W (CUDA).
            norm = given_norm if given_norm is not None else kernels.row_norms_cuda([weight], [a], [b], [scale])[0]
            base, rs = x2 @ weight.T, (m / norm).astype(dt)
        else:
            base, norm, rs = _base_with_norm_rows(x2, ac, a, b, m, weight, w_sq, scale)
        # rs * (base + s u) is one fused elementwise kernel where MLX compiles the step, in the
        # place of LoRA's base + s u (it beat a custom kernel for it). Kept for the backward: rs for
        # the MLX ops only (an output is an array of its own, a launch; the CUDA kernel forms
        # rs from m / norm), the norm unless given (the backward takes a given one from here).
        y = rs * (base + (scale * ((xl @ ac) @ bc)).astype(dt))
        return [y] + ([] if on_kernels else [rs]) + ([] if given_norm is not None else [norm])

    def backward(primals: list, g: mx.array, outputs: list) -> list[mx.array]:
        _, xl, a, b, m = primals
        ac, bc = a.astype(dt), b.astype(dt)
        norm = given_norm if given_norm is not None else outputs[-1]
        gz, dm = (kernels.cotangent_cuda(g, outputs[0], m, norm) if on_kernels
                  else dora_cotangent(g, outputs[0], outputs[1], norm))
        gxa = gz @ bc.T  # (T, r)
        gb = (scale * ((xl @ ac).T @ gz)).astype(b.dtype)
        return (_input_grads(gz, weight, gxa, ac, scale, two_inputs, dt)
                + [_a_grad(xl, gxa, a, scale), gb, dm.astype(m.dtype)])

    return _custom_product(x, x_lora, a, b, magnitude, forward, backward)


def folded_dora_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *,
                       magnitude: mx.array, norm: mx.array | kernels.StackedNorm, row_scale: mx.array,
                       x_lora: mx.array | None = None,
                       factors: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """DoRA with its row scale folded into the weights: LoRA's product on W' = rs W and B' = B rs.

    `row_scale` is rs = m / norm rounded to x's dtype (float32, (out,)), already in `weight`
    (kernels.row_norms_and_scaled_cuda writes both); `norm` the row norm it came from (a
    kernels.StackedNorm, its place in the step's launch, where that launch wrote it). No row-scale
    multiply and no g * rs pass: B's gradient takes rs in the multiply its scale already has, and
    m's, sum_t g y / (rs * norm), is the only pass DoRA adds (kernels.magnitude_and_b_grad_cuda on
    CUDA). `factors`: (A, B') in x's dtype where the step's launch wrote them, in place of casting
    A and scaling B here (ignored in another dtype).
    """
    dt, two_inputs = x.dtype, _differs(x, x_lora)
    fold = _Fold.of(a, norm, row_scale, factors, dt)

    def forward(x2: mx.array, xl: mx.array, a: mx.array, b: mx.array, _m: mx.array) -> list[mx.array]:
        ac, bc = fold.cast(a, b)
        return [x2 @ weight.T + (scale * ((xl @ ac) @ bc)).astype(dt)]

    def input_grads(g: mx.array, gxa: mx.array, ac: mx.array) -> list[mx.array]:
        return _input_grads(g, weight, gxa, ac, scale, two_inputs, dt)

    return _custom_product(x, x_lora, a, b, magnitude, forward, fold.backward(weight, scale, input_grads))


def merged_dora_linear(x: mx.array, weight: mx.array, a: mx.array, b: mx.array, scale: float, *,
                       magnitude: mx.array, norm: mx.array | kernels.StackedNorm, row_scale: mx.array,
                       factors: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """The folded product where `weight` is the whole adapted weight W' = rs (W + s (A B)^T) (a folded
    step's layers without dropout: LoRA's branch takes x itself): y = x W'^T is one product and the
    input's gradient g W' another; A's, B's and m's gradients are folded_dora_linear's."""
    fold = _Fold.of(a, norm, row_scale, factors, x.dtype)

    def forward(x2: mx.array, _xl: mx.array, _a: mx.array, _b: mx.array, _m: mx.array) -> list[mx.array]:
        return [x2 @ weight.T]

    def input_grads(g: mx.array, _gxa: mx.array, _ac: mx.array) -> list[mx.array]:
        return [g @ weight]

    return _custom_product(x, None, a, b, magnitude, forward, fold.backward(weight, scale, input_grads))


def _differs(x: mx.array, x_lora: mx.array | None) -> bool:
    """Whether LoRA's branch takes another input than x (dropout): then both get a gradient."""
    return x_lora is not None and x_lora is not x


def _a_grad(xl: mx.array, gxa: mx.array, a: mx.array, scale: float) -> mx.array:
    """A's gradient s x_lora^T (g B^T), in A's dtype."""
    return (scale * (xl.T @ gxa)).astype(a.dtype)


def _input_grads(gz: mx.array, weight: mx.array, gxa: mx.array, ac: mx.array, scale: float, two_inputs: bool,
                 dt: mx.Dtype) -> list[mx.array]:
    """x's gradient gz W + s (g B^T) A^T, or with a branch input of its own, gz W and that input's (in x's
    dtype `dt`)."""
    if two_inputs:
        return [gz @ weight, (scale * (gxa @ ac.T)).astype(dt)]
    return [mx.addmm(gz @ weight, gxa, ac.T, alpha=scale)]


def _base_with_norm_rows(x2: mx.array, ac: mx.array, a: mx.array, b: mx.array, m: mx.array, weight: mx.array,
                         w_sq: mx.array, scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """(x W^T, the row norm float32, rs in x's dtype) from one product: the tokens' rows, then W A's r
    columns as rows, then zeros to a multiple of ROW_MULTIPLE."""
    tokens, r = x2.shape[0], ac.shape[-1]
    rows = [x2, ac.T]
    pad = -(tokens + r) % ROW_MULTIPLE
    if pad:
        rows.append(mx.zeros((pad, x2.shape[-1]), dtype=x2.dtype))
    both = mx.concatenate(rows) @ weight.T
    norm, rs = dora_row_scale(both[tokens:tokens + r], a, b, w_sq, m, scale, x2.dtype)
    return both[:tokens], norm, rs


@dataclass(frozen=True)
class _Fold:
    """What the folded products share: rs and the norm as constants, the factors' cast and the backward."""

    rs: mx.array
    norm: mx.array | kernels.StackedNorm
    """A StackedNorm goes to the m-gradient kernel as it is; MLX ops take its view."""
    factors: tuple[mx.array, mx.array] | None
    """(A, B') the step's launch wrote in x's dtype, else None."""
    dt: mx.Dtype
    on_kernels: bool

    @classmethod
    def of(cls, a: mx.array, norm: mx.array | kernels.StackedNorm, row_scale: mx.array,
           factors: tuple[mx.array, mx.array] | None, dt: mx.Dtype) -> "_Fold":
        on_kernels = _on_kernels(a)
        if isinstance(norm, kernels.StackedNorm) and not on_kernels:
            norm = norm.view()
        norm = norm if isinstance(norm, kernels.StackedNorm) else mx.stop_gradient(norm)
        given = factors if factors is not None and all(f.dtype == dt for f in factors) else None
        return cls(mx.stop_gradient(row_scale), norm, given, dt, on_kernels)

    def cast(self, a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
        """(A, B' = B rs) in x's dtype."""
        return self.factors if self.factors is not None else (a.astype(self.dt), (b * self.rs).astype(self.dt))

    def backward(self, weight: mx.array, scale: float,
                 input_grads: Callable[[mx.array, mx.array, mx.array], list[mx.array]]) -> Backward:
        """The folded product's backward: input_grads(g, g B'^T, A) for the inputs, then A's, B's and m's
        gradients from the output kept: m's sum_t g y / (rs * norm), B's s (x A)^T g rs."""

        def backward(primals: list, g: mx.array, outputs: list) -> list[mx.array]:
            _, xl, a, b, m = primals
            ac, bc = self.cast(a, b)
            gxa = g @ bc.T  # (T, r): rs rides in W' and B', so g itself
            if self.on_kernels:
                # m's gradient from the output kept, and d B = s (x A)^T g rs with (x A)^T g summed in the same
                # pass over g (no matmul for it): two launches.
                dm, gb = kernels.magnitude_and_b_grad_cuda(g, outputs[0], xl @ ac, m, self.norm, scale,
                                                           rs_dtype=weight.dtype)
            else:
                dm = dora_cotangent(g, outputs[0], self.rs.astype(self.dt), self.norm)[1]
                gb = scale * ((xl @ ac).T @ g) * self.rs
            return input_grads(g, gxa, ac) + [_a_grad(xl, gxa, a, scale), gb.astype(b.dtype), dm.astype(m.dtype)]

        return backward


def _custom_product(x: mx.array, x_lora: mx.array | None, a: mx.array, b: mx.array, magnitude: mx.array | None,
                    forward: Callable[..., list[mx.array]], backward: Backward) -> mx.array:
    """forward(x2, xl, a, b, m) -> [y, kept...] with backward(primals, g, outputs) -> gradients as one
    mx.custom_function over x's rows, the branch's input where it differs from x, A, B and m where given;
    y reshaped to x's leading dimensions. mx.custom_function fixes the arity, so each combination gets its
    own signature; xl is x's rows where the branch takes x itself."""
    lead = x.shape[:-1]
    two_inputs = _differs(x, x_lora)
    dora = magnitude is not None
    x2 = x.reshape(-1, x.shape[-1])
    args = ([x2] + ([x_lora.reshape(-1, x.shape[-1])] if two_inputs else []) + [a, b]
            + ([magnitude] if dora else []))

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
