"""A rank killed (kill -9) or stopped (SIGSTOP) mid-run: everyone exits, one line names it.

Real training processes on the ring backend. Under `meshtune launch` the launcher
sees the lost rank itself (exit status, /proc state T) and says the one line; ranks
started without it (as mlx.launch would start them) name the peer from the heartbeat
files their watchdogs write. Each test checks exit codes, the one line (rank and
step), the time to exit and that no process of the run survives.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from meshtune.bench.faultkit import CLI, FaultRun, env, survivors, train_args
from meshtune.parallel.launcher import write_ring_hostfile
from meshtune.runtime.watchdog import STARTUP_GRACE, lost_peer, peer_still_starting, write_heartbeat

WATCHDOG_S = 6.0
pytestmark = pytest.mark.serial  # each test times the exit after a fault
WHY = {signal.SIGKILL: r"killed by signal 9 \(SIGKILL\)", signal.SIGSTOP: r"stopped \(SIGSTOP\)"}


def test_a_peer_without_a_heartbeat_is_starting_for_the_grace_only(tmp_path):
    write_heartbeat(tmp_path, 0, 0)
    assert peer_still_starting(tmp_path, 2, me=0, idle=7.0, timeout_s=5.0)  # rank 1 still loading
    assert not peer_still_starting(tmp_path, 2, me=0, idle=STARTUP_GRACE * 5.0 + 1, timeout_s=5.0)  # too long
    assert not peer_still_starting(None, 2, me=0, idle=7.0, timeout_s=5.0)  # no side channel: no grace
    write_heartbeat(tmp_path, 1, 0)
    assert not peer_still_starting(tmp_path, 2, me=0, idle=7.0, timeout_s=5.0)  # in its loop: lost means lost


def test_lost_peer_blames_the_first_silent_rank_not_those_that_gave_up(tmp_path):
    import json
    import socket
    import time

    def beat(rank: int, pid: int, step: int, age: float, gave_up: bool = False) -> None:
        record = {"rank": rank, "pid": pid, "host": socket.gethostname(), "step": step,
                  "alive": time.time() - age, "gave_up": gave_up}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))

    dead = 2**22 + 12345  # above the default pid_max: no such process
    write_heartbeat(tmp_path, 0, 9)  # this process: alive and fresh
    beat(1, dead, 7, age=0.1, gave_up=True)  # left because of a peer: not the cause
    beat(2, os.getpid(), 8, age=30)  # alive process, but silent for 30 s
    beat(3, dead, 6, age=40)  # gone, and silent the longest: the cause
    assert lost_peer(tmp_path, 4, me=0, stale_s=2) == (3, 6, "exited")
    (tmp_path / "rank3.json").unlink()
    assert lost_peer(tmp_path, 4, me=0, stale_s=2) == (2, 8, "no heartbeat for 30s")
    assert lost_peer(tmp_path, 2, me=0, stale_s=2) is None  # only rank 1 left, and it gave up


@pytest.mark.parametrize("n, victim, sig, code", [
    (2, 1, signal.SIGKILL, 128 + 9),
    (2, 1, signal.SIGSTOP, 75),
    (3, 2, signal.SIGKILL, 128 + 9),
    (3, 1, signal.SIGSTOP, 75),
])
def test_launcher_names_the_lost_rank_and_stops_the_rest(tmp_path, n, victim, sig, code):
    out = tmp_path / "run"
    run = FaultRun.launch(n, train_args(out, iters=100000, save_every=100000, watchdog_s=WATCHDOG_S))
    try:
        run.wait_for(r"step 5: train loss")
        assert sorted(run.pids) == list(range(n)), run.output()[-2000:]
        run.hurt(victim, sig)
        rc, seconds = run.finish(timeout=60)
    finally:
        if run.proc.poll() is None:
            run.kill()
    text = run.output()
    assert rc == code, text[-3000:]
    said = [re.sub(r"^.*?(?=meshtune launch:|meshtune:)", "", line) for line in run.lines
            if re.search(r"stopped answering|meshtune launch:|meshtune:", line)
            and "meshtune launch: note:" not in line]  # the start's pinning note is not about the fault
    assert len(said) == 1, said  # one message, no per-rank echoes
    others = [r for r in range(n) if r != victim]
    m = re.fullmatch(rf"meshtune launch: rank {victim} stopped answering at step (\d+) \({WHY[sig]}\); (.*)", said[0])
    assert m, said[0]
    assert int(m.group(1)) >= 5
    assert all(str(r) in m.group(2) for r in others), said[0]
    assert "Traceback" not in text and "[ring]" not in text  # the backend's fallout is not shown
    assert seconds < WATCHDOG_S, seconds  # the launcher does not wait for the watchdogs
    assert survivors(str(out)) == []
    assert all(not os.path.exists(f"/proc/{pid}") for pid in run.pids.values())


@pytest.mark.parametrize("n, victim, sig", [(2, 1, signal.SIGSTOP), (3, 2, signal.SIGKILL)])
def test_ranks_without_the_launcher_name_the_lost_peer(tmp_path, n, victim, sig):
    """As under mlx.launch: every survivor exits 75 with one line naming the peer and its step."""
    out = tmp_path / "run"
    hostfile = write_ring_hostfile(n, tmp_path)
    ranks = []
    for rank in range(n):
        environ = dict(env(), MLX_RANK=str(rank), MLX_WORLD_SIZE=str(n), MLX_HOSTFILE=str(hostfile),
                       PYTHONUNBUFFERED="1")
        environ.pop("MESHTUNE_HEARTBEAT_DIR", None)
        ranks.append(FaultRun([*CLI, *train_args(out, iters=100000, save_every=100000, watchdog_s=WATCHDOG_S)],
                              environ))
    try:
        ranks[0].wait_for(r"step 5: train loss")
        ranks[victim].pids[victim] = ranks[victim].proc.pid
        ranks[victim].hurt(victim, sig)
        results = {r: ranks[r].finish(timeout=60) for r in range(n) if r != victim}
    finally:
        for run in ranks:
            if run.proc.poll() is None:
                run.kill()
    why = "exited" if sig == signal.SIGKILL else r"stopped \(SIGSTOP\)"
    for rank, (rc, seconds) in results.items():
        said = [line for line in ranks[rank].lines if "stopped answering" in line]
        assert rc == 75, ranks[rank].output()[-3000:]
        assert len(said) == 1, said
        m = re.match(rf"meshtune: rank {rank}: rank {victim} stopped answering at step (\d+) \({why}", said[0])
        assert m and int(m.group(1)) >= 4, said[0]  # rank 0 saw step 5; a peer is at most one step behind
        assert "Traceback" not in ranks[rank].output()
        # Killed: the backend notices the closed sockets at once; stopped: the watchdog's timeout.
        assert seconds < (3 if sig == signal.SIGKILL else WATCHDOG_S + 4), seconds
    assert survivors(str(out)) == []
