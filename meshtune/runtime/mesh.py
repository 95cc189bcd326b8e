"""The parallel layout as a value: world group, (dp, pp) coordinates, collectives.

Built once at the entry point and passed down (nothing below the entry point calls
`mx.distributed.init()`). MLX collectives are no-ops on a group of size 1, so one
code path serves a single process and N ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import os

import mlx.core as mx


def launcher_backend() -> str:
    """The backend `mx.distributed.init()` joined, read from the launcher's environment.

    MLX's Group does not say which backend it runs on; mlx.launch sets NCCL_HOST_IP for
    nccl and MLX_HOSTFILE for ring (as does meshtune launch). "" when neither is set.
    """
    if os.environ.get("NCCL_HOST_IP"):
        return "nccl"
    if os.environ.get("MLX_IBV_DEVICES") or os.environ.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    return "ring" if os.environ.get("MLX_HOSTFILE") else ""


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Where this process sits: `rank` of `world_size`, laid out as dp x pp."""

    group: Any
    world_size: int
    rank: int
    dp: int
    pp: int
    backend: str = ""
    """Distributed backend name (ring, nccl, jaccl, mpi); "" for one process or unknown."""

    @classmethod
    def single(cls) -> "Mesh":
        """A one-process mesh (no distributed backend needed)."""
        return cls(group=None, world_size=1, rank=0, dp=1, pp=1)

    @classmethod
    def from_world(cls, group: Any = None, *, pp: int = 1, backend: str | None = None) -> "Mesh":
        """A mesh over `group` (default: `mx.distributed.init()`), pp stages x dp replicas.

        `backend` names the group's backend; None reads it from the launcher's environment.
        """
        group = mx.distributed.init() if group is None else group
        size = group.size()
        if pp < 1 or size % pp:
            raise ValueError(
                f"parallel.pp={pp} does not divide the world size {size}; "
                "choose pp so that dp * pp == number of ranks"
            )
        return cls(group=group, world_size=size, rank=group.rank(), dp=size // pp, pp=pp,
                   backend=launcher_backend() if backend is None else backend)

    # Pipelines are contiguous ranks (rank = dp_rank * pp + pp_rank): the ring backend
    # sends only to ring neighbours, and a stage talks to stages s - 1 and s + 1.
    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which pipeline it is in)."""
        return self.rank // self.pp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.rank % self.pp

    @property
    def is_writer(self) -> bool:
        """Only one rank writes files (rank 0)."""
        return self.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        """Sum over the world; identity on one process."""
        if self.world_size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group)

    def _host_stream(self) -> Any:
        """Where a small host-read collective runs: NCCL reduces only on the GPU (its default
        stream), ring and JACCL only on the CPU."""
        return None if self.backend == "nccl" else mx.cpu

    def all_rows(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (as many on every rank), by rank: one world all_sum over a row per rank."""
        if self.world_size == 1:
            return [list(values)]
        slots = mx.zeros((self.world_size, len(values)), mx.int32)
        slots[self.rank] = mx.array(values, mx.int32)
        return mx.distributed.all_sum(slots, group=self.group, stream=self._host_stream()).tolist()

    def all_ints(self, value: int) -> list[int]:
        """Every rank's `value`, by rank (any backend)."""
        return [row[0] for row in self.all_rows([value])]

    def disagreeing(self, values: dict[str, int]) -> list[str]:
        """The names in `values` (the same names on every rank) whose value differs between ranks."""
        names = sorted(values)
        rows = self.all_rows([values[name] for name in names])
        return [name for j, name in enumerate(names) if len({row[j] for row in rows}) > 1]

    def agree(self, flag: bool) -> bool:
        """True when any rank says True (ranks stop or save together)."""
        if self.world_size == 1:
            return flag
        total = mx.distributed.all_sum(mx.array(int(flag)), group=self.group, stream=self._host_stream())
        return total.item() > 0
