"""A shaped-link test bed: ranks in Linux network namespaces joined by rate/latency-limited veths.

A Mac cluster talks over Thunderbolt or Ethernet, where communication waits on the link; loopback
hides that. Each rank gets a namespace `mtbed<i>` with one veth per link into a bridge namespace,
every veth's egress shaped with tc netem (rate and delay, e.g. 10 Gb/s and 20 us), so
communication-bound behaviour can be reproduced on one Linux machine. Needs root and iproute2.

    with shaped_link(2, rate="10gbit", delay="20us") as bed:
        launch_ranks(2, cmd, hosts=bed.ips, wrap=bed.wrap)
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator

BRIDGE_NS = "mtbed-br"


def available() -> str | None:
    """None when the bed can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the shaped-link bed needs root (network namespaces and tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "the shaped-link bed needs iproute2 (ip, tc)"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Bed:
    """What launching needs: each rank's addresses (one per link) and the command prefix that enters its
    namespace."""

    addresses: list[list[str]]
    rate: str
    delay: str
    shaping: str

    @property
    def ips(self) -> list[str]:
        """Each rank's address on the first link."""
        return [a[0] for a in self.addresses]

    def wrap(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", f"mtbed{rank}"]


def _rate_bits(rate: str) -> float:
    """tc's rate string ("10gbit", "500mbit", "100kbit", "1000000bit") in bits per second; otherwise a
    ValueError saying how to write it."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    unit = next((u for u in units if rate.endswith(u)), None)
    try:
        bits = float(rate[: -len(unit)]) * units[unit] if unit else math.nan
    except ValueError:
        bits = math.nan
    if math.isfinite(bits) and bits > 0:
        return bits
    raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 1gbit, 10gbit or 500mbit")


def link_spec(spec: str) -> tuple[str, str]:
    """(rate, delay) of `--link RATE[:DELAY]`, checked before any run starts: a bad spelling or a
    machine that cannot build the bed is one line, not a failure after the loopback table."""
    rate, _, delay = spec.partition(":")
    try:
        _rate_bits(rate)
    except ValueError as err:
        raise ValueError(f"--link {spec!r}: {err}") from None
    delay = delay or "20us"
    if not re.fullmatch(r"\d+(\.\d+)?(us|ms|s)", delay):
        raise ValueError(f"--link {spec!r}: delay {delay!r}: give it as tc does, e.g. 20us or 1ms")
    why = available()
    if why:
        raise ValueError(f"--link {spec}: {why}; leave out --link for the loopback table alone")
    return rate, delay


def burst_bytes(rate: str) -> int:
    """tbf's bucket: one ms of the rate, at least 128 KiB.

    A bucket smaller than a 64 KiB GSO segment makes tbf cut every segment into
    MTU-sized packets, which the kernel then handles one by one on the ranks' own
    cores. A NIC's segmentation offload does that work in hardware on a real cluster,
    so the bed should not charge it.
    """
    return int(max(128 * 1024, _rate_bits(rate) / 8 / 1000))


def _shape(ns: str, dev: str, rate: str, delay: str, burst: str) -> str:
    """netem (rate and delay) where the kernel has it, else tbf (rate only); says which."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    try:
        _sh(*tc, "netem", "delay", delay, "rate", rate, "limit", "100000")
        return f"netem rate {rate} delay {delay}"
    except subprocess.CalledProcessError:
        # A sandboxed kernel may lack sch_netem and still have tbf.
        _sh(*tc, "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        return f"tbf rate {rate} burst {burst} bytes (no netem in this kernel: delay {delay} not applied)"


def _teardown(n: int) -> None:
    for name in [BRIDGE_NS, *(f"mtbed{i}" for i in range(n))]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def shaped_link(n: int, *, rate: str = "10gbit", delay: str = "20us", burst: str = "", links: int = 1,
                shared: bool = False) -> Iterator[Bed]:
    """Build the bed for n ranks with `links` shaped links each (`shared`: all their addresses on the first
    link's veth), yield it, and always tear it down.

    Each link has a bridge and a subnet of its own, so the kernel cannot carry one link's traffic over
    another; link j's addresses are 10.77.<j>.<i+1>/24, private to the namespaces. `shared=True` is the
    control: the same addresses, all on one shaped veth per rank (several connections, one link's rate).
    """
    reason = available()
    if reason:
        raise ValueError(reason)
    burst = burst or str(burst_bytes(rate))
    _teardown(n)  # a crashed earlier run may have left namespaces behind
    try:
        _sh("ip", "netns", "add", BRIDGE_NS)
        veths = 1 if shared else links
        for j in range(veths):
            _sh("ip", "-n", BRIDGE_NS, "link", "add", f"br{j}", "type", "bridge")
            _sh("ip", "-n", BRIDGE_NS, "link", "set", f"br{j}", "up")
        addresses = []
        for i in range(n):
            ns = f"mtbed{i}"
            _sh("ip", "netns", "add", ns)
            for j in range(veths):
                own, peer = (f"mtv{i}", f"mtp{i}") if j == 0 else (f"mtv{i}l{j}", f"mtp{i}l{j}")
                _sh("ip", "link", "add", own, "netns", ns, "type", "veth", "peer", "name", peer, "netns", BRIDGE_NS)
                for where, dev in ((ns, own), (BRIDGE_NS, peer)):
                    _sh("ip", "-n", where, "link", "set", dev, "up")
                    # Shape both directions: rank -> bridge and bridge -> rank.
                    shaping = _shape(where, dev, rate, delay, burst)
                _sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "master", f"br{j}")
            for j in range(links):
                _sh("ip", "-n", ns, "addr", "add", f"10.77.{j}.{i + 1}/24", "dev", f"mtv{i}" if shared or j == 0
                    else f"mtv{i}l{j}")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            addresses.append([f"10.77.{j}.{i + 1}" for j in range(links)])
        if links > 1:
            shaping += f", {links} links" + (" sharing one veth (the control)" if shared else " each")
        yield Bed(addresses=addresses, rate=rate, delay=delay, shaping=shaping)
    finally:
        _teardown(n)
