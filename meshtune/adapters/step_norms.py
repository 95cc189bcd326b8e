"""DoRA's per-step work on MLX's CUDA build: every DoRA layer's row norm for a training step at once.

DoRA's norm ||W + s (A B)^T||_row is a constant of the step (DoRA paper, section 4.3):
it depends on the parameters, not on the activations. Taken layer by layer it is one
small launch per layer in the middle of the forward (the 1B bench model: 112 launches,
3.1 ms of GPU time and their host dispatch a step). Taken before the forward, the
layers of one shape share a launch (kernels.row_norms_cuda): a handful a step.

`step_row_norms(modules, tokens)` is DoRA's `PerStepWork` (adapters/per_step.py): a
training step runs its forward and backward inside it. Inside, each DoRA layer finds
what the step took for it (a `StepNorms`: its norm, and the dense base weight the norm
was taken of, dequantized once where the base is quantized) with `taken`; outside, or
for a layer the step did not cover, the layer computes its own. The step's StepNorms
live in a context variable for the duration of the block, keyed by layer; nothing is
stored on the modules, so the model's parameter and state trees do not change.

A dequantized weight handed to a layer lives for the whole step. Where blocks are
recomputed in the backward (training/grad_checkpoint.enable_grad_checkpoint) a layer's own lives
for its block only, so there the layers dequantize their own: about 14 GB of bfloat16
for an 8B 4-bit model's adapted layers is what checkpointing is there to save.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

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
    """(A, B' = B rs) in W's dtype where the folded launch wrote them (kernels.writes_factors())."""
    merged: bool = False
    """Whether `scaled_weight` is the merged rs (W + s (A B)^T), not rs W."""


# The current step's StepNorms by id(layer) (modules are dicts, hence unhashable); empty outside a step.
_STEP: ContextVar[dict[int, StepNorms]] = ContextVar("meshtune_step_norms", default={})


def taken(layer: nn.Module, tokens: int) -> StepNorms | None:
    """What the current step took for `layer` where its call is on `tokens` rows, else None."""
    hit = _STEP.get().get(id(layer))
    return hit if hit is not None and hit.tokens == tokens else None


def _recomputed(module: nn.Module) -> bool:
    """Whether `module` is a block recomputed in the backward (training/grad_checkpoint.enable_grad_checkpoint)."""
    return getattr(type(module).__call__, "recomputes_in_backward", False)


def _covered(layer: nn.Module) -> bool:
    """A DoRA linear layer in training (its class says `takes_step_norms`) of a rank the kernels take."""
    return (getattr(type(layer), "takes_step_norms", False) and layer.training
            and layer.lora_a.shape[-1] <= kernels.MAX_RANK)


@contextmanager
def step_row_norms(model: nn.Module | list[nn.Module], tokens: int) -> Iterator[None]:
    """Within the block, DoRA layers of `model` (a module or a list of them) called on
    `tokens` rows use norms taken together (CUDA only)."""
    if not kernels.on_cuda():
        yield
        return
    modules = [m for part in (model if isinstance(model, list) else [model]) for m in part.modules()]
    share_dequantized = not any(_recomputed(m) for m in modules)
    # W' = rs W for every layer is held through the step, so not where blocks are recomputed.
    fold = kernels.FOLD_ROW_SCALE is not False and share_dequantized
    groups: dict[tuple, list[tuple[nn.Module, mx.array | kernels.PackedWeight]]] = {}
    for layer in modules:
        if not _covered(layer):
            continue
        if not layer.base_path.uses_dense_weight(layer.linear, tokens):
            continue  # the quantized kernel's token count: the layer takes its own norm
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
    # A dense base's W' is a second copy of it; a quantized one's replaces the dequantized copy.
    fold_dense = fold and (kernels.FOLD_ROW_SCALE is True or _copies_fit(sum(
        dense.nbytes for members in groups.values() for layer, dense in members if not is_quantized(layer.linear))))
    took: dict[int, StepNorms] = {}
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
                *args, [mx.stop_gradient(layer.m) for layer in layers], factors=kernels.writes_factors(), stacked=True,
                merged=merged)
            folded = list(zip(w_scaled, rs))
            factors = list(zip(*cast)) or factors  # (A, B') where the launches wrote them
        else:
            norms = kernels.row_norms_cuda(*args)
        for (layer, dense), norm, fold_of, factors_of in zip(members, norms, folded, factors):
            shared = share_dequantized or not is_quantized(layer.linear)  # a dense base's weight is its own
            dense = None if isinstance(dense, kernels.PackedWeight) else dense  # the layer takes W' instead
            scaled, row_scale = fold_of or (None, None)
            took[id(layer)] = StepNorms(tokens=tokens, dense_weight=dense if shared else None, norm=norm,
                                        scaled_weight=scaled, row_scale=row_scale, factors=factors_of, merged=merged)
    active = _STEP.set({**_STEP.get(), **took})  # a step inside another sees the outer one's layers too
    try:
        yield
    finally:
        _STEP.reset(active)


_declined: list[bool] = []  # "auto" has said it leaves dense bases unfolded (said once)


@functools.cache
def _gpu_memory() -> int | None:
    """The default device's total memory in bytes (on MLX's CUDA build "total_memory"), None where not reported."""
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError):
        return None
    total = info.get("total_memory") or info.get("memory_size")
    return total if isinstance(total, int) else None


def _copies_fit(nbytes: int) -> bool:
    """kernels.FOLD_ROW_SCALE "auto": whether dense bases' folded copies of `nbytes` fit in
    kernels.FOLD_MEMORY_SHARE of the GPU's memory (yes where the GPU does not report it)."""
    total = _gpu_memory()
    if total is None or nbytes <= kernels.FOLD_MEMORY_SHARE * total:
        return True
    if not _declined:
        _declined.append(True)
        print(f"meshtune: DoRA's folded step is off for dense bases: their folded copies would take "
              f"{nbytes / 2**30:.1f} GiB of the GPU's {total / 2**30:.0f} GiB (more than "
              f"{kernels.FOLD_MEMORY_SHARE:.0%}); {kernels.FOLD_ENV}=1 folds them anyway", file=sys.stderr, flush=True)
    return False
