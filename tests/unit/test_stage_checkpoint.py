"""A pipeline's per-stage checkpoints, in one process: each stage saved and resumed on a mesh of its own.

Saving the stages one after another takes the path of hosts with separate disks (the
first stage renames its temp folder, the next moves its files in); the real
multi-process runs in test_pipeline.py take the shared-filesystem path.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from support import tiny_llama
from meshtune.adapters import apply_adapters
from meshtune.training.checkpoint import TrainingState, list_checkpoints, load_checkpoint, verify_checkpoint
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.pipeline.stage import PipelineStage
from meshtune.parallel.pipeline.state import load_stage_checkpoint, resumable_step, save_stages

CONFIG = {"model": {"path": "tiny"}, "train": {"iters": 9}}


def _stage(k: int, keys=None, stage_layers=None) -> tuple[PipelineStage, optim.Optimizer]:
    """Stage k of 2 over the tiny tied model, with Adam state from one update."""
    model = tiny_llama(layers=4, dim=32, vocab=64, seed=0)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=keys, rank=4, scale=10.0, dropout=0.0)
    # Alone in its world: the collectives are identities and the stage still writes as writer k.
    mesh = Mesh(group=None, world_size=1, rank=k, dp=1, pp=2)
    stage = PipelineStage(model, k, 2, mesh, stage_layers=stage_layers)
    opt = optim.Adam(learning_rate=1e-3)
    opt.init(model.trainable_parameters())
    opt.update(model, tree_map(lambda p: mx.ones_like(p) * 0.5, model.trainable_parameters()))
    mx.eval(model.parameters(), opt.state)
    return stage, opt


def _save_both(out, step, stages, keep=0):
    for stage, opt in stages:
        save_stages(out, stage, opt, state=TrainingState(step=step, data_cursor={"position": step}),
                    config=CONFIG, keep=keep)
    return out / "checkpoints" / f"{step:07d}"


def test_each_stage_writes_only_its_own_shard_and_manifest(tmp_path):
    stages = [_stage(0), _stage(1)]
    path = _save_both(tmp_path, 2, stages)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["stage0.optimizer.safetensors", "stage0.safetensors", "stage1.optimizer.safetensors",
                     "stage1.safetensors", "state.stage0.json", "state.stage1.json"]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temp folder left
    for k, (stage, opt) in enumerate(stages):
        manifest = json.loads((path / f"state.stage{k}.json").read_text())
        assert manifest["step"] == 2 and manifest["config"] == CONFIG and manifest["stages"] == 2
        weights = mx.load(str(path / f"stage{k}.safetensors"))
        own = dict(tree_flatten(stage.model.trainable_parameters()))
        assert weights.keys() == own.keys() and all(mx.array_equal(weights[n], own[n]) for n in own)
        slots = mx.load(str(path / f"stage{k}.optimizer.safetensors"))
        assert {n.rsplit(".", 1)[0] for n in slots} - {"step", "learning_rate"} == set(own)
    assert verify_checkpoint(path) is None
    whole = load_checkpoint(path)  # one process reads the shards merged, in its own layout
    assert whole.trainable.keys() == {k for k, _, _ in stages[0][0].all_params}
    assert whole.state.step == 2 and whole.config == CONFIG


def test_stage_resumes_its_own_shard_bit_for_bit(tmp_path):
    stages = [_stage(0), _stage(1)]
    _save_both(tmp_path, 2, stages)
    for stage, opt in stages:
        found = resumable_step(tmp_path, stage, print)
        assert found == (tmp_path / "checkpoints" / "0000002", True)
        ckpt = load_stage_checkpoint(*found, stage)
        own = dict(tree_flatten(stage.model.trainable_parameters()))
        assert ckpt.trainable.keys() == own.keys()
        assert all(mx.array_equal(ckpt.trainable[n], own[n]) for n in own)  # the weights, not only their names
        saved, loaded = dict(tree_flatten(opt.state)), dict(tree_flatten(ckpt.optimizer_state))
        assert saved.keys() == loaded.keys() and all(mx.array_equal(saved[n], loaded[n]) for n in saved)


def test_tied_table_is_written_by_the_first_stage_and_read_by_the_last(tmp_path):
    stages = [_stage(k, keys=["self_attn.q_proj", "model.embed_tokens"]) for k in (0, 1)]
    path = _save_both(tmp_path, 2, stages)
    tied = stages[1][0].tied_keys
    assert tied and all(k in mx.load(str(path / "stage0.safetensors")) for k in tied)
    assert not any(k in mx.load(str(path / "stage1.safetensors")) for k in tied)
    last, opt = stages[1]
    ckpt = load_stage_checkpoint(path, True, last)
    first = dict(tree_flatten(stages[0][0].model.trainable_parameters()))
    assert set(tied) <= set(ckpt.trainable)
    assert all(mx.array_equal(ckpt.trainable[k], first[k]) for k in tied)  # the first stage's table, read by the last
    saved, loaded = dict(tree_flatten(opt.state)), dict(tree_flatten(ckpt.optimizer_state))
    assert saved.keys() == loaded.keys() and all(mx.array_equal(saved[n], loaded[n]) for n in saved)


def test_damaged_shard_is_skipped_once_with_a_line(tmp_path, capsys):
    stages = [_stage(0), _stage(1)]
    _save_both(tmp_path, 2, stages)
    latest = _save_both(tmp_path, 4, stages)
    data = bytearray((latest / "stage1.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (latest / "stage1.safetensors").write_bytes(bytes(data))
    assert resumable_step(tmp_path, stages[0][0], print) == (tmp_path / "checkpoints" / "0000004", True)
    assert capsys.readouterr().out == ""  # stage 0's own shard is intact
    stage1 = Mesh(group=None, world_size=1, rank=0, dp=1, pp=2)  # rank 0 of its world: the one that says it
    stages[1][0].mesh = stage1
    assert resumable_step(tmp_path, stages[1][0], print) == (tmp_path / "checkpoints" / "0000002", True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and str(latest) in lines[0] and "stage1.safetensors does not match its sha256" in lines[0]
    assert "sha256" in verify_checkpoint(latest)  # a single process skips it too


def test_another_split_loads_the_whole_checkpoint_and_takes_its_part(tmp_path):
    path = _save_both(tmp_path, 2, [_stage(0), _stage(1)])
    other, _ = _stage(0, stage_layers=[3, 1])  # blocks 0-2 on the first stage now
    found = resumable_step(tmp_path, other, print)
    assert found == (path, False)
    ckpt = load_stage_checkpoint(*found, other)
    assert any(k.startswith("model.layers.2.") for k in dict(tree_flatten(ckpt.optimizer_state)))
    assert not any(k.startswith("model.layers.3.") for k in dict(tree_flatten(ckpt.optimizer_state)))


def test_keep_last_n_prunes_stage_folders(tmp_path):
    stages = [_stage(0), _stage(1)]
    for step in (2, 4, 6):
        _save_both(tmp_path, step, stages, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["0000004", "0000006"]


@pytest.mark.parametrize("stale", ["state.json", "state.stage1.json"])
def test_resaving_a_step_replaces_the_older_copy(tmp_path, stale):
    stages = [_stage(0), _stage(1)]
    path = _save_both(tmp_path, 2, stages)
    (path / stale).write_text("{}")  # an older, damaged copy of the step
    _save_both(tmp_path, 2, stages)
    assert verify_checkpoint(path) is None and not (path / "state.json").exists()


def test_another_pp_without_every_shard_names_the_option(tmp_path, capsys):
    path = _save_both(tmp_path, 2, [_stage(0), _stage(1)])
    for name in ("stage1.safetensors", "stage1.optimizer.safetensors", "state.stage1.json"):
        (path / name).unlink()  # as on a host that holds only the first stage's files
    model = tiny_llama(layers=4, dim=32, vocab=64, seed=0)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    four = PipelineStage(model, 0, 4, Mesh(group=None, world_size=1, rank=0, dp=1, pp=4))
    assert resumable_step(tmp_path, four, print) is None
    line = capsys.readouterr().out.strip()
    assert "state.stage1.json" in line and "written with parallel.pp=2: resume with --parallel.pp 2" in line
