"""Stage-to-stage transfers: send/recv where the backend has them, an all_sum where not.

MLX's NCCL backend (0.32) raises "[nccl] Send not supported" for point-to-point, so on
nccl a transfer is an all_sum over a group of just the two stages: the sender
contributes the tensor and the receiver zeros, and both get the tensor back. That
group is the world when the world is those two ranks; otherwise it comes from
Group.split, which NCCL (unlike ring and JACCL) implements. The all_sum blocks both
sides like a rendezvous send, so the schedules' deadlock proof still holds.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ...runtime.mesh import Mesh

# Backends whose send/recv MLX does not implement.
NO_SEND = frozenset({"nccl"})


class Links:
    """This rank's transfers to the previous and the next stage of its pipeline."""

    def __init__(self, mesh: Mesh, mode: str | None = None) -> None:
        """`mode` "send" or "all_sum"; None picks by the mesh's backend name."""
        self.mesh = mesh
        self.mode = mode or ("all_sum" if mesh.backend in NO_SEND else "send")
        if self.mode not in ("send", "all_sum"):
            raise ValueError(f"pipeline transfer mode {self.mode!r} is not send or all_sum")
        self.pairs: dict[int, Any] = {}  # peer rank -> the two-rank group shared with it
        if self.mode == "all_sum":
            self.pairs = self._pair_groups()

    def _pair_groups(self) -> dict[int, Any]:
        mesh, s, base = self.mesh, self.mesh.pp_rank, self.mesh.dp_rank * self.mesh.pp
        if mesh.world_size == 2:
            return {1 - mesh.rank: mesh.group}
        # Two collective splits: pairs (0,1), (2,3), ... then (1,2), (3,4), ...; colours
        # are per replica so pipelines never share a group.
        even = mesh.group.split(base + s // 2)
        odd = mesh.group.split(base + (s + 1) // 2)
        return {mesh.rank + 1: even if s % 2 == 0 else odd, mesh.rank - 1: odd if s % 2 == 0 else even}

    def send(self, x: mx.array, dst: int) -> mx.array:
        """The (lazy) transfer of `x` to rank `dst`; evaluate it alone."""
        if self.mode == "send":
            return mx.distributed.send(x, dst, group=self.mesh.group)
        return mx.distributed.all_sum(x, group=self.pairs[dst])

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        """The (lazy) tensor rank `src` sends; evaluate it alone."""
        if self.mode == "send":
            return mx.distributed.recv(shape, dtype, src, group=self.mesh.group)
        return mx.distributed.all_sum(mx.zeros(shape, dtype), group=self.pairs[src])
