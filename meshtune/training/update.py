"""The optimizer update every parallel strategy makes: divide by the tokens, clip, apply.

Gradients arrive as sums of token losses (already summed over whatever ranks hold the
same parameters) and the token count of the whole global batch, so the update equals
one process's on that batch. Clipping follows mlx's `optim.clip_grad_norm`; only the global
norm's square-sum differs by strategy: local for data parallelism, summed across stages for
a pipeline (parallel/pipeline/executor.py). The update is gated: a bad step leaves the
parameters and the optimizer state as they were, decided inside the compiled step
(`apply_update` says which steps are bad and how the ranks agree). Adam and AdamW take the
gate inside their own update, and a large parameter's update runs in place (`_gated_adam`);
docs/performance.md ("The update") gives what each costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_reduce

from . import IN_PLACE_FROM


def local_square_sum(grads: Any) -> mx.array:
    """Sum of every gradient's squares, as optim.clip_grad_norm takes it (float16 summed in float32)."""
    def squares(g: mx.array) -> mx.array:
        return (g.astype(mx.float32) if g.dtype == mx.float16 else g).square().sum()

    return tree_reduce(lambda acc, g: acc + squares(g), grads, 0.0)


@dataclass(frozen=True)
class StepVerdict:
    """Whether a step's update was applied, and why not: lazy arrays, equal on every rank."""

    ok: mx.array  # bool: the norm is finite, the global batch has target tokens, the new values are finite
    norm: mx.array  # the global gradient norm (of the token-averaged gradients, before clipping)
    tokens: mx.array  # the global batch's target tokens
    finite: mx.array = field(default_factory=lambda: mx.array(True))  # every new value finite (every rank)

    def arrays(self) -> list[mx.array]:
        return [self.ok, self.norm, self.tokens, self.finite]

    def describe(self) -> str:
        """What was wrong, for the one line the loop says (reads the arrays: a host sync)."""
        if self.tokens.item() == 0:
            return f"the global batch has no trainable tokens (gradient norm is {self.norm.item()})"
        if mx.isfinite(self.norm).item() and not self.finite.item():
            return (f"the update would make non-finite weights or optimizer state (gradient norm is "
                    f"{self.norm.item():.4g}); lower --learning-rate or check the optimizer's settings")
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


def all_finite(tree: Any) -> mx.array:
    """Whether every floating value in `tree` is finite: one bool (integer leaves, counters, are skipped)."""
    flags = [mx.isfinite(v).all() for _, v in tree_flatten(tree)
             if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)]
    return mx.all(mx.stack(flags)) if flags else mx.array(True)


def same_rank(finite: mx.array) -> mx.array:
    """`all_ranks` where every rank holds the same parameters: its own verdict is everyone's."""
    return finite


def apply_update(model: nn.Module, optimizer: optim.Optimizer, grads: Any, tokens: mx.array, *,
                 max_grad_norm: float, square_sum: Callable[[Any], mx.array] = local_square_sum,
                 all_ranks: Callable[[mx.array], mx.array] = same_rank, in_place_from: int = IN_PLACE_FROM
                 ) -> StepVerdict:
    """Update `model` from summed `grads` and the global `tokens`; clip to `max_grad_norm` (0: off).

    `square_sum(grads)` is the square of the global gradient norm, over every parameter
    of the model once, whichever rank holds it (a collective where ranks hold different
    parameters: every rank calls it every step). `all_ranks(finite)` is every rank's AND of
    its own update's finiteness (a collective where ranks hold different parameters). Adam's
    parameters of `in_place_from` elements or more are updated in place (`_gated_adam`).

    Clipping applies mlx's scale min(max_norm / (||g|| + 1e-6), 1) to each gradient, cast back to
    its dtype. Without clipping the norm is taken from the summed gradients and divided once, so
    each gradient's division joins the update's kernels.

    A step whose global gradient norm is not finite, whose global batch has no target tokens, or
    whose update would make a parameter or optimizer state value non-finite (a finite gradient
    times a learning rate of 1e39, a nan weight decay), changes nothing: `mx.where(ok, new, old)`
    on every array, inside the compiled step, no host sync. The norm and the token count are
    already the same on every rank; so are the new values where every rank holds the same
    parameters (data parallelism), and a pipeline's stages AND their own finiteness in one
    collective (`all_ranks`). A non-finite loss makes a non-finite gradient (its logits are inf or
    nan), so the norm covers it. For a finite step `where` returns the new arrays bit for bit.
    """
    if max_grad_norm > 0:  # mlx's clip_grad_norm, bit for bit: the norm of the divided gradients
        # `tokens * 1`: an equal count from a node of its own, so that MLX's compiler does not merge these
        # divisions with the update's (`_gated_adam`), which would store each divided gradient for both.
        norm = mx.sqrt(square_sum(tree_map(lambda g: g / (tokens * 1).astype(g.dtype), grads)))
        scale = mx.minimum(max_grad_norm / (norm + 1e-6), 1.0)

        def prepare(g: mx.array, tokens: mx.array) -> mx.array:
            # Cast after scaling, as mlx does, so a small scale does not underflow in float16.
            return ((g / tokens.astype(g.dtype)) * scale).astype(g.dtype)
        factor = scale / tokens.astype(mx.float32)
    else:  # the norm only gates: taken before the division, which then fuses into the optimizer's kernels
        norm = mx.sqrt(square_sum(grads)) / tokens.astype(mx.float32)

        def prepare(g: mx.array, tokens: mx.array) -> mx.array:
            return g / tokens.astype(g.dtype)
        factor = 1 / tokens.astype(mx.float32)
    ok = mx.isfinite(norm) & (tokens > 0)
    if type(optimizer) in (optim.Adam, optim.AdamW):
        counters = {k: optimizer.state[k] for k in ("step", "learning_rate") if k in optimizer.state}
        finite = _adam_stays_finite(optimizer, model, grads, factor, in_place_from)
        optimizer.state.update(counters)  # the probe advanced them; the update below advances them once
        # `& ok`: the finiteness waits for the norm, so a pipeline's collectives run in one order everywhere.
        finite = all_ranks(finite & ok)
        ok = ok & finite
        # this update's only: removed below
        optimizer.apply_single = _gated_adam(optimizer, ok, prepare, tokens, in_place_from)
        try:
            optimizer.update(model, grads)
        finally:
            del optimizer.apply_single
        _keep_old(ok, optimizer.state, counters)
        return StepVerdict(ok=ok, norm=norm, tokens=tokens, finite=finite)
    grads = tree_map(lambda g: prepare(g, tokens), grads)
    old_params = tree_map(lambda p: p, model.trainable_parameters())
    old_state = tree_map(lambda s: s, optimizer.state)
    optimizer.update(model, grads)
    # The new values are here beside the old ones already: their finiteness is one reduction each.
    finite = all_ranks(all_finite([model.trainable_parameters(), optimizer.state]) & ok)
    ok = ok & finite
    model.update(_keep_old(ok, model.trainable_parameters(), old_params))
    _keep_old(ok, optimizer.state, old_state)
    return StepVerdict(ok=ok, norm=norm, tokens=tokens, finite=finite)


def _adam_stays_finite(optimizer: optim.Adam, model: nn.Module, grads: Any, factor: mx.array,
                       in_place_from: int) -> mx.array:
    """Whether Adam's (AdamW's) update of every parameter under `in_place_from` elements keeps every value
    finite, before any is made.

    Each parameter's new value and second moment are recomputed inside one reduction (its kernel
    writes one bool per element, not the values), so the update itself still runs in place and
    the gate that reads this flag selects nothing twice. The first moment needs no check: it is
    a convex mix of a finite moment and a finite gradient (the norm's gate covers the gradient).
    The gradient is the summed one times `factor` (1 / tokens, times the clipping scale), and the
    moments are written as m + (g - m)(1 - b1), so MLX's compiler merges none of these nodes with
    the update's (a merged node would be stored for both readers).
    """
    decoupled = isinstance(optimizer, optim.AdamW)
    flags: list[mx.array] = []

    def probe(summed: mx.array, parameter: mx.array, state: dict) -> mx.array:
        if parameter.size >= in_place_from:  # gated element by element in its own kernels (`_gated_adam`)
            return parameter
        gradient = summed * factor.astype(summed.dtype)
        lr = optimizer.learning_rate.astype(gradient.dtype)
        start = parameter - (optimizer.weight_decay * lr) * parameter if decoupled else parameter
        b1, b2 = optimizer.betas
        m = state["m"] + (gradient - state["m"]) * (1 - b1)
        v = state["v"] + (mx.square(gradient) - state["v"]) * (1 - b2)
        if optimizer.bias_correction:
            c1 = (lr / (1 - b1 ** optimizer.step)).astype(gradient.dtype)
            c2 = mx.rsqrt(1 - b2 ** optimizer.step).astype(gradient.dtype)
            new = start - m * c1 / (optimizer.eps + c2 * mx.sqrt(v))
        else:
            new = start - m * lr / (optimizer.eps + mx.sqrt(v))
        flags.append((mx.isfinite(new) & mx.isfinite(v)).all())
        return parameter

    optimizer.apply_single = probe  # advances the step and the scheduled learning rate as the update will
    try:
        optimizer.apply_gradients(grads, model.trainable_parameters())
    finally:
        del optimizer.apply_single
    return mx.all(mx.stack(flags)) if flags else mx.array(True)



def _gated_adam(optimizer: optim.Adam, ok: mx.array, prepare: Callable[[mx.array, mx.array], mx.array],
                tokens: mx.array, in_place_from: int) -> Callable[[mx.array, mx.array, dict], mx.array]:
    """mlx's Adam (and AdamW) `apply_single` with the gate inside, taking the summed gradient and
    `prepare(summed, tokens)` to make the one it applies. m and v are selected as they are made and
    the parameter's update reads the selected ones; a step with `ok` gives mlx's arithmetic bit for
    bit (a test compares). Selecting after the optimizer instead leaves each new moment two readers
    and costs each parameter five more kernels.

    A parameter of at least `in_place_from` elements is updated in place: m, v and the parameter are
    each made by a kernel of its own, so each takes the buffer of the array it replaces (MLX hands
    an input's buffer to a kernel's output only where the kernel has one output). Fused into one
    kernel with three outputs, the update holds a second copy of the weights and both moments until
    it ends: three times the trained weights' bytes more at the update. The barrier between the
    kernels is `mx.contiguous`, which copies nothing here; v's gradient is divided by an equal token
    count from a node of its own (`tokens + 0`), since MLX's compiler merges equal expressions and
    the merged division would be one more array that both kernels read. A smaller parameter's
    division, moments, parameter and selects are one kernel.

    `ok` covers every parameter under `in_place_from` elements (`_adam_stays_finite`). A parameter
    updated in place cannot wait for a flag over its own new values without a second copy of
    them, so its kernels hold back, element by element, each second moment and weight whose new
    value would not be finite (inside the same kernel: no extra pass); the save checks again."""
    decoupled = isinstance(optimizer, optim.AdamW)

    def apply_single(summed: mx.array, parameter: mx.array, state: dict) -> mx.array:
        in_place = parameter.size >= in_place_from
        gradient = prepare(summed, tokens)
        lr = optimizer.learning_rate.astype(gradient.dtype)
        start = parameter * (1 - lr * optimizer.weight_decay) if decoupled else parameter
        b1, b2 = optimizer.betas
        m = state["m"] = mx.where(ok, b1 * state["m"] + (1 - b1) * gradient, state["m"])
        if in_place:
            gradient = prepare(summed, tokens + 0)  # equal, but a node of its own: not merged with m's
        v = b2 * state["v"] + (1 - b2) * mx.square(gradient)
        v = state["v"] = mx.where((ok & mx.isfinite(v)) if in_place else ok, v, state["v"])
        if in_place:
            m, v = mx.contiguous(m), mx.contiguous(v)
        if optimizer.bias_correction:
            c1 = (lr / (1 - b1 ** optimizer.step)).astype(gradient.dtype)
            c2 = mx.rsqrt(1 - b2 ** optimizer.step).astype(gradient.dtype)
            new = start - (c1 * m) / (mx.sqrt(v) * c2 + optimizer.eps)
        else:
            new = start - lr * m / (mx.sqrt(v) + optimizer.eps)
        return mx.where((ok & mx.isfinite(new)) if in_place else ok, new, parameter)

    return apply_single
