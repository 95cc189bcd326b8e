"""Optimizers and learning-rate schedules from the config.

Schedules follow mlx-lm's `lr_schedule` (a name from mlx.optimizers.schedulers, its
arguments, a linear warmup joined in front), with arguments derived from the
learning rate and the run length when none are given.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.optimizers as optim

OPTIMIZERS: dict[str, Any] = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "sgd": optim.SGD,
    "adafactor": optim.Adafactor,
}
if hasattr(optim, "Muon"):
    OPTIMIZERS["muon"] = optim.Muon


def build_schedule(*, name: str, arguments: list[float] | None, warmup: int, warmup_init: float,
                   learning_rate: float) -> float | Callable[[Any], Any]:
    """A constant rate or an mlx schedule, with linear warmup joined as mlx-lm does.

    `arguments` are the schedule function's, resolved (config.Config.schedule_arguments derives
    cosine_decay's and linear_schedule's from the learning rate and the steps after warmup)."""
    if name == "constant":
        main: Any = (lambda _step: learning_rate) if warmup else learning_rate
        initial = learning_rate
    else:
        args = arguments
        if not args:
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
        return OPTIMIZERS[name](learning_rate=learning_rate, **kwargs)
    except TypeError as err:
        raise ValueError(f"optimizer.options={kwargs} do not fit {OPTIMIZERS[name].__name__}: {err}; "
                         "remove or rename the offending option") from None
