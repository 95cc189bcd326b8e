"""`meshtune train --help` lists every option; `meshtune config` prints YAML that -c takes back unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtune.config import describe_options
from support import ARITH_DATA, ROOT

QUICK = ["--iters", "2", "--train.val_batches", "1", "--steps-per-eval", "100", "--batch-size", "4"]


def test_train_help_lists_every_key_and_the_mlx_lm_flags(cli):
    proc = cli("train", "--help")
    assert proc.returncode == 0, proc.stderr
    for dotted, *_ in describe_options():
        assert f"\n  --{dotted} " in proc.stdout, dotted
    assert "\ntrain: The training loop.\n" in proc.stdout
    assert "  --train.batch_size INT (default 4)\n      Global batch" in proc.stdout
    assert "--learning-rate -> optimizer.learning_rate" in proc.stdout
    assert "--mask-prompt* -> data.mask_prompt" in proc.stdout


@pytest.mark.parametrize("args", [
    ["--data", str(ARITH_DATA), "--learning-rate", "2e-5", "--adapter.keys", "[self_attn.q_proj]", *QUICK],
    ["-c", str(ROOT / "meshtune" / "configs" / "mlx_lm_style.yaml"), *QUICK, "--mask-prompt", "--schedule.warmup", "1"],
], ids=["flags", "mlx-lm-style"])
def test_config_round_trips_and_train_accepts_it(tmp_path, cli, args):
    run = tmp_path / "run"
    first = cli("config", *args, "--adapter-path", str(run))
    assert first.returncode == 0, first.stderr[-2000:]
    path = tmp_path / "resolved.yaml"
    path.write_text(first.stdout)
    again = cli("config", "-c", str(path))
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == first.stdout
    assert "note:" not in first.stdout and "mlx-lm key mapped" not in first.stdout  # notes go to stderr
    proc = cli("train", "-c", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (Path(run) / "adapters.safetensors").exists() and "step 2: train loss" in proc.stdout


def test_bare_config_says_it_is_the_demo_and_data_alone_is_not(cli):
    bare = cli("config")
    assert bare.returncode == 0 and "batch_size: 16" in bare.stdout
    assert "note: no --model/--data/-c given: the embedded tiny model" in bare.stderr
    own = cli("config", "--data", str(ARITH_DATA))
    assert own.returncode == 0 and "batch_size: 4" in own.stdout and "mask_prompt: false" in own.stdout
    assert "learning_rate: 1.0e-05" in own.stdout and "demo" not in own.stderr


def test_config_refuses_what_train_refuses(cli):
    proc = cli("config", "--schedule.name", "cosine_decay", "--schedule.arguments", "[3e-4, 100]",
               "--learning-rate", "5e-5")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "the first argument (initial rate 0.0003) differs from optimizer.learning_rate (5e-05)" in proc.stderr
    trackers = cli("config", "--report-to", "swanlab")
    assert trackers.returncode == 2 and trackers.stdout == ""
    assert "output.report_to: 'swanlab' is not one of tensorboard, wandb" in trackers.stderr
