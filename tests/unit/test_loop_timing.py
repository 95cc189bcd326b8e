"""A report's tokens/s counts the device's time, not only the host's dispatch.

With steps overlapped (runtime.overlap_steps, on by default on a GPU) a step's call returns
once the step is dispatched, and the loop waits for it later, when it reads the verdict.
Here the device is a verdict whose read takes DEVICE_S: the window's seconds must hold it.
"""

import json
import time

import mlx.core as mx

from meshtune.parallel.mesh import Mesh
from meshtune.training.checkpoint import TrainingState
from meshtune.training.loop import LoopSettings, train
from meshtune.training.metrics import Reporter
from meshtune.training.update import StepVerdict

DEVICE_S = 0.05


class DeviceBusy:
    """A verdict's `ok` whose read waits for the (pretend) device, as `.item()` on a step in flight does."""

    def item(self) -> bool:
        time.sleep(DEVICE_S)
        return True


class DispatchOnly:
    """A strategy whose step returns at once, its work still 'in flight' until its verdict is read."""

    class optimizer:
        learning_rate = 1e-5

    def step(self, batches):
        next(batches)
        return [(mx.array(1.0), mx.array(100))], StepVerdict(ok=DeviceBusy(), norm=mx.array(1.0), tokens=mx.array(100))

    def take_waits(self):
        return {}


def run(tmp_path, steps_per_report):
    settings = LoopSettings(iters=6, steps_per_report=steps_per_report, steps_per_eval=100, save_every=100)
    with Reporter(tmp_path, total_steps=6, log=lambda line: None, show_progress=False) as reporter:
        train(DispatchOnly(), iter(range(100)), settings=settings, seed=0, mesh=Mesh.single(), reporter=reporter,
              start=TrainingState(step=0, data_cursor={}, trained_tokens=0), validate=None,
              save=lambda state: None, cursor=lambda: {})
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_every_window_counts_the_wait_for_its_steps(tmp_path):
    for per_report in (1, 3):
        out = tmp_path / str(per_report)
        records = [r for r in run(out, per_report) if r["type"] == "train"]
        assert len(records) == 6 // per_report
        for r in records:
            # Each step's verdict is read once (the newest at a report, the others one step late): every
            # step's wait is inside some window, so no window runs faster than its steps' device time.
            assert r["steps_per_sec"] <= 1 / DEVICE_S * 1.05, r
