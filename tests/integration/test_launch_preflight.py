"""meshtune launch checks a `meshtune train` command's layout for its rank count before any rank
starts, on the config the ranks will read: the checkpoint's on --resume, the demo's when bare."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshtune.bench.faultkit import CLI, env
from meshtune.cli.launch import preflight

TRAIN = [sys.executable, "-m", "meshtune.cli", "train"]


def test_a_bare_train_is_checked_on_the_demo_s_batch():
    preflight(8, [*TRAIN, "--iters", "2"])  # the demo's batch of 16 divides over 8 ranks
    with pytest.raises(ValueError, match="train.batch_size = 16: must be divisible by the 3 data-parallel"):
        preflight(3, [*TRAIN, "--iters", "2"])


def test_a_resumed_run_is_checked_on_its_own_settings_and_told_which_rank_counts_run_it(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([*CLI, "train", "--iters", "2", "--batch-size", "6", "--save-every", "2",
                           "--val-batches", "0", "--adapter-path", str(run)], env=env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    resume = [*TRAIN, "--adapter-path", str(run), "--resume", "--iters", "4"]
    preflight(3, resume)  # the checkpoint's batch of 6, not the default 4
    with pytest.raises(ValueError) as err:
        preflight(4, resume)
    assert "train.batch_size = 6" in str(err.value)
    assert "a resumed run keeps its own settings, so give -n N, N one of [1, 2, 3, 6] instead" in str(err.value)
    with pytest.raises(ValueError) as err:  # a layout flag of this launch: its own error, no -n hint
        preflight(2, [*resume, "--parallel.pp", "2", "--parallel.micro_batches", "4"])
    assert "parallel.micro_batches" in str(err.value) and "a resumed run keeps" not in str(err.value)


@pytest.mark.parametrize("flags, says", [
    (["--parallel.pp", "2", "--parallel.stage_layers", "[3, 3]"],
     r"parallel.stage_layers=\[3, 3\] sums to 6 but the model has 4 blocks.*config.json"),
    (["--parallel.pp", "2", "--parallel.transport", "sockets"], "parallel.transport=sockets carries data-parallel"),
    (["--parallel.pp", "8"], "parallel.pp=8 stages for a model of 4 blocks"),
])
def test_a_pipeline_layout_the_model_cannot_take_is_refused_once_before_any_rank(flags, says):
    with pytest.raises(ValueError, match=says):
        preflight(8 if "8" in flags else 2, [*TRAIN, "--iters", "2", "--batch-size", "8", *flags])
