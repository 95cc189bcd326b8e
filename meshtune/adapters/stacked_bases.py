"""DoRA's dense frozen bases held stacked, one array a shape, so a step's folded norms are a few MLX operations.

On MLX's CUDA build a training step takes every DoRA layer's row norm and W' = rs W before the forward
(step_norms.py). The norm launch (kernels.row_norms_and_scaled_cuda) runs well under the memory's speed:
on an H200 the 1B bench model's 112 layers took 5.3 ms of GPU time a step, where the same norms and W'
from MLX operations on each shape's weights held as one (n, out, in) array took 2.7 ms (batched W A 0.85 ms,
W' 1.44 ms; scripts/probes/stacked_gemm_norms.py, one invocation). With the weights stacked, each is one
operation however many layers share the shape:

    W A      one batched matmul, A split into two bfloat16 halves (A = hi + lo) so the product keeps
             float32's precision: [hi | lo] is 2r columns, and the matmul is a pass over W either way
    norm     DESIGN.md's identity, ||w||^2 + 2s b.(W A) + s^2 b (A^T A) b, from the cached ||w_i||^2
    W'       rs W, rs = m / norm rounded to W's dtype, one elementwise multiply

`stack_dense_bases(model)` (train.build_step calls it before compiling, on CUDA) replaces each layer's
weight with a view of its shape's stack (no copy is kept: the stack is the weights); `stack_for(layers)`
is the stack of exactly those layers in that order, or None. The norm launch stays where no stack
covers a group (a quantized base: read packed by the launch; a single layer of its shape; a stack not
taken). NORMS_ENV chooses: "launch" (the default) or "stacked". Launch stays the default until a whole step
measures the stacked form faster: the session that wrote this ran out of GPU time after the probe above
(scripts/probe_dora_step.py --only "current,stacked bases" is the comparison to run).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from . import kernels
from .base_path import is_quantized

NORMS_ENV = "MESHTUNE_DORA_NORMS"
NORMS_SETTINGS = ("launch", "stacked")


def _norms_setting(value: str) -> str:
    if value not in NORMS_SETTINGS:
        raise ValueError(f"{NORMS_ENV}={value!r}: use launch (the default: meshtune's norm kernel) or stacked (a dense "
                         "base's folded DoRA norms by MLX operations on its shape's weights held as one array)")
    return value


NORMS = _norms_setting(os.environ.get(NORMS_ENV, "launch"))

# A stacked layer's plain attribute (not in its parameter or state tree): (its shape's stack (n, out, in),
# ||w_i||^2 stacked (n, out) float32, the layer's index in them).
_STACK = "_base_stack"


def _stackable(layer: nn.Module) -> bool:
    from .dora import DoRALinear

    return (isinstance(layer, DoRALinear) and not is_quantized(layer.linear)
            and layer.lora_a.shape[-1] <= kernels.MAX_RANK)


def stack_dense_bases(model: nn.Module) -> int:
    """Hold the dense base weights of `model`'s DoRA layers stacked, a shape at a time (each layer's weight
    becomes a view of its stack); returns how many layers were. Layers alone in their shape stay as they are."""
    if NORMS != "stacked":
        return 0
    groups: dict[tuple, list[nn.Module]] = {}
    for layer in model.modules():
        if _stackable(layer) and _STACK not in layer.__dict__:
            groups.setdefault((tuple(layer.linear.weight.shape), layer.linear.weight.dtype), []).append(layer)
    stacked = 0
    for layers in groups.values():
        if len(layers) < 2:
            continue
        stack = mx.stack([layer.linear.weight for layer in layers])
        w_sq = mx.stack([layer._w_sq for layer in layers])
        mx.eval(stack, w_sq)
        for i, layer in enumerate(layers):
            layer.linear.weight = stack[i]
            layer.__dict__[_STACK] = (stack, w_sq, i)
        mx.eval([layer.linear.weight for layer in layers])  # views of the stack; the old weights go
        stacked += len(layers)
    return stacked


def stack_for(layers: list[nn.Module]) -> tuple[mx.array, mx.array, list[int]] | None:
    """(stack, ||w_i||^2 stacked, each layer's index in them) where one stack holds exactly `layers`' base
    weights (in any order), else None."""
    if NORMS != "stacked" or not layers:
        return None
    entries = [layer.__dict__.get(_STACK) for layer in layers]
    if any(e is None for e in entries):
        return None
    stack, w_sq = entries[0][:2]
    indices = [e[2] for e in entries]
    if any(e[0] is not stack for e in entries) or sorted(indices) != list(range(stack.shape[0])):
        return None
    return stack, w_sq, indices


def norms_and_scaled(stack: mx.array, w_sq: mx.array, indices: list[int], a: list[mx.array], b: list[mx.array],
                     scales: list[float], magnitudes: list[mx.array]) -> tuple[list, ...]:
    """kernels.row_norms_and_scaled_cuda(..., factors=True, stacked=True)'s outputs for the layers of `stack`
    (the arguments a list each, layer j at `indices[j]` in the stack, as stack_for gives them): (StackedNorm,
    W' = rs W, rs float32, A and B' = B rs in W's dtype), a list each in the arguments' order, from MLX operations."""
    n, out, inp = stack.shape
    dt = stack.dtype
    order = sorted(range(n), key=indices.__getitem__)  # the arguments' positions in the stack's order
    a, b, scales, magnitudes = ([x[j] for j in order] for x in (a, b, scales, magnitudes))
    r = a[0].shape[-1]
    # Concatenated, then shaped: mx.stack would add an expand_dims node a layer (336 a step for the 1B model).
    a32 = mx.concatenate([x.astype(mx.float32) for x in a]).reshape(n, inp, r)
    b32 = mx.concatenate([y.astype(mx.float32) for y in b]).reshape(n, r, out)
    hi = a32.astype(dt)
    lo = (a32 - hi.astype(mx.float32)).astype(dt)
    both = (stack @ mx.concatenate([hi, lo], axis=-1)).astype(mx.float32)  # (n, out, 2r): W hi, W lo
    proj = both[..., :r] + both[..., r:]
    s = mx.array(scales, dtype=mx.float32)[:, None, None]
    coef = b32.swapaxes(-1, -2)  # (n, out, r): row i's b_i
    gram = a32.swapaxes(-1, -2) @ a32  # (n, r, r)
    sq = w_sq + (coef * (2 * s * proj + (s * s) * (coef @ gram))).sum(axis=-1)
    norm = mx.sqrt(mx.maximum(sq, 0.0))  # (n, out)
    rs = (mx.concatenate([m.astype(mx.float32) for m in magnitudes]).reshape(n, out) / norm).astype(dt)
    w_scaled = (rs[..., None] * stack).reshape(n * out, inp)
    b_scaled = (b32 * rs.astype(mx.float32)[:, None, :]).astype(dt).reshape(n * r, out)
    flat = norm.reshape(-1)
    norms = [kernels.StackedNorm(flat, i * out, out) for i in range(n)]
    views = (norms, *(mx.split(x, n) for x in (w_scaled, rs.astype(mx.float32).reshape(-1),
                                               hi.reshape(n * inp, r), b_scaled)))
    return tuple([per_stack[i] for i in indices] for per_stack in views)
