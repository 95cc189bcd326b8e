"""DoRA, the LoRA variant that learns each output row's magnitude apart from its direction.

Liu et al. 2024 (DoRA), section 4.1: W' = m * (W + s B^T A^T) / ||W + s B^T A^T||_row, with
the norm treated as a constant in backward (section 4.3, "stop-gradient"), m
initialised to ||W||_row so the output is unchanged at step 0. Each class here is its
LoRA class plus three things: the magnitude `m` (set with the base), the forward
(scale the LoRA output row-wise, then add the unscaled bias, as mlx-lm does) and
`_merge` (the normalised fused weight). Names and shapes match mlx-lm's DoRALinear and
DoRAEmbedding (`lora_a`, `lora_b`, `m` with one entry per row of the weight or table),
so stock mlx-lm loads those; DoRASwitchLinear (m: (E, out)) exists only here.
`DoRA.row_norm` takes the norm without ever building W + s B^T A^T.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from .adapted_linear import adapted_row_norm, dora_linear, folded_dora_linear, merged_dora_linear
from .base_path import dequantized_weight, is_quantized
from .lora import LoRAEmbedding, LoRALinear, while_frozen
from .step_norms import StepNorms, taken
from .switch import LoRASwitchLinear


def compute_dtype(base: nn.Module) -> mx.Dtype:
    """The dtype the base multiplies in: feeding it float32 rows would upcast the whole weight."""
    scales = base.get("scales") if is_quantized(base) else None
    if scales is not None and mx.issubdtype(scales.dtype, mx.floating):
        return scales.dtype
    return base.weight.dtype if mx.issubdtype(base.weight.dtype, mx.floating) else mx.bfloat16


def scaled_quantized(base: nn.Module, scale: mx.array) -> nn.Module | None:
    """An affine-quantized base whose rows are multiplied by `scale`, or None where that cannot be folded.

    Row i of an affine-quantized weight is scales_i * q_i + biases_i per group, so
    scaling the row scales its scales and biases: the quantized kernel then yields
    DoRA's scaled base output with no extra pass over the activations (decode is
    launch-bound; one multiply per layer cost 1 in 4 tokens/s on an H200). The packed
    weight is shared, not copied. The fp modes' scales are exponents and cannot take it.
    """
    if not isinstance(base, nn.QuantizedLinear) or base.mode != "affine" or "biases" not in base:
        return None
    folded = copy.copy(base)
    s = scale.astype(mx.float32)[:, None]
    folded["scales"] = (base["scales"].astype(mx.float32) * s).astype(base["scales"].dtype)
    folded["biases"] = (base["biases"].astype(mx.float32) * s).astype(base["biases"].dtype)
    mx.eval(folded["scales"], folded["biases"])
    return folded


class DoRA:
    """The variant's shared half: magnitude from the base, normalised merge, row scale."""

    def set_base(self, base: nn.Module) -> None:
        super().set_base(base)
        w = dequantized_weight(base).astype(mx.float32)
        # ||w_i||^2 of the frozen base, once; the leading "_" keeps it out of
        # parameters(), hence out of training and of the saved adapters.
        # Left lazy here: from_base (or settle_norms after a pipeline's cut) computes it, so a
        # model loaded lazily reads only the weights of the layers it keeps.
        self._w_sq = (w * w).sum(axis=-1)
        self.m = mx.sqrt(self._w_sq)  # section 4.1: m = ||W||_row, so W' = W at step 0

    def settle(self) -> None:
        # Computed before any step: a lazy array closed over by a compiled step is recomputed on
        # every call (a pass over every base weight per step), and loading m would leave it lazy.
        mx.eval(self._w_sq)

    def _merge(self, weight: mx.array) -> mx.array:
        # Section 4.1's W' on the dense merged weight (fuse is a one-off, exactness beats speed).
        merged = weight.astype(mx.float32) + self.delta().astype(mx.float32)
        norm = mx.linalg.norm(merged, axis=-1, keepdims=True)
        return ((self.m[..., None] / norm) * merged).astype(weight.dtype)

    def row_norm(self, dense: mx.array | None = None) -> mx.array:
        """||W + s dW||_row without the dense matrix, as a constant (section 4.3).

        ||w_i + s c_i V||^2 = ||w_i||^2 + 2s c_i . (w_i V^T) + s^2 c_i (V V^T) c_i^T,
        with ||w_i||^2 cached when the base is set (it is frozen), w_i V^T for every row from
        one base product on the r rows of V (through the layer's `base_path`, quantized or
        not), and the r x r Gram V V^T. For a Linear V = A^T and c_i = b_i; for a tied
        embedding head V = B and c_j = a_j; for experts the same per expert (`_norm_terms`).

        `dense` is the base weight when the caller already holds it dense (a training
        step on the dequantized path): the r-row product then reuses it.
        """
        return mx.stop_gradient(adapted_row_norm(self._w_sq, *self._norm_terms(dense), self.scale))

    def row_scale(self, dtype: mx.Dtype, dense: mx.array | None = None) -> mx.array:
        """m / ||W + s dW||_row in `dtype`: the factor DoRA puts on each output row.

        Outside training the adapter does not change between calls, so the factor is
        kept until lora_a, lora_b or m is replaced: unfused generation then pays one
        multiply per layer over LoRA, not a product of r rows through the base per token.
        """
        if self.training:
            return (self.m / self.row_norm(dense)).astype(dtype)
        return while_frozen(self, "_row_scale", dtype, lambda: (self.m / self.row_norm()).astype(dtype))


def settle_norms(model: nn.Module) -> None:
    """Compute every DoRA layer's cached base row norms in `model`, a layer at a time (so one
    layer's float32 copy of its base is alive at once)."""
    for _, module in model.named_modules():
        if isinstance(module, DoRA):
            module.settle()


class DoRALinear(DoRA, LoRALinear):
    """y = m / ||W + s B^T A^T||_row * (x W^T + s (x A) B) + bias."""

    takes_step_norms = True  # on CUDA a training step takes its norm with the step's others (step_norms.py)
    step_norms: StepNorms | None = None
    """What the current training step took for this layer (step_norms.StepRowNorms sets it for the step)."""

    def _norm_terms(self, dense: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        # Outside the dense training path (its norm rides on adapted_linear's product):
        # base(A^T) = A^T W^T = (W A)^T, one product of r rows, however the base is stored.
        a = mx.stop_gradient(self.lora_a).astype(mx.float32)
        b = mx.stop_gradient(self.lora_b).astype(mx.float32)
        proj = self.base_path.linear_forward(self.linear, a.T.astype(compute_dtype(self.linear)),
                                             bias=False).astype(mx.float32).T
        return proj, b.T, a.T @ a

    def __call__(self, x: mx.array) -> mx.array:
        if self.training:
            y = self._training_product(x)
            # The bias sits outside the normalised weight (mlx-lm's DoRALinear, PEFT).
        else:
            # Inference: the row scale folded into B, so the branch costs what LoRA's does.
            scale = self.row_scale(x.dtype)
            a, b = while_frozen(self, "_dora_factors", x.dtype, lambda: (
                self.lora_a.astype(x.dtype), (self.scale * self.lora_b * scale).astype(x.dtype)))
            folded = while_frozen(self, "_scaled_base", x.dtype, lambda: scaled_quantized(self.linear, scale))
            if folded is not None:
                y = self.base_path.linear_forward(folded, x, bias=False) + (x @ a) @ b
            else:
                y = scale * self.base_path.linear_forward(self.linear, x, bias=False) + (x @ a) @ b
        return y + self.linear["bias"] if "bias" in self.linear else y


    def _training_product(self, x: mx.array) -> mx.array:
        """The training forward: on the dense path one dense base weight (dequantized once), its product with
        the activations carrying the norm's r rows of A too (adapted_linear); on CUDA what the step took for
        this layer before the forward (step_norms.py): its norm, and W' = rs W (or the merged weight) where
        the step folded the row scale."""
        tokens = x.size // x.shape[-1]
        step = taken(self, tokens)
        args = (self.lora_a, self.lora_b, self.scale)
        if step is not None and step.merged:  # no dropout: LoRA's branch takes x itself
            return merged_dora_linear(x, step.scaled_weight, *args, magnitude=self.m, norm=step.norm,
                                      row_scale=step.row_scale, factors=step.factors)
        if step is not None and step.scaled_weight is not None:  # LoRA's product on W', B rs
            return folded_dora_linear(x, step.scaled_weight, *args, magnitude=self.m, norm=step.norm,
                                      row_scale=step.row_scale, x_lora=self.dropout(x), factors=step.factors)
        dense = step.dense_weight if step is not None else None
        dense = dense if dense is not None else self.base_path.dense_weight_for(self.linear, tokens)
        if dense is None:  # the quantized kernel's token count
            return self.row_scale(x.dtype) * (self.base_path.linear_forward(self.linear, x, bias=False)
                                              + self.lora_out(x))
        return dora_linear(x, dense, *args, magnitude=self.m, w_sq=self._w_sq, x_lora=self.dropout(x),
                           norm=None if step is None else step.norm)


class DoRAEmbedding(DoRA, LoRAEmbedding):
    """e = m[x] / ||E_x + s A_x B|| * (E_x + s A_x B): each token vector is a row of the table."""

    def _norm_terms(self, dense: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        a = mx.stop_gradient(self.lora_a).astype(mx.float32)
        b = mx.stop_gradient(self.lora_b).astype(mx.float32)
        # Rows of E + s A B: c_j = a_j, V = B; E B^T comes from the head's product on B's r rows.
        if dense is not None:
            proj = (dense @ b.T.astype(dense.dtype)).astype(mx.float32)
        else:
            proj = self.base_path.linear_forward(self.embedding, b.astype(compute_dtype(self.embedding)),
                                                 bias=False).astype(mx.float32).T
        return proj, a, b @ b.T

    def __call__(self, x: mx.array) -> mx.array:
        y = self.embedding(x)
        z = (self.scale * self.lora_a[x]) @ self.lora_b
        out = y + self.dropout(z).astype(y.dtype)
        # A looked-up row is already dense (dims wide), so its norm is taken directly:
        # as cheap as the output itself and what mlx-lm computes (dropout excluded).
        norm = mx.stop_gradient(mx.linalg.norm((y + z).astype(mx.float32), axis=-1))
        return (self.m[x] / norm)[..., None].astype(y.dtype) * out

    def as_linear(self, x: mx.array) -> mx.array:
        # Tied head: logits_j = x . row j of the same adapted, normalised table as the lookup.
        dense = self.base_path.dense_weight_for(self.embedding, x.size // x.shape[-1]) if self.training else None
        base = x @ dense.T if dense is not None else self.base_path.linear_forward(self.embedding, x, bias=False)
        return self.row_scale(x.dtype, dense) * (base + self.lora_head_out(x))


class DoRASwitchLinear(DoRA, LoRASwitchLinear):
    """y_e = m_e / ||W_e + s B_e A_e||_row * (W_e x + s B_e A_e x) + bias_e per routed expert e.

    One magnitude per expert and output row (m: (E, out)); no library had this, so
    stock mlx-lm cannot load it (apply.py's config says so).
    """

    def _norm_terms(self, dense: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        a = mx.stop_gradient(self.lora_a).astype(mx.float32)  # (E, r, in)
        b = mx.stop_gradient(self.lora_b).astype(mx.float32)  # (E, out, r)
        # Expert e's r rows of A_e^T through expert e's weight, on the model's own gather kernel.
        experts = mx.arange(self.num_experts, dtype=mx.uint32)
        proj = self.base_path.switch_forward(self.linear, a.astype(compute_dtype(self.linear)), experts,
                                             sorted_indices=True, bias=False)
        return proj.astype(mx.float32).swapaxes(-1, -2), b, a @ a.swapaxes(-1, -2)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.base_path.switch_forward(self.linear, x, indices, sorted_indices=sorted_indices, bias=False)
        y = y + self.lora_out(x, indices, sorted_indices)
        scale = mx.expand_dims(self.row_scale(x.dtype)[indices], -2)  # routed experts' rows
        y = scale * y
        if "bias" in self.linear:
            y = y + mx.expand_dims(self.linear["bias"][indices], -2)
        return y
