"""A non-finite step stops the run on every rank at that step, leaving the last good checkpoint as it was.

The step is forced through the test hook MESHTUNE_TEST_NONFINITE_STEP (training/forced_fault.py,
docs/architecture.md): that step's batches keep no targets, so the real compiled step
divides zero gradients by zero tokens and the global norm is nan; the gate
(training/update.py) must keep the update from landing. Runs are the faults bench's
(meshtune.bench.faultkit.train_args: SGD, global batch 6), checkpoints every 5 steps,
the bad step is 7.
"""

from __future__ import annotations

import hashlib
import re
import subprocess

import pytest

from meshtune.bench.faultkit import CLI, env, train_args
from meshtune.training import NONFINITE_EXIT_CODE

BAD = 7
LINE = re.compile(rf"meshtune: step {BAD}: the global batch has no trainable tokens \(gradient norm is nan\); "
                  r"the update was not applied; last good checkpoint: \S+/checkpoints/0000005 \(resume with --resume\)")


def _train(n: int, out, iters: int, *extra: str, bad: int | None = None, save_every: int = 5,
           hook: str = "MESHTUNE_TEST_NONFINITE_STEP"):
    args = train_args(out, iters=iters, save_every=save_every, extra=extra)
    argv = [*CLI, "launch", "-n", str(n), "--", *CLI, *args] if n > 1 else [*CLI, *args]
    environ = env() | ({hook: str(bad)} if bad else {})
    return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=300)


def _digests(out) -> dict[str, str]:
    """sha256 of the final adapters and of the weight-bearing files of checkpoint 5."""
    files = [out / "adapters.safetensors", *sorted((out / "checkpoints" / "0000005").glob("*.safetensors"))]
    assert len(files) >= 3  # adapters and optimizer state (a pipeline: each stage's)
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.mark.parametrize("ranks, layout", [(1, ()), (2, ()), (2, ("--parallel.pp", "2"))],
                         ids=["one-process", "dp2", "pp2"])
def test_a_non_finite_step_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path, ranks, layout):
    run, reference = tmp_path / "run", tmp_path / "reference"
    proc = _train(ranks, run, 10, *layout, bad=BAD)
    out = proc.stdout + proc.stderr
    assert proc.returncode == NONFINITE_EXIT_CODE == 65, out[-3000:]
    said = [l for l in out.splitlines() if LINE.search(l)]
    assert len(said) == ranks, out[-3000:]  # one line per rank, each naming step 7
    if ranks > 1:
        assert {l.split("]")[0] for l in said} == {"[rank 0", "[rank 1"}, said
    assert "meshtune launch:" not in out  # the launcher adds nothing to the ranks' own lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000005"]
    assert f"step {BAD}: train loss" not in out and "step 6: train loss" in out
    # Bit-identical to a run that simply ended at step 5.
    assert _train(ranks, reference, 5, *layout).returncode == 0
    assert _digests(run) == _digests(reference)
    resumed = _train(ranks, run, 10, *layout, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    both = resumed.stdout + resumed.stderr
    assert "resumed from step 5" in both and "step 10: train loss" in both, both[-3000:]


def test_skip_nonfinite_steps_skips_one_and_keeps_the_weights(tmp_path):
    run = tmp_path / "run"
    proc = _train(1, run, 8, "--train.skip_nonfinite_steps", "1", bad=BAD, save_every=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = (proc.stdout + proc.stderr).replace("\r", "\n")  # progress bars redraw with \r
    skipped = [l for l in out.splitlines() if f"step {BAD}: the global batch has no trainable tokens" in l]
    assert len(skipped) == 1 and "(skipped 1 of train.skip_nonfinite_steps=1)" in skipped[0], out[-2000:]
    assert f"step {BAD}: train loss" not in out and f"step {BAD + 1}: train loss" in out
    ckpt = lambda s, f: (run / "checkpoints" / f"{s:07d}" / f).read_bytes()  # noqa: E731
    for f in ("adapters.safetensors", "optimizer.safetensors"):
        assert ckpt(BAD, f) == ckpt(BAD - 1, f), f  # the skipped step changed nothing
        assert ckpt(BAD + 1, f) != ckpt(BAD, f), f  # the next step trained again
    # A second bad step with no skips left stops the run.
    again = _train(1, tmp_path / "again", 8, bad=BAD, save_every=1)
    assert again.returncode == 65 and f"meshtune: step {BAD}:" in again.stderr


OVERFLOW = re.compile(rf"meshtune: step {BAD}: the update would make non-finite weights or optimizer state "
                      r"\(gradient norm is [0-9.e+-]+\); lower --learning-rate or check the optimizer's settings; "
                      r"the update was not applied; last good checkpoint: \S+/checkpoints/0000005 "
                      r"\(resume with --resume\)")


@pytest.mark.parametrize("ranks, layout", [(1, ()), (2, ()), (2, ("--parallel.pp", "2"))],
                         ids=["one-process", "dp2", "pp2"])
def test_an_update_that_overflows_is_not_applied_on_any_rank(tmp_path, ranks, layout):
    """A finite gradient at an infinite learning rate (the test hook MESHTUNE_TEST_OVERFLOW_STEP): the
    update's own check holds it back on every rank (a pipeline's stages agree), nothing is saved for it,
    and checkpoint 5 and adapters.safetensors stay as a run that ended at step 5 left them."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    proc = _train(ranks, run, 10, *layout, bad=BAD, hook="MESHTUNE_TEST_OVERFLOW_STEP")
    out = proc.stdout + proc.stderr
    assert proc.returncode == NONFINITE_EXIT_CODE, out[-3000:]
    said = [l for l in out.splitlines() if OVERFLOW.search(l)]
    assert len(said) == ranks, out[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000005"]
    assert _train(ranks, reference, 5, *layout).returncode == 0
    assert _digests(run) == _digests(reference)


def test_a_loss_flattened_at_ln_vocab_stops_the_run_unless_told_to_go_on(tmp_path):
    """A learning rate of 1e10 blows the weights up while every step stays finite: the loss sits at
    ln(103) = 4.6347; after train.divergence_reports reports the run stops (exit 65) naming a checkpoint
    from before; --train.divergence_reports 0 trains on to the end (exit 0)."""
    stopped = _train(1, tmp_path / "run", 40, "--learning-rate", "1e10", save_every=1)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == NONFINITE_EXIT_CODE, out[-3000:]
    said = [l for l in out.splitlines() if "training diverged" in l]
    assert len(said) == 1 and "= ln(103), the loss of predicting every token alike, for 5 reports" in said[0], out
    assert "--train.divergence_reports 0" in said[0] and re.search(r"last good checkpoint: \S+/0000001 ", said[0])
    on = _train(1, tmp_path / "on", 40, "--learning-rate", "1e10", "--train.divergence_reports", "0", save_every=40)
    assert on.returncode == 0, on.stdout[-2000:] + on.stderr[-2000:]
