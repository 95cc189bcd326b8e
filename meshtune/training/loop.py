"""The training loop: one strategy step per iteration, periodic eval, reports and saves, top to bottom.

One optimizer step is one call of the parallel strategy (training/strategy.py), whose update equals
one process's on the whole global batch (gradients of the summed token losses over its token count).
Reports are token-weighted over the ranks, with every rank's peak memory and the strategy's waits; a
window closes every `steps_per_report` steps and at every save, so a checkpoint counts what was
reported. The allocator cache is left alone (stock mlx-lm clears it every step, which costs time).
A step whose update was not applied (training/update.py) is skipped with one line while
`skip_nonfinite` allows, else NonFiniteStep; its verdict is read before any report, eval or save, so
nothing is written between a bad step and its discovery.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import mlx.core as mx

from ..runtime.mesh import Mesh
from ..runtime.stop_signals import StopSignals
from .checkpoint import TrainingState
from .divergence import DivergenceWatch
from .metrics import Reporter, Window, report_window
from .strategy import Strategy
from .update import StepVerdict

AGREE_EVERY = 8  # steps between the ranks' agreements on a stop request


class StoppedBeforeTraining(Exception):
    """A stop request came during set-up, before this invocation's first step: nothing was trained or saved
    (exit 128 + the signal's number, as a shell reports a process its signal ended)."""

    def __init__(self, step: int, signum: int, name: str) -> None:
        done = f"step {step}'s checkpoint stands; --resume continues from it" if step else "start it again"
        super().__init__(f"stopped on request ({name}) during set-up, before step {step + 1}: nothing was "
                         f"trained or saved; {done}")
        self.signum = signum


def stop_if_requested(stop: StopSignals, mesh: Mesh, step: int) -> None:
    """Raise StoppedBeforeTraining on every rank if any rank got a stop request (a collective): before the
    first step, a request from set-up ends the run with nothing trained."""
    if mesh.agree(stop.requested):
        raise StoppedBeforeTraining(step, stop.signals[0] if stop.signals else signal.SIGTERM,
                                    stop.name() or "on another rank")


class NonFiniteStep(Exception):
    """A step's update was not applied and no skips were left: the run stops (exit training.NONFINITE_EXIT_CODE)."""

    def __init__(self, step: int, what: str, *, last_good: str = "", applied: bool = False) -> None:
        tail = f"; last good checkpoint: {last_good}" if last_good else ""
        super().__init__(f"step {step}: {what}{'' if applied else '; the update was not applied'}{tail}")
        self.step, self.what = step, what


# How MLX's allocators word running out of memory: CUDA, Metal (a buffer, a command buffer), the CPU.
OUT_OF_MEMORY_WORDS = ("out of memory", "insufficient memory", "unable to allocate", "outofmemory")


class OutOfMemory(Exception):
    """An allocation failed during a step: the run stops with one line (exit training.OUT_OF_MEMORY_EXIT_CODE)."""

    def __init__(self, step: int, what: str, *, advice: str = "", last_good: str = "") -> None:
        tail = (f"; {advice}" if advice else "") + (f"; last checkpoint: {last_good}" if last_good else "")
        super().__init__(f"step {step}: out of memory ({what}){tail}")
        self.step, self.what = step, what


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocator's out-of-memory error (MLX raises RuntimeError)."""
    return isinstance(err, (RuntimeError, MemoryError)) and any(w in str(err).lower() for w in OUT_OF_MEMORY_WORDS)


@contextmanager
def out_of_memory_names_the_step(running: Callable[[], int]) -> Iterator[None]:
    """An allocator's failure inside becomes OutOfMemory naming the step `running()` says; nothing is
    saved after it, so the last checkpoint stands."""
    try:
        yield
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        raise OutOfMemory(running(), str(err).strip().splitlines()[0]) from None


@dataclass(kw_only=True)
class LoopSettings:
    """The loop's schedule, taken from the train config."""

    iters: int
    steps_per_report: int
    steps_per_eval: int
    save_every: int
    skip_nonfinite: int = 0  # bad steps skipped before the next one stops the run


@dataclass(kw_only=True)
class LoopResult:
    step: int
    train_loss: float | None
    val_loss: float | None
    trained_tokens: int
    stopped_early: bool


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of one optimizer step: a resumed run draws the same dropout masks."""
    return (seed * 1_000_003 + step) % 2**63


@dataclass
class _Pending:
    """Steps dispatched whose verdict is not read yet (one stays in flight where steps overlap), and the
    bad steps skipped so far."""

    skip_nonfinite: int
    reporter: Reporter
    steps: list[tuple[int, StepVerdict, list[tuple[Any, Any]]]] = field(default_factory=list)
    skipped: int = 0

    def read(self, window: Window, newest: bool) -> None:
        """Read the verdicts of pending steps (all, or all but the newest, still in flight): an applied
        step's losses go into `window`, a bad one is skipped with a line or raises NonFiniteStep."""
        ready = self.steps[:] if newest else self.steps[:-1]
        del self.steps[:len(ready)]
        for at, verdict, losses in ready:
            if verdict.ok.item():
                for loss_sum, tokens in losses:
                    window.add(loss_sum, tokens)
                window.applied += 1
                continue
            if self.skipped >= self.skip_nonfinite:
                raise NonFiniteStep(at, verdict.describe())
            self.skipped += 1
            self.reporter.note("skip", at, f"step {at}: {verdict.describe()}; the update was not applied "
                               f"(skipped {self.skipped} of train.skip_nonfinite_steps={self.skip_nonfinite})")


def train(strategy: Strategy, batches: Iterator[Any], *, settings: LoopSettings, seed: int, mesh: Mesh,
          reporter: Reporter, start: TrainingState, validate: Callable[[], tuple[float, int]] | None,
          save: Callable[[TrainingState], None], cursor: Callable[[], dict[str, Any]], stop: StopSignals,
          beat: Callable[[int], None] = lambda step: None, watch: DivergenceWatch | None = None) -> LoopResult:
    """Run optimizer steps start.step+1 .. settings.iters; eval, report and save on schedule.

    `stop` records SIGTERM/SIGINT for the whole run (the caller holds it from set-up to the report):
    the first request is agreed, saved and stops the loop; later ones change nothing, so no save is
    ever cut short. A request from set-up, agreed here before any step, trains nothing. `watch` judges
    each reported loss and raises Diverged (training/divergence.py) before that step's save."""
    watch = watch or DivergenceWatch(vocab_size=None, reports=0)
    window, trained_tokens = Window(), start.trained_tokens
    train_loss = val_loss = None
    step, stopping, running = start.step, False, start.step + 1
    pending = _Pending(settings.skip_nonfinite, reporter)  # dispatched, verdict not read

    def run_eval(at: int) -> float:
        tic = time.perf_counter()
        loss, n = validate()
        reporter.eval(at, split="val", loss=loss, tokens=n, seconds=time.perf_counter() - tic)
        return loss

    stop_if_requested(stop, mesh, step)
    if validate is not None and step == 0:
        val_loss = run_eval(0)
    with out_of_memory_names_the_step(lambda: running):
        while step < settings.iters:
            running = step + 1  # the step an allocation failure is reported at
            tic = time.perf_counter()
            mx.random.seed(step_seed(seed, step))
            losses, verdict = strategy.step(batches)
            step += 1
            pending.steps.append((step, verdict, losses))
            beat(step)
            reporter.advance()

            report_now = step % settings.steps_per_report == 0 or step == settings.iters
            eval_now = validate is not None and (step % settings.steps_per_eval == 0 or step == settings.iters)
            # A stop request (SIGTERM/SIGINT on any rank) is agreed every few steps, not
            # every step: each agreement is one more round trip on the link.
            agree_now = mesh.world_size == 1 or step % AGREE_EVERY == 0 or step == settings.iters
            stopping = mesh.agree(stop.requested) if agree_now else False
            save_now = step % settings.save_every == 0 or step == settings.iters or stopping
            pending.read(window, newest=report_now or eval_now or save_now)
            # The step's seconds end here: before a report, an eval or a save the newest step is waited
            # for, so a window's seconds hold all of its steps' device time, not their dispatch alone.
            window.end_step(time.perf_counter() - tic)
            # A save closes the window too, so a checkpoint holds every token trained before it and a
            # resumed run's reports are the uninterrupted run's. A window of skipped steps only is
            # reported with the next.
            if (report_now or save_now) and window.applied:
                train_loss, trained_tokens = report_window(
                    reporter, window, mesh, step, learning_rate=float(strategy.optimizer.learning_rate),
                    trained_tokens=trained_tokens, waited=strategy.take_waits())
                window = Window()
                watch.check(step, train_loss)  # every rank reports the same loss: all stop here together
            if eval_now:
                val_loss = run_eval(step)
            if save_now:
                save(TrainingState(step=step, data_cursor=cursor(), trained_tokens=trained_tokens))
            if stopping:
                mesh.agree(False)  # every rank waits for the writer's save: they exit together
                reporter.note("stop", step, f"stopped at step {step} on request; checkpoint saved")
                break
    return LoopResult(step=step, train_loss=train_loss, val_loss=val_loss,
                      trained_tokens=trained_tokens, stopped_early=stopping)
