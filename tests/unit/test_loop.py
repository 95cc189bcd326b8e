"""The training loop with a pretend strategy: what its reports time, and how an allocation failure ends it.

With steps overlapped (runtime.overlap_steps, on by default on a GPU) a step's call returns
once the step is dispatched, and the loop waits for it later, when it reads the verdict.
Here the device is a verdict whose read takes DEVICE_S: the window's seconds must hold it.
"""

import json
import os
import signal
import time

import mlx.core as mx
import pytest

from meshtune.runtime.mesh import Mesh
from meshtune.training.checkpoint import TrainingState
from meshtune.runtime.stop_signals import StopSignals
from meshtune.training.loop import LoopSettings, OutOfMemory, StoppedBeforeTraining, train
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


def run(tmp_path, steps_per_report, strategy=None, saves=None, save_every=100, stop=None, save=None):
    settings = LoopSettings(iters=6, steps_per_report=steps_per_report, steps_per_eval=100, save_every=save_every)
    with Reporter(tmp_path, total_steps=6, log=lambda line: None, show_progress=False) as reporter:
        train(strategy or DispatchOnly(), iter(range(100)), settings=settings, seed=0, mesh=Mesh.single(), reporter=reporter,
              start=TrainingState(step=0, data_cursor={}, trained_tokens=0), validate=None,
              save=save or (lambda state: (saves if saves is not None else []).append(state.step)),
              cursor=lambda: {}, stop=stop or StopSignals())
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


class RunsOutAt(DispatchOnly):
    """A strategy whose step `at` fails as MLX's allocator does (`error`)."""

    def __init__(self, at, error):
        self.calls, self.at, self.error = 0, at, error

    def step(self, batches):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return super().step(batches)


@pytest.mark.parametrize("message", ["cudaMallocAsync(&data, size, stream) failed: out of memory",
                                     "[malloc_or_wait] Unable to allocate 68719476736 bytes.",
                                     "[METAL] Command buffer execution failed: Insufficient Memory"])
def test_an_allocation_failure_is_one_line_naming_the_step_and_nothing_is_saved_after_it(tmp_path, message):
    saves = []
    with pytest.raises(OutOfMemory) as err:
        run(tmp_path, 1, RunsOutAt(5, RuntimeError(message)), saves, save_every=2)
    assert str(err.value).startswith(f"step 5: out of memory ({message})") and "\n" not in str(err.value)
    assert saves == [2, 4]  # the checkpoints before it stand; none after


def test_other_errors_are_not_called_out_of_memory(tmp_path):
    with pytest.raises(RuntimeError, match="shapes do not broadcast"):
        run(tmp_path, 1, RunsOutAt(2, RuntimeError("shapes do not broadcast")))


def test_the_advice_names_the_flags_that_make_a_run_smaller():
    from meshtune.preflight import fitting_advice
    from meshtune.config import Config

    cfg = Config()
    cfg.data.max_seq_length, cfg.train.batch_size = 16384, 4
    advice = fitting_advice(cfg)
    for flag in ("--grad-checkpoint", "--max-seq-length (now 16384)", "--batch-size", "--num-layers (now 16)",
                 "--parallel.pp (now 1)", "meshtune plan"):
        assert flag in advice, (flag, advice)
    cfg.train.grad_checkpoint = True
    assert "--grad-checkpoint" not in fitting_advice(cfg)


class SignalsAt(DispatchOnly):
    """A strategy whose step `at` sends this process SIGINT and SIGTERM, as Ctrl-C and a scheduler would."""

    def __init__(self, at: int):
        self.at, self.done = at, 0

    def step(self, batches):
        self.done += 1
        if self.done == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(batches)


def test_any_number_of_signals_end_the_loop_after_one_save_and_none_interrupts_it(tmp_path):
    """Two signals at step 2 and three more during the save: one save (at step 2), the loop ends stopped, and
    no KeyboardInterrupt is raised from any of them."""
    saves = []

    def save(state):
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):  # Ctrl-C again, mid-write
            os.kill(os.getpid(), sig)
        time.sleep(0.05)  # a handler runs between bytecodes: give it room to (not) interrupt
        saves.append(state.step)

    with StopSignals() as stop:
        records = run(tmp_path, 1, strategy=SignalsAt(2), save=save, stop=stop)
    assert saves == [2] and len(stop.signals) == 5
    assert [r["step"] for r in records if r["type"] == "stop"] == [2]


def test_a_request_before_the_first_step_trains_and_saves_nothing(tmp_path):
    saves = []
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(StoppedBeforeTraining, match=r"\(SIGINT\) during set-up, before step 1: nothing was trained"):
            run(tmp_path, 1, saves=saves, stop=stop)
    assert saves == [] and stop.signals == [signal.SIGINT]


def test_a_stopped_process_ignores_late_signals_until_it_exits():
    """After keep_until_exit a late SIGTERM or SIGINT (a launcher passing on a signal its rank already acted
    on) is ignored, not the old action (a kill): the process ends with its own exit code."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with StopSignals() as stop:
            stop.keep_until_exit()
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in old)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # still here: neither killed this process nor raised
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
