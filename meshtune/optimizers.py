"""Optimizers and learning-rate schedules from the config.

Schedules follow mlx-lm's `lr_schedule` (a name from mlx.optimizers.schedulers, its
arguments, a linear warmup joined in front), with arguments derived from the
learning rate and the run length when none are given.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .cuda import on_cuda

OPTIMIZERS: dict[str, Any] = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "sgd": optim.SGD,
    "adafactor": optim.Adafactor,
}
if hasattr(optim, "Muon"):
    OPTIMIZERS["muon"] = optim.Muon


# Optimizers whose update is elementwise: an element's new value and state depend only on
# that element's gradient, value and state, and on scalars the step shares (learning rate,
# step count). AdamW and Adamax are Adams. Adafactor (row and column moments, the
# parameter's RMS) and Muon (orthogonalised matrices) are not, and are never packed.
ELEMENTWISE = (optim.SGD, optim.Adam, optim.RMSprop, optim.Adagrad, optim.AdaDelta, optim.Lion)

# The largest parameter (elements) updated in the packed vector. DoRA's magnitudes (one
# vector a layer, 112 in the 1B bench model) are each a few thousand; LoRA's factors
# are rank x width.
PACK_MAX_ELEMENTS = 8192


def _pack(arrays: list[mx.array]) -> mx.array:
    """The arrays flattened end to end, float32 (one kernel on CUDA)."""
    if on_cuda():
        from .parallel.pack_kernel import pack_cuda

        return pack_cuda(arrays, mx.float32)
    return mx.concatenate([a.reshape(-1) for a in arrays])


def _subtree(tree: Any, key: str) -> Any:
    """tree's node at a tree_flatten key ("layers.0.mlp.m")."""
    for part in key.split("."):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


class PackedUpdates:
    """An elementwise mlx optimizer (ELEMENTWISE) whose small float32 parameters are
    updated as one packed vector: one fused update a step instead of one a parameter.

    In a compiled step each parameter's update is a launch of its own, whatever its
    size; DoRA adds a magnitude vector per adapted layer, and on an H200 their 112
    updates cost the 1B step ~4.5 ms of ~70 (scripts/probe_dora_step.py, "Adam on m
    packed"). The update being elementwise, the packed result is the per-parameter one
    bit for bit. The state stays per parameter, as the plain optimizer keeps it (packed
    and unpacked with the values each step), so checkpoints and resume do not change.
    """

    def _packable(self, grad: mx.array, value: mx.array) -> bool:
        return grad.dtype == value.dtype == mx.float32 and grad.shape == value.shape and grad.size <= PACK_MAX_ELEMENTS

    def apply_gradients(self, gradients: dict, parameters: dict) -> dict:
        grads = tree_flatten(gradients)
        values = {k: _subtree(parameters, k) for k, _ in grads}
        chosen = [k for k, g in grads if self._packable(g, values[k])]
        if len(chosen) < 2:
            return super().apply_gradients(gradients, parameters)
        if not self._initialized:
            self.init(gradients)
        states = [_subtree(self.state, k) for k in chosen]
        slots = sorted(states[0])
        if any(sorted(st) != slots or any(st[s].shape != values[k].shape or st[s].dtype != mx.float32 for s in slots)
               for k, st in zip(chosen, states)):
            return super().apply_gradients(gradients, parameters)
        picked = set(chosen)
        # The rest first: that sets the step's learning rate and count, which the packed update shares.
        rest = [(k, g) for k, g in grads if k not in picked]
        updated = dict(tree_flatten(super().apply_gradients(tree_unflatten(rest) if rest else {}, parameters)))
        grads = dict(grads)
        packed_state = {s: _pack([st[s] for st in states]) for s in slots}
        new = self.apply_single(_pack([grads[k] for k in chosen]), _pack([values[k] for k in chosen]), packed_state)
        start = 0
        for k, st in zip(chosen, states):
            shape, end = values[k].shape, start + values[k].size
            updated[k] = new[start:end].reshape(shape)
            for s in slots:
                st[s] = packed_state[s][start:end].reshape(shape)
            start = end
        return tree_unflatten(list(updated.items()))


_PACKED: dict[type, type] = {}


def packed_updates(cls: type) -> type:
    """cls with PackedUpdates where its update is elementwise; otherwise cls itself."""
    if not issubclass(cls, ELEMENTWISE):
        return cls
    if cls not in _PACKED:
        _PACKED[cls] = type(cls.__name__, (PackedUpdates, cls), {"__doc__": cls.__doc__,
                                                                 "__module__": __name__})
    return _PACKED[cls]


def default_arguments(name: str, learning_rate: float, steps: int) -> list[float] | None:
    """Arguments for a schedule when the config gives none (None: it needs them)."""
    if name == "cosine_decay":
        return [learning_rate, steps, 0.0]
    if name == "linear_schedule":
        return [learning_rate, 0.0, steps]
    return None


def build_schedule(*, name: str, arguments: list[float] | None, warmup: int, warmup_init: float,
                   learning_rate: float, iters: int) -> float | Callable[[Any], Any]:
    """A constant rate or an mlx schedule, with linear warmup joined as mlx-lm does."""
    if name == "constant":
        main: Any = (lambda _step: learning_rate) if warmup else learning_rate
        initial = learning_rate
    else:
        args = arguments if arguments is not None else default_arguments(name, learning_rate, iters - warmup)
        if args is None:
            raise ValueError(f"schedule.name={name} needs schedule.arguments, e.g. "
                             f"[{learning_rate}, 0.9] for exponential_decay")
        main, initial = getattr(optim.schedulers, name)(*args), args[0]
    if not warmup:
        return main
    ramp = optim.schedulers.linear_schedule(warmup_init, initial, warmup)
    return optim.schedulers.join_schedules([ramp, main], [warmup + 1])


def build_optimizer(*, name: str, learning_rate: float | Callable[[Any], Any], weight_decay: float | None,
                    options: dict[str, Any]) -> optim.Optimizer:
    """The named mlx optimizer; bad options become an error naming optimizer.options."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={name} is not available in this mlx; "
                         f"choose one of {', '.join(sorted(OPTIMIZERS))}")
    kwargs = dict(options)
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    try:
        return packed_updates(OPTIMIZERS[name])(learning_rate=learning_rate, **kwargs)
    except TypeError as err:
        raise ValueError(f"optimizer.options={kwargs} do not fit {OPTIMIZERS[name].__name__}: {err}; "
                         "remove or rename the offending option") from None
