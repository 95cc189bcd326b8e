"""meshtune's socket ring all-reduce, as threads on localhost: every rank gets the same sum."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from meshtune.parallel.socket_ring import BucketPump, SocketRing
from meshtune.runtime.watchdog import EXIT_CODE, HEARTBEAT_ENV, PeerLost


def _rings(n):
    """n connected rings on 127.0.0.1, ports exchanged through a barrier (as the MLX all-gather would)."""
    ports, barrier, rings = [0] * n, threading.Barrier(n), [None] * n

    def make(rank):
        def exchange(port):
            ports[rank] = port
            barrier.wait()
            return list(ports)
        rings[rank] = SocketRing(rank, ["127.0.0.1"] * n, exchange)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(rings)
    return rings


@pytest.mark.parametrize("n, size", [(2, 1), (2, 1000), (3, 2), (3, 10007), (4, 5)])
def test_ring_all_sum_is_the_sum_on_every_rank(n, size):
    rings = _rings(n)
    data = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(n)]
    want = np.sum(data, axis=0, dtype=np.float64)
    pumps = [BucketPump(r) for r in rings]
    for _ in range(2):  # twice: the connections are reused
        for p, d in zip(pumps, data):
            p.submit("b", d.copy())
        got = [dict(p.collect(1))["b"] for p in pumps]
        for g in got:  # one float32 sum, the same bits on every rank (a rank's weights must not drift)
            assert np.allclose(g, want, rtol=1e-5, atol=1e-5) and np.array_equal(g, got[0])
    for r in rings:
        r.close()


def test_a_stopped_peer_is_an_error_not_a_hang():
    rings = _rings(2)
    rings[1].close()
    pump = BucketPump(rings[0])
    pump.submit("b", np.ones(1 << 16, np.float32))
    with pytest.raises(PeerLost, match="stopped|failed"):
        list(pump.collect(1))


def test_a_lost_socket_peer_is_the_watchdog_s_one_line_and_exit_75(tmp_path):
    """As a backend's failed collective: the rank says one line naming the cause and exits 75 (resumable),
    not 1 with a traceback, so the launcher and a retry script read it as a lost peer."""
    code = ("from meshtune.runtime.watchdog import PeerLost, Watchdog\n"
            "with Watchdog(30.0, 0, 2, None):\n"
            "    raise PeerLost('a peer closed its gradient socket (its rank has stopped)')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != HEARTBEAT_ENV})
    assert proc.returncode == EXIT_CODE == 75, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "a peer closed its gradient socket" in lines[0] and "exiting with 75" in lines[0], lines
