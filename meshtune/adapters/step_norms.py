"""Every DoRA layer's row norm for one training step at once, on MLX's CUDA build.

DoRA's norm ||W + s (A B)^T||_row is a constant of the step (DoRA paper, section 4.3):
it depends on the parameters, not on the activations. Taken layer by layer it is one
small launch per layer in the middle of the forward (the 1B bench model: 112 launches,
3.1 ms of GPU time and their host dispatch a step). Taken before the forward, the
layers of one shape share a launch (kernels.row_norms_cuda): a handful a step.

    with step_row_norms(model, tokens):
        loss, grads = loss_and_grad(model, ...)

Inside, each DoRA layer finds its norm (and the dense base weight the norm was taken
of, dequantized once where the base is quantized) by `lookup`; outside, or for a layer
the step did not cover, the layer computes its own as before. Nothing is stored on the
modules, so the model's parameter and state trees do not change.

A dequantized weight handed to a layer lives for the whole step. Where blocks are
recomputed in the backward (train.enable_grad_checkpoint) a layer's own lives for its
block only, so there the layers dequantize their own: about 14 GB of bfloat16 for an 8B
4-bit model's adapted layers is what checkpointing is there to save.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from . import kernels
from .base_path import dense_weight_for, is_quantized, uses_dense_weight

# id(layer) -> (tokens, dense weight or None, norm, (W' = rs W, rs) or None, (A, B' = B rs) in W's dtype or None,
#               whether W' is the merged rs (W + s (A B)^T))
_active: dict[int, tuple] = {}


def _recomputed(module: nn.Module) -> bool:
    """Whether `module` is a block recomputed in the backward (train.enable_grad_checkpoint)."""
    return getattr(type(module).__call__, "recomputes_in_backward", False)


def _covered(layer: nn.Module) -> bool:
    from .dora import DoRALinear

    return isinstance(layer, DoRALinear) and layer.training and layer.lora_a.shape[-1] <= kernels.MAX_RANK


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
        if not uses_dense_weight(layer.linear, tokens):
            continue  # the quantized kernel's token count: the layer takes its own norm
        r = layer.lora_a.shape[-1]
        # Folded and without dropout, the launch writes the whole adapted weight (kernels.MERGED_FOLD).
        merged = fold and kernels.MERGED_FOLD and layer.dropout_rate == 0
        # Folded, a quantized base's launch reads its packed weight (no dequantized copy a layer: W' replaces it).
        packed = kernels.packed_weight(layer.linear) if fold else None
        if packed is not None and kernels.reads_packed(packed, r):
            groups.setdefault((packed.shape, packed.dtype, r, packed.bits, packed.group_size, merged), []).append(
                (layer, packed))
        else:
            dense = dense_weight_for(layer.linear, tokens)
            groups.setdefault((dense.shape, dense.dtype, r, merged), []).append((layer, dense))
    # A dense base's W' is a second copy of it; a quantized one's replaces the dequantized copy.
    fold_dense = fold and (kernels.FOLD_ROW_SCALE is True or _copies_fit(sum(
        dense.nbytes for members in groups.values() for layer, dense in members if not is_quantized(layer.linear))))
    taken = {}
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
            taken[id(layer)] = (tokens, dense if shared else None, norm, fold_of, factors_of, merged)
    _active.update(taken)
    try:
        yield
    finally:
        for key in taken:
            _active.pop(key, None)


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


def lookup(layer: nn.Module, tokens: int) -> tuple[mx.array | None, "mx.array | kernels.StackedNorm"] | None:
    """(dense base weight, row norm) the current step took for `layer` on `tokens` rows, or None (a StackedNorm where folded).

    The weight is None where the layer is to dequantize its own (blocks recomputed in the backward).
    """
    hit = _taken(layer, tokens)
    return hit and hit[1:3]


def lookup_scaled(layer: nn.Module, tokens: int) -> tuple[mx.array, mx.array] | None:
    """(W' = rs W, rs float32) the current step wrote for `layer` on `tokens` rows (kernels.FOLD_ROW_SCALE), or None."""
    hit = _taken(layer, tokens)
    return hit and hit[3]


def lookup_factors(layer: nn.Module, tokens: int) -> tuple[mx.array, mx.array] | None:
    """(A, B' = B rs) in W's dtype the current step wrote beside W' for `layer` (kernels.writes_factors()), or None."""
    hit = _taken(layer, tokens)
    return hit and hit[4]


def lookup_merged(layer: nn.Module, tokens: int) -> bool:
    """Whether the W' the current step wrote for `layer` on `tokens` rows is the whole adapted weight,
    rs (W + s (A B)^T) (kernels.MERGED_FOLD), not rs W."""
    hit = _taken(layer, tokens)
    return bool(hit and hit[5])


def _taken(layer: nn.Module, tokens: int) -> tuple | None:
    """What the current step took for `layer` (see _active) where it was for `tokens` rows, else None."""
    hit = _active.get(id(layer))
    return hit if hit is not None and hit[0] == tokens else None
