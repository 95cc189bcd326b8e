"""mlx.launch's hostfile, as `meshtune launch --hostfile` and `meshtune plan --hostfile` read it.

Plain Python (no MLX): the launcher reads it before any rank starts, the planner to count
ranks and links. Both of mlx.launch's forms are read: a list of hosts, or an object with
"hosts" (and "backend", "envs"). A host is {"ssh": name, "ips": [address, ...]} and, for
JACCL, "rdma": one RDMA device per host (null for itself). Every address of a host is one
link: MLX's ring backend opens a connection on each and stripes every all-reduce across them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXAMPLE = '[{"ssh": "mac1", "ips": ["10.0.0.1"]}, ...]'
JACCL_BACKENDS = ("jaccl", "jaccl-ring")


@dataclass(frozen=True)
class Host:
    """One rank's host: how to reach it over ssh, its link addresses, its RDMA device per peer (JACCL)."""

    ssh: str
    ips: list[str]
    rdma: list[str | list[str] | None] = field(default_factory=list)


@dataclass(frozen=True)
class Hostfile:
    """A hostfile as read: one Host per rank, and the backend and environment it may name."""

    path: Path
    hosts: list[Host]
    backend: str = ""
    envs: list[str] = field(default_factory=list)

    @property
    def links(self) -> int:
        """Links per rank: the addresses every host lists (check_ring makes them equal)."""
        return min(len(h.ips) for h in self.hosts)

    def check_ring(self) -> None:
        """Raise a one-line error where MLX's ring could not use every address as a link."""
        for h in self.hosts:
            seen = {ip for ip in h.ips if h.ips.count(ip) > 1}
            if seen:
                raise ValueError(f"--hostfile {self.path}: host {h.ssh} lists address {sorted(seen)[0]} twice; "
                                 "each address is one link (one cable): list each once")
        counts = {len(h.ips) for h in self.hosts}
        if len(counts) > 1:
            most = max(self.hosts, key=lambda h: len(h.ips))
            least = min(self.hosts, key=lambda h: len(h.ips))
            raise ValueError(f"--hostfile {self.path}: host {most.ssh} lists {len(most.ips)} addresses and host "
                             f"{least.ssh} {len(least.ips)}; MLX's ring needs the same number of links on every "
                             "host: list one address per cable on each")

    def check_jaccl(self, backend: str) -> None:
        """Raise a one-line error where the RDMA devices do not join the ranks as `backend` needs."""
        n = len(self.hosts)
        for i, h in enumerate(self.hosts):
            if len(h.rdma) != n:
                raise ValueError(f'--hostfile {self.path}: host {h.ssh} lists {len(h.rdma)} RDMA devices ("rdma"); '
                                 f"--backend {backend} needs one per host ({n}), null for itself")
            if h.rdma[i] is not None:
                raise ValueError(f'--hostfile {self.path}: host {h.ssh} lists RDMA device {h.rdma[i]!r} for itself; '
                                 f"its own entry (position {i}) must be null")
            peers = ((i - 1) % n, (i + 1) % n) if backend == "jaccl-ring" else range(n)
            missing = [self.hosts[j].ssh for j in peers if j != i and h.rdma[j] is None]
            if missing:
                raise ValueError(f"--hostfile {self.path}: host {h.ssh} lists no RDMA device to {missing[0]}; "
                                 f"--backend {backend} needs one (e.g. \"rdma_en3\")")


def read_hostfile(path: Path) -> Hostfile:
    """The hostfile at `path`, or a one-line error naming it and what to write."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--hostfile {path}: cannot read it as JSON ({' '.join(str(err).split())}); give a "
                         f"list like {EXAMPLE}, one entry per rank") from None
    backend, envs = "", []
    if isinstance(data, dict):
        backend, envs, data = data.get("backend", ""), data.get("envs", []), data.get("hosts")
        if not isinstance(backend, str) or not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
            raise ValueError(f'--hostfile {path}: "backend" must be a name and "envs" a list of "NAME=value"')
    ok = isinstance(data, list) and data and all(_host_ok(h) for h in data)
    if not ok:
        raise ValueError(f'--hostfile {path}: every entry needs "ssh" (a host name) and "ips" (a non-empty list '
                         'of addresses), e.g. [{"ssh": "mac1", "ips": ["10.0.0.1"]}]')
    hosts = [Host(h["ssh"], list(h["ips"]), list(h.get("rdma") or [])) for h in data]
    return Hostfile(Path(path), hosts, backend, list(envs))


def _host_ok(h: Any) -> bool:
    return (isinstance(h, dict) and isinstance(h.get("ssh"), str) and bool(h["ssh"])
            and isinstance(h.get("ips"), list) and bool(h["ips"]) and all(isinstance(ip, str) for ip in h["ips"])
            and isinstance(h.get("rdma", []), list))
