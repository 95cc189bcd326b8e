"""comm_share on MLX's own transport: one step per report window run split, its gradient sums timed.

In process, on a mesh that says two ranks over a group of one (MLX's all_sum is the
identity there, so the sampled path runs whole): the split step's weights equal the
compiled step's, only a window's first step runs split, and the clock gets the sample
once per step. Then two real ranks on the ring backend (`meshtune launch`): every rank
exits 0, reports and metrics.jsonl carry comm_share, and the adapters equal one
process's on the same global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
import pytest

import meshtune.parallel.data_parallel as dp
from meshtune.adapters import apply_adapters, trainable_parameters
from meshtune.parallel.data_parallel import DataParallel
from meshtune.runtime.mesh import Mesh
from support import ROOT, tiny_llama


class Batch(NamedTuple):
    tokens: mx.array
    lengths: mx.array


def _batches(count: int):
    mx.random.seed(11)
    for _ in range(count):
        yield Batch(mx.random.randint(1, 64, (2, 9)).astype(mx.int32), mx.array([[1, 9], [2, 7]], dtype=mx.int32))


def _strategy(mesh: Mesh, sample_comm: bool, accumulation: int = 2) -> DataParallel:
    model = tiny_llama(seed=3)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):  # non-zero B: every adapter parameter gets a gradient
            m.lora_b = mx.full(m.lora_b.shape, 0.01)
    opt = optim.Adam(learning_rate=1e-2)
    return DataParallel(model, opt, mesh, accumulation=accumulation, sync="overlap", bucket_mb=0.001,
                        sample_comm=sample_comm)


def _train(strategy: DataParallel, steps: int, report_every: int) -> list[dict]:
    batches, waits = _batches(steps * strategy.accumulation), []
    for step in range(1, steps + 1):
        strategy.step(batches)
        if step % report_every == 0:
            waits.append(strategy.take_waits())
    return waits


def test_the_sampled_step_matches_the_compiled_one_once_a_window(monkeypatch):
    fake_two = Mesh(group=mx.distributed.init(), world_size=2, rank=0, dp=2, pp=1)
    built, calls = dp.build_sampled_step, []

    def counting(*args, **kwargs):
        sampled = built(*args, **kwargs)

        def call(*a):
            out, comm = sampled(*a)
            calls.append(comm)
            return out, comm
        return call

    monkeypatch.setattr(dp, "build_sampled_step", counting)
    start = trainable_parameters(_strategy(fake_two, sample_comm=False).model)
    whole = _strategy(fake_two, sample_comm=False)
    assert _train(whole, 6, 3) == [{}, {}] and not calls  # without sample_comm the mlx transport measures nothing
    split = _strategy(fake_two, sample_comm=True)
    waits = _train(split, 6, 3)
    assert len(calls) == 2  # steps 1 and 4: the first of each window
    assert [w["comm"] for w in waits] == pytest.approx([3 * c for c in calls])  # sample x steps in the window
    a, b = trainable_parameters(whole.model), trainable_parameters(split.model)
    assert max(mx.abs(a[k] - start[k]).max().item() for k in a) > 1e-3  # the steps moved the weights
    for k in a:
        assert mx.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k


def test_one_process_is_not_sampled(monkeypatch):
    monkeypatch.setattr(dp, "build_sampled_step", None)  # any use of it fails
    single = _strategy(Mesh.single(), sample_comm=True)
    assert single.clock is None and _train(single, 2, 1) == [{}, {}]


STEPS = ["--iters", "4", "--train.steps_per_report", "2", "--steps-per-eval", "4", "--save-every", "4",
         "--train.val_batches", "1", "--optimizer", "sgd", "--learning-rate", "0.01", "--batch-size", "4",
         "--grad-accumulation-steps", "2"]
RANKS_ONLY = ["--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.01"]


def _run(n: int, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    train = ["train", *STEPS, *(RANKS_ONLY if n > 1 else []), "--adapter-path", str(out)]
    full = [*cmd, "launch", "-n", str(n), "--", *cmd, *train] if n > 1 else [*cmd, *train]
    proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(n if n > 1 else 0):
        assert f"[rank {rank}] rank {rank} finished at step 4" in proc.stdout
    return proc


def _train_records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


def test_two_ranks_report_comm_share_and_train_as_one_process(tmp_path):
    many = _run(2, tmp_path / "many")
    for rank in range(2):
        assert f"[rank {rank}] rank {rank} of 2: data-parallel rank {rank} of 2" in many.stdout
    train = _train_records(tmp_path / "many")
    assert [r["step"] for r in train] == [2, 4]
    for rec in train:
        assert 0.0 < rec["comm_share"] <= 1.0
        line = next(l for l in many.stdout.splitlines() if l.startswith(f"[rank 0] step {rec['step']}: train loss"))
        assert line.endswith(f", comm {100 * rec['comm_share']:.1f}%")
    assert "comm share, measured (mean of the reports)" in (tmp_path / "many" / "report.md").read_text()

    _run(1, tmp_path / "one")
    one = _train_records(tmp_path / "one")
    assert all("comm_share" not in r for r in one)
    # Ranks sum in another order than one process (float32 rounding): the tolerances of test_data_parallel.
    assert [r["tokens"] for r in one] == [r["tokens"] for r in train]
    assert train[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5)
    assert train[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-3)
    wa, wb = (mx.load(str(tmp_path / d / "adapters.safetensors")) for d in ("one", "many"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert mx.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k
