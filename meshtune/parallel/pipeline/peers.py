"""Sub-groups for the gradient sums a pipeline stage shares with ranks of other pipelines.

Two sums cross a stage's own pipeline position: its gradients over its data-parallel
replicas (the ranks with the same pp_rank), and a tied table's gradients over the first
and the last stage of every replica. Where the backend implements Group.split (NCCL,
MPI) each sum runs on its own sub-group, made once when the stage is built. MLX's ring
and JACCL backends have no split (nor does an unnamed backend, as far as we know), so
there `pipeline.sum_shared` keeps its one slotted world all_sum instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from ...runtime.mesh import Mesh

# Backends whose Group.split MLX implements.
SPLIT_BACKENDS = frozenset({"nccl", "mpi"})


@dataclass(frozen=True)
class PeerGroups:
    """This rank's sub-groups; None where it has no such peers."""

    replicas: Any
    """The ranks with this rank's pp_rank, ordered by dp_rank (None when dp is 1)."""
    tied: Any
    """The first and the last stage of every replica (None without a tied table, or on a middle stage)."""


def peer_groups(mesh: Mesh, tied: bool) -> PeerGroups | None:
    """Split the world into this rank's peer groups, or None where the backend cannot split.

    Every rank must call this, in the same order: Group.split is a collective.
    """
    if mesh.world_size == 1 or mesh.backend not in SPLIT_BACKENDS:
        return None
    replicas = mesh.group.split(mesh.pp_rank, mesh.dp_rank) if mesh.dp > 1 else None
    tied_group = None
    if tied:
        ends = mesh.pp_rank in (0, mesh.pp - 1)
        # A middle stage still joins the split, under a colour of its own that it never uses.
        sub = mesh.group.split(0 if ends else 1 + mesh.rank, mesh.rank)
        tied_group = sub if ends else None
    return PeerGroups(replicas=replicas, tied=tied_group)


def _all_sum(x: mx.array, group: Any) -> mx.array:
    return mx.distributed.all_sum(x, group=group)


def _sum_on(group: Any, flat: dict[str, mx.array], keys: list[str],
            all_sum: Callable[[mx.array, Any], mx.array]) -> dict[str, mx.array]:
    """`keys` of `flat` summed over `group` in one float32 buffer (as the slotted path does)."""
    if group is None or not keys:
        return {}
    total = all_sum(mx.concatenate([flat[k].reshape(-1).astype(mx.float32) for k in keys]), group)
    out, start = {}, 0
    for k in keys:
        size = flat[k].size
        out[k] = total[start:start + size].reshape(flat[k].shape).astype(flat[k].dtype)
        start += size
    return out


def sum_on_peers(groups: PeerGroups, flat: dict[str, mx.array], tied_keys: list[str],
                 all_sum: Callable[[mx.array, Any], mx.array] | None = None) -> dict[str, mx.array]:
    """This rank's flat gradients summed over its replicas, a tied table's over every copy (`all_sum(x, group)`:
    the backend's by default).

    The tied group holds both copies of every replica, so one sum covers them all; the
    tied keys are therefore left out of the replicas' sum.
    """
    all_sum = all_sum or _all_sum
    tied = set(tied_keys)
    out = dict(flat)
    out.update(_sum_on(groups.replicas, flat, [k for k in flat if k not in tied], all_sum))
    out.update(_sum_on(groups.tied, flat, [k for k in flat if k in tied], all_sum))
    return out
