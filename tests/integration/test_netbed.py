"""The shaped-link bed: two ranks in namespaces all_sum over a rate-limited link."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from meshtune.bench import netbed
from meshtune.parallel.launcher import launch_ranks

# The bed's namespaces have fixed names (mtbed<i>): two beds at once would tear each other down.
pytestmark = pytest.mark.serial


def _usable() -> str | None:
    reason = netbed.available()
    if reason is None:
        name = f"mtbed-probe-{os.getpid()}"  # each test worker its own: two probing at once must not collide
        probe = subprocess.run(["ip", "netns", "add", name], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if probe.returncode != 0:
            reason = "network namespaces are not permitted here"
    return reason


@pytest.mark.skipif(_usable() is not None, reason=str(_usable()))
def test_two_ranks_all_sum_over_the_shaped_link():
    code = ("import mlx.core as mx; g = mx.distributed.init(); "
            "s = mx.distributed.all_sum(mx.full((2**20,), g.rank() + 1.0), group=g); "
            "print('sum', int(s[0].item()), 'of', g.size(), flush=True)")
    log = io.StringIO()
    with netbed.shaped_link(2, rate="1gbit", delay="20us") as bed:
        assert bed.ips == ["10.77.0.1", "10.77.0.2"]
        code_ = launch_ranks(2, [sys.executable, "-c", code], hosts=bed.ips, wrap=bed.wrap, out=log, timeout=120)
    assert code_ == 0, log.getvalue()
    assert "[rank 0] sum 3 of 2" in log.getvalue() and "[rank 1] sum 3 of 2" in log.getvalue()
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mtbed" not in leftover  # torn down


def _tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", dev], capture_output=True, text=True,
                         check=True).stdout
    import json

    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


@pytest.mark.skipif(_usable() is not None, reason=str(_usable()))
def test_two_links_each_carry_a_share_of_the_all_sum():
    """Two shaped links per rank, a subnet each: MLX's ring over both addresses moves about half of a
    16 MB all_sum's bytes over each veth (the kernel cannot route one link's traffic over the other)."""
    code = ("import mlx.core as mx; g = mx.distributed.init(); "
            "s = mx.distributed.all_sum(mx.full((2**22,), g.rank() + 1.0), group=g); "
            "print('sum', int(s[0].item()), 'of', g.size(), flush=True)")
    log = io.StringIO()
    with netbed.shaped_link(2, rate="2gbit", delay="20us", links=2) as bed:
        assert bed.addresses == [["10.77.0.1", "10.77.1.1"], ["10.77.0.2", "10.77.1.2"]]
        before = [_tx_bytes("mtbed0", dev) for dev in ("mtv0", "mtv0l1")]
        code_ = launch_ranks(2, [sys.executable, "-c", code], hosts=bed.addresses, wrap=bed.wrap, out=log,
                             timeout=120)
        sent = [_tx_bytes("mtbed0", dev) - b for dev, b in zip(("mtv0", "mtv0l1"), before)]
    assert code_ == 0, log.getvalue()
    assert "[rank 0] sum 3 of 2" in log.getvalue() and "[rank 1] sum 3 of 2" in log.getvalue()
    total = 4 * 2**22 // 2  # a 2-rank ring all-reduce sends half the buffer each way
    assert all(s > 0.35 * total for s in sent), sent
