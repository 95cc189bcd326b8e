"""meshtune's socket ring all-reduce, as threads on localhost: every rank gets the same sum, over one link
or several (127.0.0.x addresses: each its own connection)."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from meshtune.parallel.socket_ring import BucketPump, SocketRing
from meshtune.runtime.watchdog import EXIT_CODE, HEARTBEAT_ENV, PeerLost


def _rings(n, links=1):
    """n connected rings on `links` loopback addresses each, ports exchanged through a barrier (as the MLX
    all-gather would, once per link)."""
    ports, barrier, rings = [0] * n, threading.Barrier(n), [None] * n
    addresses = [f"127.0.0.{j + 1}" for j in range(links)]

    def make(rank):
        def exchange(port):
            ports[rank] = port
            barrier.wait()
            got = list(ports)
            barrier.wait()  # every rank has read this link's ports before the next link's are written
            return got
        rings[rank] = SocketRing(rank, [addresses] * n, exchange)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(rings)
    return rings


@pytest.mark.parametrize("n, size, links", [(2, 1, 1), (2, 1000, 1), (3, 2, 1), (3, 10007, 1), (4, 5, 1),
                                            (2, 1, 2), (2, 100003, 2), (3, 10007, 3), (4, 5, 2)])
def test_ring_all_sum_is_the_sum_on_every_rank(n, size, links):
    rings = _rings(n, links)
    assert all(r.links == links for r in rings)
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


def test_every_link_carries_a_stripe_of_each_transfer():
    """Two links: each connection moves half of a bucket's bytes (a stripe), not all of it on one."""
    rings = _rings(2, links=2)
    data = np.arange(1 << 15, dtype=np.float32)
    pumps = [BucketPump(r) for r in rings]
    for p in pumps:
        p.submit("b", data.copy())
    for p in pumps:
        assert np.array_equal(dict(p.collect(1))["b"], 2 * data)
    for ring in rings:
        assert [w.sock.getsockname()[0] for w in ring.forward.receivers] == ["127.0.0.1", "127.0.0.2"]
        assert [w.moved for w in ring.forward.senders] == [data.nbytes // 2] * 2
        assert [w.moved for w in ring.forward.receivers] == [data.nbytes // 2] * 2
    for r in rings:
        r.close()


def test_hosts_with_different_link_counts_are_one_line():
    with pytest.raises(ValueError, match=r"the ranks list \[1, 2\] links each"):
        SocketRing(0, [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"]], lambda port: [port, port])


def test_three_ranks_send_half_of_each_sum_each_way_round_the_ring():
    """More than two ranks: half the buffer goes rank -> rank + 1, the other half rank -> rank - 1, so
    both directions of every link carry data; the sum is the same."""
    rings = _rings(3, links=2)
    data = [np.full(30000, r + 1.0, np.float32) for r in range(3)]
    sums = [None] * 3

    def run(r):
        sums[r] = rings[r].all_sum(data[r].copy())

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(np.array_equal(s, np.full(30000, 6.0, np.float32)) for s in sums)
    for ring in rings:
        forward = sum(w.moved for w in ring.forward.senders)
        backward = sum(w.moved for w in ring.backward.senders)
        # Each half: 2 (n - 1) steps of a third of it: 2/3 of 15,000 floats each way.
        assert forward == backward == 2 * 2 * 5000 * 4, (forward, backward)
        assert all(w.moved > 0 for w in ring.backward.senders)  # every link, both ways
    for r in rings:
        r.close()
