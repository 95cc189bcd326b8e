"""The optimizer update every parallel strategy makes: divide by the tokens, clip, apply.

Gradients arrive as sums of token losses (already summed over whatever ranks hold the
same parameters) and the token count of the whole global batch, so the update equals
one process's on that batch. Clipping follows mlx's `optim.clip_grad_norm` (the scale
min(max_norm / (||g|| + 1e-6), 1) applied to each gradient, cast back to its dtype);
only the global norm's square-sum differs by strategy: local for data parallelism,
summed across stages for a pipeline (parallel/pipeline/executor.py).

The update is gated: a step whose global gradient norm is not finite, or whose global
batch has no target tokens, leaves the parameters and the optimizer state as they were
(`mx.where(ok, new, old)` on every array, inside the compiled step: no host sync). Both
values are already the same on every rank, so every rank gates the same way with no
extra collective. A non-finite loss makes a non-finite gradient (its logits are inf or
nan), so the norm covers it. For a finite step `where` returns the new arrays bit for bit.
Adam and AdamW take the selects inside their own update (`_gated_adam`), and a large
parameter's update runs in place: see there. Without clipping the norm is taken from the
summed gradients and divided once, so each gradient's division joins the update's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map, tree_reduce

from . import IN_PLACE_FROM  # a module global here, read at each update, so a test can change it


def local_square_sum(grads: Any) -> mx.array:
    """Sum of every gradient's squares, as optim.clip_grad_norm takes it (float16 summed in float32)."""
    def squares(g: mx.array) -> mx.array:
        return (g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum()

    return tree_reduce(lambda acc, g: acc + squares(g), grads, 0.0)


@dataclass(frozen=True)
class StepVerdict:
    """Whether a step's update was applied, and why not: lazy arrays, equal on every rank."""

    ok: mx.array  # bool: the norm is finite and the global batch has target tokens
    norm: mx.array  # the global gradient norm (of the token-averaged gradients, before clipping)
    tokens: mx.array  # the global batch's target tokens

    def arrays(self) -> list[mx.array]:
        return [self.ok, self.norm, self.tokens]

    def describe(self) -> str:
        """What was wrong, for the one line the loop says (reads the arrays: a host sync)."""
        if self.tokens.item() == 0:
            return f"the global batch has no trainable tokens (gradient norm is {self.norm.item()})"
        return f"gradient norm is {self.norm.item()}"


def _keep_old(ok: mx.array, new: Any, old: Any) -> Any:
    """`new` where `ok`, else `old`, leaf by leaf; containers (dicts, lists) are updated in place,
    since a compiled step holds them (its `inputs`/`outputs` state)."""
    if isinstance(new, dict):
        for k in new:
            new[k] = _keep_old(ok, new[k], old[k]) if k in old else new[k]
        return new
    if isinstance(new, list):
        for i in range(len(new)):
            new[i] = _keep_old(ok, new[i], old[i])
        return new
    return mx.where(ok, new, old) if isinstance(new, mx.array) else new


def apply_update(model: nn.Module, optimizer: optim.Optimizer, grads: Any, tokens: mx.array, *,
                 max_grad_norm: float, square_sum: Callable[[Any], mx.array] = local_square_sum) -> StepVerdict:
    """Update `model` from summed `grads` and the global `tokens`; clip to `max_grad_norm` (0: off).

    `square_sum(grads)` is the square of the global gradient norm, over every parameter
    of the model once, whichever rank holds it (a collective where ranks hold different
    parameters: every rank calls it every step). A bad step (see above) changes nothing.
    """
    if max_grad_norm > 0:  # mlx's clip_grad_norm, bit for bit: the norm of the divided gradients
        # `tokens * 1`: an equal count from a node of its own, so that MLX's compiler does not merge these
        # divisions with the update's (`_gated_adam`), which would store each divided gradient for both.
        norm = mx.sqrt(square_sum(tree_map(lambda g: g / (tokens * 1).astype(g.dtype), grads)))
        scale = mx.minimum(max_grad_norm / (norm + 1e-6), 1.0)

        def prepare(g: mx.array, tokens: mx.array) -> mx.array:
            # Cast after scaling, as mlx does, so a small scale does not underflow in float16.
            return ((g / tokens.astype(g.dtype)) * scale).astype(g.dtype)
    else:  # the norm only gates: taken before the division, which then fuses into the optimizer's kernels
        norm = mx.sqrt(square_sum(grads)) / tokens.astype(mx.float32)

        def prepare(g: mx.array, tokens: mx.array) -> mx.array:
            return g / tokens.astype(g.dtype)
    ok = mx.isfinite(norm) & (tokens > 0)
    if type(optimizer) in (optim.Adam, optim.AdamW):
        counters = {k: optimizer.state[k] for k in ("step", "learning_rate") if k in optimizer.state}
        optimizer.apply_single = _gated_adam(optimizer, ok, prepare, tokens)  # this update's only: removed below
        try:
            optimizer.update(model, grads)
        finally:
            del optimizer.apply_single
        _keep_old(ok, optimizer.state, counters)
        return StepVerdict(ok=ok, norm=norm, tokens=tokens)
    grads = tree_map(lambda g: prepare(g, tokens), grads)
    old_params = tree_map(lambda p: p, model.trainable_parameters())
    old_state = tree_map(lambda s: s, optimizer.state)
    optimizer.update(model, grads)
    model.update(_keep_old(ok, model.trainable_parameters(), old_params))
    _keep_old(ok, optimizer.state, old_state)
    return StepVerdict(ok=ok, norm=norm, tokens=tokens)



def _gated_adam(optimizer: optim.Adam, ok: mx.array, prepare: Callable[[mx.array, mx.array], mx.array],
                tokens: mx.array) -> Callable[[mx.array, mx.array, dict], mx.array]:
    """mlx's Adam (and AdamW) `apply_single` with the gate inside, taking the summed gradient and
    `prepare(summed, tokens)` to make the one it applies. m and v are selected as they are made and
    the parameter's update reads the selected ones; a step with `ok` gives mlx's arithmetic bit for
    bit (a test compares). Selecting after the optimizer instead leaves each new moment two readers
    and costs each parameter five more kernels.

    A parameter of at least IN_PLACE_FROM elements is updated in place: m, v and the parameter are
    each made by a kernel of its own, so each takes the buffer of the array it replaces (MLX hands
    an input's buffer to a kernel's output only where the kernel has one output). Fused into one
    kernel with three outputs, the update holds a second copy of the weights and both moments until
    it ends: three times the trained weights' bytes more at the update. The barrier between the
    kernels is `mx.contiguous`, which copies nothing here; v's gradient is divided by an equal token
    count from a node of its own (`tokens + 0`), since MLX's compiler merges equal expressions and
    the merged division would be one more array that both kernels read. A smaller parameter's
    division, moments, parameter and selects are one kernel."""
    decoupled = isinstance(optimizer, optim.AdamW)

    def apply_single(summed: mx.array, parameter: mx.array, state: dict) -> mx.array:
        in_place = parameter.size >= IN_PLACE_FROM
        gradient = prepare(summed, tokens)
        lr = optimizer.learning_rate.astype(gradient.dtype)
        start = parameter * (1 - lr * optimizer.weight_decay) if decoupled else parameter
        b1, b2 = optimizer.betas
        m = state["m"] = mx.where(ok, b1 * state["m"] + (1 - b1) * gradient, state["m"])
        if in_place:
            gradient = prepare(summed, tokens + 0)  # equal, but a node of its own: not merged with m's
        v = state["v"] = mx.where(ok, b2 * state["v"] + (1 - b2) * mx.square(gradient), state["v"])
        if in_place:
            m, v = mx.contiguous(m), mx.contiguous(v)
        if optimizer.bias_correction:
            c1 = (lr / (1 - b1 ** optimizer.step)).astype(gradient.dtype)
            c2 = mx.rsqrt(1 - b2 ** optimizer.step).astype(gradient.dtype)
            new = start - (c1 * m) / (mx.sqrt(v) * c2 + optimizer.eps)
        else:
            new = start - lr * m / (mx.sqrt(v) + optimizer.eps)
        return mx.where(ok, new, parameter)

    return apply_single
