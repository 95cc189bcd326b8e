"""One step in flight: the host builds the next iteration while the device runs this one (runtime.overlap_steps)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class OneInFlight:
    """Evaluates a loop's outputs one iteration behind where `overlap` (runtime.overlap_steps):
    `run` dispatches this iteration's outputs, then waits for the previous iteration's `wait_on`
    arrays, so the host builds the next iteration while the device runs this one. MLX signals an
    evaluation's arrays together, at its end, so waiting on a few of them waits for all of it.
    Without `overlap`, `run` evaluates and returns."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._pending: list[mx.array] = []

    def run(self, outputs: Any, wait_on: list[mx.array]) -> None:
        if not self.overlap:
            mx.eval(outputs)
            return
        mx.async_eval(outputs)
        self.finish()
        self._pending = list(wait_on)

    def finish(self) -> None:
        """Wait for the iteration still in flight, if any."""
        mx.eval(self._pending)
        self._pending = []


def overlaps_steps(setting: bool | str) -> bool:
    """runtime.overlap_steps as the strategies take it: "auto" is on where arrays live on a GPU."""
    if setting == "auto":
        return mx.default_device().type == mx.DeviceType.gpu
    return setting is True
