"""Pipeline schedules as explicit, validated action lists (naive, GPipe, 1F1B).

MLX is lazy and point-to-point on the ring backend blocks: one `mx.eval` holding a
send and an independent recv deadlocked, and a send waits for its receiver once the
socket buffers fill. So a pipeline step is not one graph but, per stage,
a list of actions evaluated in order, and `simulate` proves a schedule cannot
deadlock under the strictest rule: a send completes only when the peer has reached
the matching receive (rendezvous), whatever the message size.

Per micro-batch stage s runs `recv_act`, `fwd`, `send_act` (activations from s-1, to s+1) and
`recv_grad`, `bwd`, `send_grad` (gradients from s+1, to s-1), the messages placed by
`_with_messages`. `idle_fraction` is a schedule's analytic idle share (report.md, `meshtune plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

KINDS = ("fwd", "bwd", "send_act", "recv_act", "send_grad", "recv_grad")


@dataclass(frozen=True)
class Action:
    """One step of one stage: `kind` on micro-batch `mb`."""

    kind: str
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}({self.mb})"


Schedule = list[list[Action]]  # one action list per stage


def _compute_orders(name: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """Each stage's fwd/bwd order under the named policy."""
    orders = []
    for s in range(stages):
        f = [Action("fwd", m) for m in range(micro_batches)]
        b = [Action("bwd", m) for m in range(micro_batches)]
        if name == "naive":  # one micro-batch there and back before the next (mlx-train's)
            order = [a for m in range(micro_batches) for a in (f[m], b[m])]
        elif name == "gpipe":  # all forwards, then backwards in reverse (Huang et al. 2019)
            order = f + b[::-1]
        else:  # 1f1b: warm-up forwards, one forward one backward, drain (PipeDream-Flush)
            warm = min(stages - s - 1, micro_batches)
            order = f[:warm]
            for i in range(micro_batches - warm):
                order += [f[warm + i], b[i]]
            order += b[micro_batches - warm:]
        orders.append(order)
    return orders


# Relative action costs for ordering messages: a stage's backward recomputes its
# forward (meshtune.parallel.pipeline), so it costs about three forwards.
COSTS = {"fwd": 1.0, "bwd": 3.0}


def _with_messages(orders: list[list[Action]]) -> Schedule:
    """Interleave sends and receives into the compute orders without any deadlock.

    An event simulation with COSTS: each compute starts once its stage is free and its
    input has arrived; each output message is one event at the producer's finish time,
    the send on the producer's list and the receive on the consumer's at the same
    point of one global time order. Each stage's list is that order seen from the
    stage, so the earliest pending event always has both its parties waiting on it: no
    blocking send can wait forever. Timing the events (rather than taking turns)
    places each receive where the real stage will reach it, so a stage does not stop
    at a receive while work it could do waits behind it.
    """
    stages = len(orders)
    last = stages - 1
    pc, free = [0] * stages, [0.0] * stages
    arrival: dict[tuple[int, Action], float] = {}  # (stage, recv action) -> time its data is there
    events: list[tuple[float, int, int, list[tuple[int, Action]]]] = []  # (time, priority, seq, entries)
    while any(pc[s] < len(orders[s]) for s in range(stages)):
        best = None
        for s in range(stages):
            if pc[s] >= len(orders[s]):
                continue
            act = orders[s][pc[s]]
            need = (Action("recv_act", act.mb) if act.kind == "fwd" and s > 0 else
                    Action("recv_grad", act.mb) if act.kind == "bwd" and s < last else None)
            if need is not None and (s, need) not in arrival:
                continue
            begin = max(free[s], arrival.get((s, need), 0.0))
            if best is None or begin < best[0]:
                best = (begin, s, act)
        if best is None:
            raise ValueError("compute orders wait on each other (a backward before its forward?)")
        begin, s, act = best
        end = begin + COSTS[act.kind]
        free[s] = end
        pc[s] += 1
        events.append((begin, 1, len(events), [(s, act)]))
        if act.kind == "fwd" and s < last:
            arrival[(s + 1, Action("recv_act", act.mb))] = end
            events.append((end, 0, len(events), [(s, Action("send_act", act.mb)), (s + 1, Action("recv_act", act.mb))]))
        if act.kind == "bwd" and s > 0:
            arrival[(s - 1, Action("recv_grad", act.mb))] = end
            events.append((end, 0, len(events), [(s, Action("send_grad", act.mb)), (s - 1, Action("recv_grad", act.mb))]))
    lists: Schedule = [[] for _ in range(stages)]
    # Messages before computes at the same instant: a compute may start the moment its input lands.
    for _, _, _, entries in sorted(events):
        for stage, action in entries:
            lists[stage].append(action)
    return lists


def naive(stages: int, micro_batches: int) -> Schedule:
    """One micro-batch through the whole pipeline and back before the next."""
    return _with_messages(_compute_orders("naive", stages, micro_batches))


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards in reverse micro-batch order."""
    return _with_messages(_compute_orders("gpipe", stages, micro_batches))


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """Warm-up forwards, then one forward one backward, then drain.

    Stage s keeps at most stages - s micro-batches in flight, so activation memory is
    bounded by the pipeline depth rather than the micro-batch count. (Written as fixed
    per-stage lists with every send before its neighbour's, the steady state deadlocks
    under blocking sends: each stage sends activations down while the next sends
    gradients up. Deriving the messages from one global sequence avoids that.)
    """
    return _with_messages(_compute_orders("1f1b", stages, micro_batches))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}

_PEER = {"send_act": (1, "recv_act"), "send_grad": (-1, "recv_grad"),
         "recv_act": (-1, "send_act"), "recv_grad": (1, "send_grad")}


def simulate(schedule: Schedule) -> list[list[int]]:
    """Run the schedule with rendezvous sends; returns each stage's completion ticks.

    Raises ValueError naming every stage's stuck action on a deadlock.
    """
    stages = len(schedule)
    pc, ticks, tick = [0] * stages, [[] for _ in range(stages)], 0
    while any(pc[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        tick += 1
        for s in range(stages):
            if pc[s] >= len(schedule[s]):
                continue
            act = schedule[s][pc[s]]
            if act.kind in ("fwd", "bwd"):
                pc[s] += 1
                ticks[s].append(tick)
                progressed = True
                continue
            step, match = _PEER[act.kind]
            p = s + step
            if not 0 <= p < stages:
                raise ValueError(f"stage {s}: {act!r} has no peer stage {p}")
            if act.kind.startswith("send") and pc[p] < len(schedule[p]) and schedule[p][pc[p]] == Action(match, act.mb):
                pc[s] += 1
                pc[p] += 1
                ticks[s].append(tick)
                ticks[p].append(tick)
                progressed = True
        if not progressed:
            stuck = ", ".join(f"stage {s} at {schedule[s][pc[s]]!r}" for s in range(stages) if pc[s] < len(schedule[s]))
            raise ValueError(f"schedule deadlocks: {stuck}")
    return ticks


def validate(schedule: Schedule, micro_batches: int) -> None:
    """Every stage runs fwd then bwd of every micro-batch once, and the whole schedule completes."""
    for s, acts in enumerate(schedule):
        for kind in ("fwd", "bwd"):
            seen = sorted(a.mb for a in acts if a.kind == kind)
            if seen != list(range(micro_batches)):
                raise ValueError(f"stage {s}: {kind} runs micro-batches {seen}, expected 0..{micro_batches - 1} once")
        for m in range(micro_batches):
            if acts.index(Action("bwd", m)) < acts.index(Action("fwd", m)):
                raise ValueError(f"stage {s}: bwd({m}) comes before fwd({m})")
    simulate(schedule)


def build(name: str, stages: int, micro_batches: int) -> Schedule:
    """The named schedule, validated."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.schedule={name!r} is not one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"a pipeline needs at least one stage and one micro-batch (got {stages}, {micro_batches})")
    schedule = SCHEDULES[name](stages, micro_batches)
    validate(schedule, micro_batches)
    return schedule


def in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches forwarded but not yet backwarded (activation memory)."""
    peaks = []
    for acts in schedule:
        live = peak = 0
        for a in acts:
            live += (a.kind == "fwd") - (a.kind == "bwd")
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def idle_fraction(schedule: Schedule) -> float:
    """The share of a step a stage idles under `schedule`, analytic: computes timed by
    COSTS, messages free and sent at once, the step as long as the last stage's end."""
    stages = len(schedule)
    pc, clock, sent = [0] * stages, [0.0] * stages, {}
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while pc[s] < len(schedule[s]):
                act = schedule[s][pc[s]]
                if act.kind in COSTS:
                    clock[s] += COSTS[act.kind]
                elif act.kind.startswith("send"):
                    peer = s + 1 if act.kind == "send_act" else s - 1
                    sent[(peer, act.kind.replace("send", "recv"), act.mb)] = clock[s]
                elif (s, act.kind, act.mb) in sent:
                    clock[s] = max(clock[s], sent[(s, act.kind, act.mb)])
                else:
                    break
                pc[s] += 1
                progressed = True
    busy = sum(COSTS.get(a.kind, 0.0) for acts in schedule for a in acts)
    return 1.0 - busy / (stages * max(clock))
