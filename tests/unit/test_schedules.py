"""Pipeline schedules: complete, ordered, bounded, and deadlock-free under blocking sends."""

from __future__ import annotations

import pytest

from meshtune.parallel.pipeline.schedules import SCHEDULES, Action, build, in_flight, simulate, validate


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_valid_for_many_shapes(name):
    for stages in range(1, 7):
        for micro_batches in range(1, 13):
            schedule = build(name, stages, micro_batches)  # validates: complete, fwd before bwd, no deadlock
            every = list(range(micro_batches))
            assert len(schedule) == stages, (stages, micro_batches)  # validate() passes an empty schedule
            for s, acts in enumerate(schedule):
                mbs = lambda kind: sorted(a.mb for a in acts if a.kind == kind)  # noqa: E731
                assert mbs("fwd") == mbs("bwd") == every, (stages, micro_batches, s)
                # Activations come from the stage before and go to the one after; gradients the other way.
                assert mbs("recv_act") == mbs("send_grad") == ([] if s == 0 else every), (stages, micro_batches, s)
                last = s == stages - 1
                assert mbs("send_act") == mbs("recv_grad") == ([] if last else every), (stages, micro_batches, s)
            simulate(schedule)  # completes under rendezvous sends


def test_1f1b_bounds_activations_by_depth_and_gpipe_does_not():
    stages, mbs = 4, 8
    assert in_flight(build("1f1b", stages, mbs)) == [4, 3, 2, 1]
    assert in_flight(build("gpipe", stages, mbs)) == [8, 8, 8, 8]
    assert in_flight(build("naive", stages, mbs)) == [1, 1, 1, 1]


def test_pipelined_schedules_finish_sooner_than_naive():
    span = {n: max(max(t) for t in simulate(build(n, 4, 8))) for n in SCHEDULES}
    assert span["gpipe"] < span["naive"] and span["1f1b"] < span["naive"]


def test_simulator_catches_the_classic_blocking_1f1b_deadlock():
    # Both stages send before they receive in the steady state: stage 0 sends act(1)
    # while stage 1 sends grad(0); with rendezvous sends neither ever completes.
    a = Action
    stage0 = [a("fwd", 0), a("send_act", 0), a("fwd", 1), a("send_act", 1), a("recv_grad", 0), a("bwd", 0),
              a("recv_grad", 1), a("bwd", 1)]
    stage1 = [a("recv_act", 0), a("fwd", 0), a("bwd", 0), a("send_grad", 0), a("recv_act", 1), a("fwd", 1),
              a("bwd", 1), a("send_grad", 1)]
    with pytest.raises(ValueError, match=r"deadlocks: stage 0 at send_act\(1\), stage 1 at send_grad\(0\)"):
        simulate([stage0, stage1])


def test_validate_rejects_incomplete_or_misordered_stages():
    a = Action
    with pytest.raises(ValueError, match="bwd runs micro-batches"):
        validate([[a("fwd", 0), a("fwd", 1), a("bwd", 0)]], 2)
    with pytest.raises(ValueError, match=r"bwd\(0\) comes before fwd\(0\)"):
        validate([[a("bwd", 0), a("fwd", 0)]], 1)


def test_unknown_schedule_names_the_option():
    with pytest.raises(ValueError, match="parallel.schedule='zigzag'"):
        build("zigzag", 2, 2)
