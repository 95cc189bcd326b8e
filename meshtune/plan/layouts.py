"""Candidate layouts for N ranks, the stage split each would use, its bubble and its traffic.

A layout is one process, DP N, PP P or DP x PP for each factorisation of N. The stage
split is the one `meshtune train` makes (parallel/pipeline/split.py's balanced_split over the
blocks' parameter counts with adapters in place, the embedding on the first stage, the
final norm and head on the last; or parallel.stage_layers). The bubble comes from
timing the schedule's own action lists (parallel/pipeline/schedules.py) with its costs
(a backward recomputes the forward: three forwards). Traffic is what each rank sends
per optimizer step: a ring all-reduce sends 2 (n - 1) / n of the buffer; a stage sends
its output forward and its input gradient back for every micro-batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..parallel.pipeline.schedules import build, idle_fraction, in_flight
from ..parallel.pipeline.split import balanced_split, check_stage_layers

_LINK = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(bit/s|bits/s|bit|bps|b/s|B/s|Bps|byte/s|bytes/s)\s*$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text: str) -> float:
    """Link bandwidth in bytes per second from forms like 10gbit, 100mbit, 1Gb/s or 5GB/s."""
    m = _LINK.match(str(text))
    if not m:
        raise ValueError(f"--link {text!r}: give a bandwidth like 10gbit, 100mbit, 40gbit or 5GB/s")
    value, prefix, unit = float(m.group(1)), m.group(2).lower(), m.group(3)
    per_second = value * _PREFIX[prefix]
    in_bytes = unit in ("B/s", "Bps", "byte/s", "bytes/s")
    if per_second <= 0:
        raise ValueError(f"--link {text!r}: the bandwidth must be positive, e.g. 10gbit")
    return per_second if in_bytes else per_second / 8


@dataclass
class Layout:
    """One way to place the run on the ranks."""

    dp: int
    pp: int
    stage_layers: list[int] = field(default_factory=list)
    micro_batches: int = 1
    problem: str = ""
    """Why `meshtune train` would refuse this layout ("" when it runs)."""

    @property
    def ranks(self) -> int:
        return self.dp * self.pp

    @property
    def name(self) -> str:
        if self.ranks == 1:
            return "1 process"
        if self.pp == 1:
            return f"DP {self.dp}"
        return f"PP {self.pp}" if self.dp == 1 else f"DP {self.dp} x PP {self.pp}"


def candidates(ranks: int, *, batch_size: int, blocks: int, micro_batches: int, stage_layers: list[int] | None,
               block_costs: list[float], first_extra: float, last_extra: float, grad_checkpoint: bool,
               transport: str) -> list[Layout]:
    """One process, then every dp x pp = ranks (pp from 1 up), each with its split and what would stop it."""
    shapes = [(1, 1)] + [(ranks // pp, pp) for pp in range(1, ranks + 1) if ranks % pp == 0 and ranks > 1]
    out = []
    for dp, pp in shapes:
        layout = Layout(dp, pp, micro_batches=(micro_batches or pp) if pp > 1 else 1)
        if pp > blocks:
            layout.problem = f"{pp} stages for {blocks} blocks"
            out.append(layout)
            continue
        if stage_layers is not None and len(stage_layers) == pp and pp > 1:
            check_stage_layers(stage_layers, pp, blocks)
            layout.stage_layers = list(stage_layers)
        else:
            layout.stage_layers = balanced_split(block_costs, pp, first_extra, last_extra) if pp > 1 else [blocks]
        local = batch_size // dp
        if batch_size % dp:
            layout.problem = f"--batch-size {batch_size} is not divisible by dp {dp}"
        elif pp > 1 and local % layout.micro_batches:
            layout.problem = f"--parallel.micro_batches {layout.micro_batches} does not divide the local batch {local}"
        elif pp > 1 and grad_checkpoint:
            layout.problem = "a pipeline refuses train.grad_checkpoint (it recomputes); --train.grad_checkpoint false"
        elif pp > 1 and transport == "sockets" and ranks > 1:
            layout.problem = "--parallel.transport sockets carries data-parallel gradients only"
        out.append(layout)
    return out


def bubble(schedule: str, stages: int, micro_batches: int) -> float:
    """Idle fraction of a stage over one batch, from the schedule's own action lists (as report.md gives it)."""
    return 0.0 if stages == 1 else idle_fraction(build(schedule, stages, micro_batches))


def micro_in_flight(schedule: str, stages: int, micro_batches: int) -> list[int]:
    """Per stage, the most micro-batches whose input is kept between forward and backward."""
    return in_flight(build(schedule, stages, micro_batches)) if stages > 1 else [1]


def ring_allreduce_bytes(buffer: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `buffer` bytes."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * buffer
