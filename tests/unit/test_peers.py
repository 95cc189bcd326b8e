"""Pipeline peer sums pick Group.split by backend: pure logic with a fake group."""

from __future__ import annotations

import mlx.core as mx
import pytest

from support import tiny_llama
from meshtune.adapters import apply_adapters
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.pipeline import peers
from meshtune.parallel.pipeline.executor import sum_shared
from meshtune.parallel.pipeline.stage import PipelineStage


class FakeGroup:
    """Records split calls; each sub-group it returns is a FakeGroup named by its colour."""

    def __init__(self, rank: int, size: int, name: str = "world") -> None:
        self._rank, self._size, self.name, self.splits = rank, size, name, []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def split(self, color: int, key: int = -1) -> "FakeGroup":
        self.splits.append((color, key))
        return FakeGroup(key, 2, name=f"colour{color}")


def _mesh(rank: int, dp: int, pp: int, backend: str) -> Mesh:
    return Mesh(group=FakeGroup(rank, dp * pp), world_size=dp * pp, rank=rank, dp=dp, pp=pp, backend=backend)


@pytest.mark.parametrize("backend", ["ring", "jaccl", ""])
def test_backends_without_split_keep_the_world_sum(backend):
    mesh = _mesh(1, 2, 2, backend)
    assert peers.peer_groups(mesh, tied=True) is None
    assert mesh.group.splits == []


@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_split_colours_replicas_by_stage_and_ties_by_ends(backend):
    # DP2 x PP3, rank 4 = replica 1, stage 1 (a middle stage).
    middle = _mesh(4, 2, 3, backend)
    groups = peers.peer_groups(middle, tied=True)
    assert middle.group.splits == [(1, 1), (5, 4)]  # replicas: colour pp_rank, key dp_rank; tied: a colour of its own
    assert groups.replicas.name == "colour1" and groups.tied is None
    last = _mesh(5, 2, 3, backend)  # replica 1, stage 2
    groups = peers.peer_groups(last, tied=True)
    assert last.group.splits == [(2, 1), (0, 5)]
    assert groups.tied.name == "colour0"
    assert peers.peer_groups(_mesh(1, 1, 2, backend), tied=False) == peers.PeerGroups(replicas=None, tied=None)


def test_sum_on_peers_uses_each_sub_group_for_its_keys():
    calls = []

    def fake_all_sum(x, group):
        calls.append((group.name, x.size))
        return x * 2  # two members holding the same values

    groups = peers.PeerGroups(replicas=FakeGroup(0, 2, "replicas"), tied=FakeGroup(0, 2, "tied"))
    flat = {"a": mx.ones((2, 3)), "b": mx.full((4,), 3.0, dtype=mx.bfloat16), "emb": mx.ones((5,))}
    out = peers.sum_on_peers(groups, flat, ["emb"], fake_all_sum)
    assert calls == [("replicas", 10), ("tied", 5)]  # one buffer per group; the tied table only in its own
    assert out["b"].dtype == mx.bfloat16 and mx.array_equal(out["b"], mx.full((4,), 6.0))
    assert mx.array_equal(out["a"], mx.full((2, 3), 2.0)) and mx.array_equal(out["emb"], mx.full((5,), 2.0))


def test_stage_makes_its_groups_once_and_sum_shared_uses_them(monkeypatch):
    calls = []
    monkeypatch.setattr(peers, "_all_sum", lambda x, group: calls.append(group.name) or x * 2)
    model = tiny_llama(layers=4, dim=32, vocab=64)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=["self_attn.q_proj", "model.embed_tokens"],
                   rank=4, scale=10.0, dropout=0.0)
    mesh = _mesh(2, 2, 2, "nccl")  # replica 1, first stage
    stage = PipelineStage(model, mesh.pp_rank, 2, mesh)
    splits = list(mesh.group.splits)
    assert (0, 1) in splits and (0, 2) in splits  # replicas of stage 0; the tied ends
    grads = stage.model.trainable_parameters()
    summed = sum_shared(stage, grads)
    sum_shared(stage, grads)
    assert mesh.group.splits == splits  # no new split per step
    assert calls == ["colour0", "colour0"] * 2
    from mlx.utils import tree_flatten

    for (k, g), (_, s) in zip(tree_flatten(grads), tree_flatten(summed)):
        assert mx.allclose(s, 2 * g), k
