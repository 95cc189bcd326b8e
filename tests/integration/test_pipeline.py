"""Pipeline parallelism on 2 real ranks matches one process, for every schedule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

from support import ROOT, run_cli, tiny_llama
from meshtune.api import finetune
from meshtune.training.checkpoint import load_checkpoint, verify_checkpoint
from meshtune.config import Config, ConfigError
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.pipeline.p2p import Links
from meshtune.parallel.data_parallel_step import build_step
from meshtune.parallel.pipeline.stage import split_stages
from meshtune.parallel.pipeline.split import balanced_split, check_stage_layers, declared_layers


def test_balanced_split_minimises_the_costliest_stage():
    assert balanced_split([1] * 4, 2) == [2, 2]
    assert balanced_split([1] * 7, 3) == [2, 2, 3] or balanced_split([1] * 7, 3) == [3, 2, 2]
    assert max(balanced_split([1] * 7, 3)) == 3
    # A large embedding (first) and head (last) leave those stages fewer blocks.
    assert balanced_split([1] * 8, 2, first_extra=4) == [2, 6]
    assert balanced_split([1] * 8, 3, first_extra=2, last_extra=2) == [2, 4, 2]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_split([1, 1, 1], 3) == [1, 1, 1]


def test_split_follows_parameter_counts_and_explicit_layers():
    model = tiny_llama(layers=8, dim=32, vocab=512)  # the tied table (16k) is ~1.8 blocks (9k), on both ends
    assert [e - s for s, e in split_stages(model, 2)] == [4, 4]
    assert [e - s for s, e in split_stages(model, 3)] == [2, 4, 2]
    assert split_stages(model, 2, [5, 3]) == [(0, 5), (5, 8)]
    assert [e - s for s, e in split_stages(tiny_llama(layers=8, dim=32, vocab=64), 3)] in ([3, 3, 2], [2, 3, 3])


@pytest.mark.parametrize("stage_layers, stages, match", [
    (None, 5, "parallel.pp=5 stages for a model of 4 blocks"),
    ([4, 0], 2, r"parallel.stage_layers=\[4, 0\]: give 2 block counts"),
    ([1, 1, 2], 2, r"parallel.stage_layers=\[1, 1, 2\]: give 2 block counts"),
    ([2, 3], 2, r"parallel.stage_layers=\[2, 3\] sums to 5 but the model has 4 blocks"),
])
def test_bad_splits_name_the_option(stage_layers, stages, match):
    with pytest.raises(ValueError, match=match):
        check_stage_layers(stage_layers, stages, 4)


def test_declared_layers_reads_each_config_layout(tmp_path):
    def folder(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    assert declared_layers(folder("llama", {"num_hidden_layers": 4, "n_layer": 9})) == 4
    assert declared_layers(folder("gpt2", {"n_layer": 12})) == 12
    assert declared_layers(folder("vlm", {"text_config": {"num_hidden_layers": 28}})) == 28
    assert declared_layers(folder("odd", {"num_hidden_layers": "many"})) is None
    assert declared_layers(folder("list", [4])) is None
    assert declared_layers(tmp_path / "missing") is None
    assert declared_layers(ROOT / "meshtune" / "assets" / "tiny-llama") == 4


def test_config_validate_rejects_stage_layers_that_do_not_fit_pp():
    cfg = Config.from_dict({"parallel": {"pp": 2, "stage_layers": [1, 1, 2]}})
    with pytest.raises(ConfigError, match=r"parallel.stage_layers = \[1, 1, 2\]: give 2 block counts"):
        cfg.validate(world_size=2)
    Config.from_dict({"parallel": {"pp": 2, "stage_layers": [3, 1]}}).validate(world_size=2)


def test_finetune_rejects_a_split_that_does_not_sum_before_loading(tmp_path):
    cfg = Config.from_dict({"parallel": {"pp": 2, "stage_layers": [3, 3]}, "output": {"adapter_path": str(tmp_path)}})
    mesh = Mesh(group=None, world_size=2, rank=0, dp=1, pp=2)  # never reaches a collective
    with pytest.raises(ValueError, match=r"parallel.stage_layers=\[3, 3\] sums to 6 but the model has 4 blocks"):
        finetune(cfg, mesh, log=lambda _: None)


def test_transfers_pick_all_sum_by_backend_name():
    assert Links(Mesh(group=None, world_size=1, rank=0, dp=1, pp=1, backend="ring")).mode == "send"
    assert Links(Mesh(group=None, world_size=2, rank=0, dp=1, pp=2, backend="nccl")).pairs == {1: None}
    with pytest.raises(ValueError, match="transfer mode 'bcast'"):
        Links(Mesh.single(), "bcast")


def _reference(kind="lora"):
    sys.path.insert(0, str(ROOT / "tests"))
    from pp_worker import make_model_and_batch

    model, tokens, lengths = make_model_and_batch(kind)
    opt = optim.SGD(learning_rate=0.1)
    opt.init(model.trainable_parameters())
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=False)
    losses = []
    for _ in range(2):
        ce, n, _ = step.finish(tokens, lengths, None, None)
        mx.eval(model.state, ce, n)
        losses.append(ce.item() / n.item())
    return losses, dict(tree_flatten(model.trainable_parameters()))


def _two_stages(tmp_path, schedule, micro_batches, kind="lora", transfer="send"):
    """Run tests/integration/pp_worker.py on 2 ranks; (losses, rank 0's weights, rank 1's weights)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable,
                           str(ROOT / "tests" / "integration" / "pp_worker.py"), schedule, str(micro_batches), str(tmp_path), kind,
                           transfer],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    per_rank = [json.loads(l.split("LOSSES ", 1)[1]) for l in proc.stdout.splitlines() if "LOSSES " in l]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]  # the worker's all_sum: the same on both ranks
    # Pipeline.step's own sums, before that all_sum: the first stage reports none, the last stage the loss.
    local = {int(l.split("]", 1)[0].rsplit(" ", 1)[1]): json.loads(l.split("LOCAL ", 1)[1])
             for l in proc.stdout.splitlines() if "LOCAL " in l}
    assert sorted(local) == [0, 1], proc.stdout[-2000:]
    assert all(s == [0.0, 0] for s in local[0]), local
    assert [s / n for s, n in local[1]] == pytest.approx(per_rank[0], rel=1e-6) and all(n > 0 for _, n in local[1])
    assert proc.stdout.count(f"TRANSFER {transfer}") == 2
    return per_rank[0], mx.load(str(tmp_path / "rank0.safetensors")), mx.load(str(tmp_path / "rank1.safetensors"))


@pytest.mark.parametrize("schedule, micro_batches, transfer", [
    ("naive", 2, "send"), ("gpipe", 4, "send"), ("1f1b", 4, "send"), ("1f1b", 1, "send"),
    ("1f1b", 4, "all_sum"), ("gpipe", 2, "all_sum"),  # NCCL's path (no send/recv), forced on the ring backend
])
def test_two_stages_match_one_process(tmp_path, schedule, micro_batches, transfer):
    losses, rank0, rank1 = _two_stages(tmp_path, schedule, micro_batches, transfer=transfer)
    want_losses, want = _reference()
    # The pipeline reports the loss before each update, like the reference's step.
    assert losses == pytest.approx(want_losses, rel=1e-5)
    got = {**rank0, **rank1}
    assert got.keys() == want.keys()
    for k in want:
        assert mx.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("kind", ["full", "lora-embed"])
def test_tied_embedding_copies_stay_equal_and_match_one_process(tmp_path, kind):
    # The tiny model ties its head to the embedding: stage 0 looks tokens up in the
    # table, stage 1 multiplies by it; both train a copy and sum their gradients.
    losses, rank0, rank1 = _two_stages(tmp_path, "1f1b", 2, kind)
    want_losses, want = _reference(kind)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    tied = [k for k in want if k.startswith("model.embed_tokens.")]
    assert tied and all(k in rank0 and k in rank1 for k in tied)
    for k in tied:
        assert mx.array_equal(rank0[k], rank1[k]), k  # the two copies are identical, bit for bit
    got = {**rank0, **rank1}
    assert got.keys() == want.keys()
    for k in want:
        assert mx.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("schedule, kind, ranks, pp, extra", [
    ("gpipe", "lora", 2, 2, ()), ("1f1b", "lora", 2, 2, ()), ("1f1b", "dora", 2, 2, ()), ("naive", "full", 2, 2, ()),
    ("1f1b", "lora", 3, 3, ()),  # three stages
    ("1f1b", "lora", 2, 2, ("--parallel.stage_layers", "[3,1]")),  # an uneven split
    ("gpipe", "lora", 2, 2, ("--num-layers", "1")),  # the first stage trains nothing
    ("1f1b", "full", 3, 3, ("--num-layers", "2")),  # nor the first two of three, fully fine-tuned
    ("1f1b", "lora", 4, 2, ("--num-layers", "1")),  # DP2 x PP2 on ring: its empty stages still join the world sum
])
def test_meshtune_train_pipelines_match_one_process(tmp_path, schedule, kind, ranks, pp, extra):
    common = ["--fine-tune-type", kind, *(extra if extra[:1] == ("--num-layers",) else ())]
    pipeline_only = [] if extra[:1] == ("--num-layers",) else list(extra)
    two = _train_both(tmp_path, common, ranks, pp,
                      ["--parallel.schedule", schedule, "--parallel.micro_batches", "4", *pipeline_only])
    assert f"pipeline: {pp} stages, {schedule} schedule, 4 micro-batches" in two.stdout
    if pipeline_only:
        assert "pipeline blocks per stage: 3 [0, 3), 1 [3, 4)" in two.stdout
    for rank in range(ranks):
        assert f"[rank {rank}] rank {rank} finished at step 4" in two.stdout
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    from mlx_lm.utils import load

    from support import TINY_MODEL

    load(str(TINY_MODEL), adapter_path=str(tmp_path / "two"))  # stock mlx-lm loads the assembled adapters


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_with_accumulation_and_clipping_matches_one_process(tmp_path, ranks):
    # Two batches per step (and a norm that clips): the stages add both batches' gradients before the update.
    # On 4 ranks (DP2 x PP2) the second replica adds no squares to the norm, yet runs its all_sum in step.
    _train_both(tmp_path, ["--fine-tune-type", "lora", "--train.grad_accumulation_steps", "2",
                           "--train.max_grad_norm", "0.05", "--batch-size", str(2 * ranks)], ranks, 2,
                ["--parallel.micro_batches", "2"])
    _assert_same_run(tmp_path / "one", tmp_path / "two")


# 4 ranks: DP2 x PP2 on the ring backend (no Group.split). The suite's one run of that layout against one process
# (4 ranks on a 2-core machine are slow: MLX's ring waits by spinning), so it checks the uninterrupted run too.
# DoRA under pipelines is test_meshtune_train_pipelines_match_one_process's 1f1b-dora case.
# Every run here is pinned (meshtune launch --pin: a core and one BLAS thread a rank; the one-process reference as a
# rank of one): 4 spinning ranks on 2 cores took 53 s unpinned, 28 s pinned, and single-threaded stages drift from a
# reference on the machine's BLAS threads past the tolerance Adam allows here (lora_b, 1e-4).
@pytest.mark.parametrize("ranks, damage", [(2, False), (2, True), (4, False)])
def test_resumed_pipeline_equals_an_uninterrupted_one(tmp_path, ranks, damage):
    # Adam, so the optimizer state matters; 4 steps saving every 2, then --resume to 6.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "meshtune.cli"]
    args = ["train", "--train.steps_per_report", "2", "--steps-per-eval", "2", "--save-every", "2",
            "--train.val_batches", "2", "--optimizer", "adam", "--learning-rate", "0.001", "--batch-size", "8"]
    one = [*cli, "launch", "--pin", "-n", "1", "--", *cli, *args]
    two = [*cli, "launch", "--pin", "-n", str(ranks), "--", *cli, *args, "--parallel.pp", "2"]

    def run(command, *more):
        proc = subprocess.run([*command, *more], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    if not damage:
        run(one, "--iters", "6", "--adapter-path", str(tmp_path / "one"))
    run(two, "--iters", "6", "--adapter-path", str(tmp_path / "whole"))
    # The run as if stopped after its step-4 checkpoint: a copy without the step-6 one (a launch fewer than
    # training to 4 separately: ~20 s for 4 ranks on 2 cores). The resume below drops the copy's later reports.
    shutil.copytree(tmp_path / "whole", tmp_path / "parts")
    shutil.rmtree(tmp_path / "parts" / "checkpoints" / "0000006")
    # Each stage's writer wrote its own shard and manifest; nothing was gathered.
    newest = tmp_path / "parts" / "checkpoints" / "0000004"
    assert sorted(p.name for p in newest.iterdir()) == [
        "stage0.optimizer.safetensors", "stage0.safetensors", "stage1.optimizer.safetensors", "stage1.safetensors",
        "state.stage0.json", "state.stage1.json"]
    if damage:  # stage 1's shard of the newest checkpoint: every rank goes back to step 2
        data = bytearray((newest / "stage1.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (newest / "stage1.safetensors").write_bytes(bytes(data))
    if ranks == 2 and not damage:  # one process resumes the stages' checkpoint too, reading every shard
        shutil.copytree(tmp_path / "parts", tmp_path / "single")
        assert "resumed from step 4" in run(one, "--iters", "6", "--resume", "--parallel.pp", "1", "--adapter-path",
                                            str(tmp_path / "single")).stdout
    out = run(two, "--iters", "6", "--resume", "--adapter-path", str(tmp_path / "parts")).stdout
    assert f"resumed from step {2 if damage else 4}" in out
    skipped = [l for l in out.splitlines() if "warning: skipping checkpoint" in l]
    assert len(skipped) == damage, skipped  # said once, by the rank that found it
    if damage:
        assert "[rank 1]" in skipped[0] and "stage1.safetensors does not match its sha256" in skipped[0]
        assert verify_checkpoint(newest) is None  # the resumed run wrote step 4 again
    _assert_same_run(tmp_path / "whole", tmp_path / "parts", exact=True)
    if not damage:  # the pipeline (1F1B, the default; DP2 x PP2 with 4 ranks) trains as one process does
        _assert_same_run(tmp_path / "one", tmp_path / "whole", atol=1e-4)  # Adam's m / sqrt(v) magnifies rounding
    if ranks == 2 and not damage:
        _assert_same_run(tmp_path / "one", tmp_path / "single", atol=1e-4)
        # The stages' shards, read together, are one process's checkpoint.
        one, pipe = (load_checkpoint(tmp_path / r / "checkpoints" / "0000004") for r in ("one", "parts"))
        for a, b in ((one.trainable, pipe.trainable),
                     (dict(tree_flatten(one.optimizer_state)), dict(tree_flatten(pipe.optimizer_state)))):
            assert a.keys() == b.keys()
            for k in a:
                assert mx.allclose(a[k], b[k], rtol=1e-3, atol=1e-4), k
                # atol relative to the tensor's own scale: Adam's v for lora_a is ~1e-6, under the fixed 1e-4.
                scale = mx.abs(a[k]).max().item()
                assert mx.allclose(b[k], a[k], rtol=1e-3, atol=1e-3 * scale), (k, scale)


# One-process runs by their arguments: the pipelines of one configuration (schedules, stage counts,
# splits) share theirs, made once a session.
_ONE_PROCESS: dict[tuple, Path] = {}


def _train_both(tmp_path, common, ranks, pp, pipeline_only):
    """`meshtune train` for 4 steps on one process (tmp_path/one) and on a pipeline (tmp_path/two)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "meshtune.cli"]
    args = ["train", "--iters", "4", "--train.steps_per_report", "2", "--steps-per-eval", "2", "--save-every", "2",
            "--train.val_batches", "2", "--optimizer", "sgd", "--learning-rate", "0.01", "--batch-size", "8", *common]
    if tuple(common) not in _ONE_PROCESS:
        one = subprocess.run([*cli, *args, "--adapter-path", str(tmp_path / "one")], env=env, capture_output=True,
                             text=True, timeout=300)
        assert one.returncode == 0, one.stderr[-2000:]
        _ONE_PROCESS[tuple(common)] = tmp_path / "one"
    else:
        (tmp_path / "one").symlink_to(_ONE_PROCESS[tuple(common)], target_is_directory=True)
    two = subprocess.run([*cli, "launch", "-n", str(ranks), "--", *cli, *args, "--parallel.pp", str(pp),
                          *pipeline_only, "--adapter-path", str(tmp_path / "two")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    return two


def _assert_same_run(a_dir, b_dir, exact=False, atol=1e-5):
    """Same reports (steps, tokens, losses) and final adapters; bit for bit when `exact`."""
    def records(folder):  # the reports (a resumed run has two start records)
        return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if r["type"] != "start"]

    a, b = records(a_dir), records(b_dir)
    assert [(r["type"], r["step"], r["tokens"]) for r in a] == [(r["type"], r["step"], r["tokens"]) for r in b]
    for x, y in zip(a, b):
        key = "loss" if x["type"] == "train" else "val_loss"
        assert y[key] == (x[key] if exact else pytest.approx(x[key], rel=1e-5)), (x, y)
    wa, wb = mx.load(str(a_dir / "adapters.safetensors")), mx.load(str(b_dir / "adapters.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert mx.array_equal(wa[k], wb[k]) if exact else mx.allclose(wa[k], wb[k], rtol=1e-4, atol=atol), k


def test_bench_pipeline_prints_table_and_json():
    proc = run_cli("bench", "pipeline", "--micro-batches", "2", "--iters", "3", "--batch-size", "4", "--repeats", "1",
                   "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gpipe" in proc.stdout and "1f1b" in proc.stdout and "peak GB per rank" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["gpipe_over_naive_m2"] > 0 and result["1f1b_over_naive_m2"] > 0
    assert len(result["peak_gb_1f1b_m2"]) == 2 and result["peak_mem_1f1b_over_gpipe"] > 0
    assert "activation GB per rank" in proc.stdout and "embedded tiny model" in proc.stdout
    acts, peaks = result["act_gb_gpipe_m2"], result["peak_gb_gpipe_m2"]
    assert len(acts) == 2 and all(0 < a < p for a, p in zip(acts, peaks))


def test_bench_pipeline_data_parallel_runs_every_rank():
    # DP2 x PP2: four ranks, each reporting its own peak; the table names the layout.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "bench", "pipeline", "--micro-batches", "2",
                           "--data-parallel", "2", "--iters", "3", "--batch-size", "8", "--repeats", "1", "--json"],
                          env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 stages x 2 data-parallel replicas" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["peak_gb_1f1b_m2"]) == 4 and result["1f1b_over_naive_m2"] > 0
