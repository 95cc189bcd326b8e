"""DoRA's per-step work on MLX's CUDA build: every DoRA layer's row norm for a training step at once.

DoRA's norm ||W + s (A B)^T||_row is a constant of the step (DoRA paper, section 4.3): it depends on
the parameters, not on the activations. Taken layer by layer it is one small launch per layer in the
middle of the forward; taken before the forward, the layers of one shape share a launch
(kernels.row_norms_cuda). `StepRowNorms` is DoRA's `PerStepWork` (per_step.py): inside it each DoRA
layer holds what the step took for it (a `StepNorms`, in its `step_norms` slot, outside the parameter
tree); outside, or for a layer the step did not cover, the layer computes its own. Where blocks are
recomputed in the backward (`recomputed`) a dequantized weight handed over would live for the whole
step instead of its block's, so there the layers dequantize their own.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from ..runtime.device_memory import device_info
from . import kernels
from .base_path import is_quantized


@dataclass(frozen=True)
class StepNorms:
    """What one training step took for one DoRA layer before the forward."""

    tokens: int
    """The rows the step's layers are called on; a call on another count takes its own norm."""
    dense_weight: mx.array | None
    """The dense base weight the norm was taken of; None where the layer dequantizes its own
    (blocks recomputed in the backward) or reads `scaled_weight` instead of a packed base."""
    norm: mx.array | kernels.StackedNorm
    """||W + s (A B)^T||_row (a StackedNorm, a view into the launch's array, where folded)."""
    scaled_weight: mx.array | None = None
    """W' = rs W, or the whole adapted weight rs (W + s (A B)^T) where `merged`; None unless folded."""
    row_scale: mx.array | None = None
    """rs = m / norm in float32, beside `scaled_weight`."""
    factors: tuple[mx.array, mx.array] | None = None
    """(A, B' = B rs) in W's dtype, as the folded launch wrote them (StepRowNorms.hand_factors)."""
    merged: bool = False
    """Whether `scaled_weight` is the merged rs (W + s (A B)^T), not rs W."""


def taken(layer: nn.Module, tokens: int) -> StepNorms | None:
    """What the current step took for `layer` where its call is on `tokens` rows, else None."""
    hit = getattr(layer, "step_norms", None)
    return hit if hit is not None and hit.tokens == tokens else None


def _covered(layer: nn.Module) -> bool:
    """A DoRA linear layer in training (its class says `takes_step_norms`) of a rank the kernels take."""
    return (getattr(type(layer), "takes_step_norms", False) and layer.training
            and layer.lora_a.shape[-1] <= kernels.MAX_RANK)


def gpu_memory() -> int | None:
    """The default device's total memory in bytes (on MLX's CUDA build "total_memory"), None where not reported."""
    info = device_info(mx)
    total = info.get("total_memory") or info.get("memory_size")
    return total if isinstance(total, int) else None


@dataclass(eq=False)
class StepRowNorms:
    """DoRA's per-step work for one run: `with norms(modules, tokens):` around a step's forward and
    backward, DoRA layers of `modules` (a module or a list of them) called on `tokens` rows use
    norms taken together (CUDA only)."""

    fold: bool | str = "auto"
    """adapter.dora_fold: whether the step folds the row scale into the weights (W' = rs W beside the norms;
    adapted_linear's folded product): True, False, or "auto", dense bases only while their copies fit in
    kernels.FOLD_MEMORY_SHARE of the GPU's memory (a quantized base's W' replaces its dequantized copy)."""
    recomputed: tuple[type, ...] = ()
    """Block classes recomputed in the backward (training/grad_checkpoint.enable_grad_checkpoint's)."""
    hand_factors: bool = True
    """Whether the folded launch's A and B' go to the layers, which otherwise cast their own (the same bits)."""
    memory: int | None = field(default_factory=gpu_memory)
    """The GPU's memory in bytes, for "auto"; None where the device does not report it (then "auto" folds)."""
    said_unfolded: bool = field(default=False, init=False)
    """Whether "auto" has said it leaves dense bases unfolded (it says so once)."""

    @contextmanager
    def __call__(self, model: nn.Module | list[nn.Module], tokens: int) -> Iterator[None]:
        if not kernels.on_cuda():
            yield
            return
        modules = [m for part in (model if isinstance(model, list) else [model]) for m in part.modules()]
        share_dequantized = not any(isinstance(m, self.recomputed) for m in modules)
        took = self._take(modules, tokens, share_dequantized)
        before = [(layer, layer.step_norms) for layer, _ in took]  # a step inside another keeps the outer's
        for layer, norms in took:
            layer.step_norms = norms
        try:
            yield
        finally:
            for layer, norms in before:
                layer.step_norms = norms

    def _take(self, modules: list[nn.Module], tokens: int,
              share_dequantized: bool) -> list[tuple[nn.Module, StepNorms]]:
        """Every covered layer's StepNorms, one launch per group of layers of one shape."""
        # W' = rs W for every layer is held through the step, so not where blocks are recomputed.
        fold = self.fold is not False and share_dequantized
        groups = _groups(modules, tokens, fold)
        # A dense base's W' is a second copy of it; a quantized one's replaces the dequantized copy.
        fold_dense = fold and (self.fold is True or self._copies_fit(sum(
            dense.nbytes for members in groups.values() for layer, dense in members if not is_quantized(layer.linear))))
        took = []
        for key, members in groups.items():
            layers = [layer for layer, _ in members]
            args = ([dense for _, dense in members], [mx.stop_gradient(layer.lora_a) for layer in layers],
                    [mx.stop_gradient(layer.lora_b) for layer in layers], [float(layer.scale) for layer in layers])
            folded = factors = [None] * len(layers)
            folded_launch = fold and (fold_dense or all(is_quantized(layer.linear) for layer in layers))
            merged = folded_launch and key[-1]  # the group's merged flag (the key's last) counts only where folded
            if folded_launch:
                # Norms stacked: m's gradient kernel reads a layer's in the launch's array (no view a layer).
                norms, w_scaled, rs, *cast = kernels.row_norms_and_scaled_cuda(
                    *args, [mx.stop_gradient(layer.m) for layer in layers], factors=self.hand_factors,
                    stacked=True, merged=merged)
                folded = list(zip(w_scaled, rs))
                factors = list(zip(*cast)) or factors  # (A, B') where the launches wrote them
            else:
                norms = kernels.row_norms_cuda(*args)
            for (layer, dense), norm, fold_of, factors_of in zip(members, norms, folded, factors):
                shared = share_dequantized or not is_quantized(layer.linear)  # a dense base's weight is its own
                dense = None if isinstance(dense, kernels.PackedWeight) else dense  # the layer takes W' instead
                scaled, row_scale = fold_of or (None, None)
                took.append((layer, StepNorms(tokens=tokens, dense_weight=dense if shared else None, norm=norm,
                                              scaled_weight=scaled, row_scale=row_scale, factors=factors_of,
                                              merged=merged)))
        return took

    def _copies_fit(self, nbytes: int) -> bool:
        """"auto": whether dense bases' folded copies of `nbytes` fit in kernels.FOLD_MEMORY_SHARE of the
        GPU's memory (yes where the GPU does not report it)."""
        if self.memory is None or nbytes <= kernels.FOLD_MEMORY_SHARE * self.memory:
            return True
        if not self.said_unfolded:
            self.said_unfolded = True
            print(f"meshtune: DoRA's folded step is off for dense bases: their folded copies would take "
                  f"{nbytes / 2**30:.1f} GiB of the GPU's {self.memory / 2**30:.0f} GiB (more than "
                  f"{kernels.FOLD_MEMORY_SHARE:.0%}); adapter.dora_fold: true folds them anyway", file=sys.stderr,
                  flush=True)
        return False


def _groups(modules: list[nn.Module], tokens: int,
            fold: bool) -> dict[tuple, list[tuple[nn.Module, mx.array | kernels.PackedWeight]]]:
    """The covered layers on the dense path at `tokens` rows, grouped by what one launch takes (weight shape and
    dtype, rank, packing, merged), each with the weight the launch reads: packed where folded and the launch
    reads it so, else dense (dequantized once)."""
    groups: dict[tuple, list[tuple[nn.Module, mx.array | kernels.PackedWeight]]] = {}
    for layer in modules:
        if not _covered(layer) or not layer.base_path.uses_dense_weight(layer.linear, tokens):
            continue  # not DoRA's, or the quantized kernel's token count: the layer takes its own norm
        r = layer.lora_a.shape[-1]
        # Folded and without dropout, the launch writes the whole adapted weight: the branch's input is x itself.
        merged = fold and layer.dropout_rate == 0
        # Folded, a quantized base's launch reads its packed weight (no dequantized copy a layer: W' replaces it).
        packed = kernels.packed_weight(layer.linear) if fold else None
        if packed is not None and kernels.reads_packed(packed, r):
            groups.setdefault((packed.shape, packed.dtype, r, packed.bits, packed.group_size, merged), []).append(
                (layer, packed))
        else:
            dense = layer.base_path.dense_weight_for(layer.linear, tokens)
            groups.setdefault((dense.shape, dense.dtype, r, merged), []).append((layer, dense))
    return groups
