"""A checkpoint, a pipeline stage's shard and the run's adapters are written only when every tensor is finite."""

from __future__ import annotations

import mlx.core as mx
import pytest

from meshtune.training.checkpoint import (NonFiniteValues, TrainingState, list_checkpoints, require_finite,
                                          save_checkpoint, write_stage)

STATE = TrainingState(step=3, data_cursor={"epoch": 0})


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_a_checkpoint_with_a_non_finite_tensor_is_not_written(tmp_path, poison, where):
    good = {"a.lora_a": mx.ones((4, 2)), "a.lora_b": mx.zeros((2, 4))}
    bad = {**good, "a.lora_b": mx.zeros((2, 4)).at[1, 2].add(poison)}
    trainable, optimizer = (bad, {"step": mx.array(3)}) if where == "weights" else (good, {"a": {"m": bad["a.lora_b"]}})
    with pytest.raises(NonFiniteValues, match=r"step 3: the (trained weight a.lora_b|optimizer state a.m) holds nan or inf"):
        save_checkpoint(tmp_path, state=STATE, trainable=trainable, optimizer_state=optimizer, config={})
    assert list_checkpoints(tmp_path) == [] and not (tmp_path / "checkpoints").exists()
    save_checkpoint(tmp_path, state=STATE, trainable=good, optimizer_state={"step": mx.array(3)}, config={})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["0000003"]


def test_a_stage_shard_with_a_non_finite_tensor_is_not_written(tmp_path):
    with pytest.raises(NonFiniteValues, match="the trained weight w holds nan or inf"):
        write_stage(tmp_path / "tmp", 0, state=STATE, trainable={"w": mx.array([1.0, float("nan")])},
                    optimizer_state={}, config={}, layout={"stages": 2, "bounds": [[0, 1], [1, 2]]})
    assert not (tmp_path / "tmp").exists()


def test_integer_tensors_and_finite_ones_pass():
    require_finite(1, {"step": mx.array(7), "w": mx.ones((3,), dtype=mx.bfloat16)}, "the trained weight")
