"""Every example of the training split trains each epoch, through `meshtune train`, and a run resumed across
the epoch boundary trains as the uninterrupted run does.

Ten examples in batches of 4: an epoch is two full batches and a last one, which holds the two longest
examples and is completed with the two shortest (data/batches.py). The run saved at step 2 resumes at the
last batch of epoch 0 and goes on through epoch 1, its completed batch included.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from meshtune.data import load_split
from meshtune.data.checks import trained_tokens
from meshtune.training.metrics import read_metrics
from support import TINY_MODEL

ROWS, BATCH, ITERS = 10, 4, 6  # 3 batches an epoch, 2 epochs


def _data(folder: Path) -> Path:
    """Ten examples, each longer than the one before."""
    folder.mkdir()
    rows = [{"prompt": f"Repeat {i} times:", "completion": " ab" * (i + 1)} for i in range(ROWS)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _train(cli, data: Path, out: Path, iters: int, *extra: str):
    proc = cli("train", "--data", str(data), "--batch-size", str(BATCH), "--iters", str(iters), "--save-every", "2",
               "--train.val_batches", "0", "--steps-per-eval", "100", "--train.steps_per_report", "1",
               "--adapter-path", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _steps(run: Path) -> list[tuple]:
    return [(r["step"], r["tokens"], r["loss"]) for r in read_metrics(run) if r["type"] == "train"]


def test_each_epoch_trains_every_example_and_a_resume_across_the_boundary_is_exact(tmp_path, cli):
    from mlx_lm.utils import load_tokenizer

    data = _data(tmp_path / "data")
    reference, run = tmp_path / "reference", tmp_path / "run"
    _train(cli, data, reference, ITERS)
    _train(cli, data, run, 2)
    assert "resumed from step 2" in _train(cli, data, run, ITERS, "--resume").stdout
    assert _steps(run) == _steps(reference) and len(_steps(run)) == ITERS
    ours, theirs = mx.load(str(run / "adapters.safetensors")), mx.load(str(reference / "adapters.safetensors"))
    assert ours.keys() == theirs.keys() and all(mx.array_equal(ours[k], theirs[k]) for k in ours)
    # An epoch's target tokens: every example once, and the two shortest again in the completed batch.
    ds = load_split(data / "train.jsonl", load_tokenizer(TINY_MODEL))
    targets = sorted(trained_tokens(int(n), int(o)) for n, o in zip(ds.lengths, ds.offsets))
    per_epoch = [sum(tokens for _, tokens, _ in _steps(reference)[e * 3:e * 3 + 3]) for e in range(2)]
    assert per_epoch == [sum(targets) + sum(targets[:2])] * 2
