"""Check a hostfile's links before any rank starts: each address is its host's, answers, and has a cable of its own.

MLX's ring (and meshtune's socket ring) has each rank connect to the next rank's addresses, one
connection per address (runtime/hostfile.py). A wrong address makes the ranks wait on a
connection that never comes; two addresses reached through one interface add nothing. So
`meshtune launch --hostfile` first runs `python -m meshtune.parallel.link_check` on every host
over ssh (in parallel): the host binds each address it lists (is it its own?), connects to each
of the next host's addresses on ssh's port 22 (does it answer? a refused connection answers too),
and asks the kernel which local address would carry each (two links leaving from one local
address share an interface). `problems` turns the answers into one line each, naming the host
and the address. Loopback addresses share the loopback interface by design and are not judged
on it. `--no-link-check` skips it all.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
import socket
import subprocess
import sys
import threading
from typing import Any

from ..runtime.hostfile import Hostfile
from .rank_watch import SSH_FAILED

PROBE_PORT = 22  # ssh's: every host of a hostfile run serves it
ANSWER_S = 2.0  # how long a peer address may take to answer
SSH_EXTRA_S = 20.0  # ssh's own connection and the probe's start, on top of the answers


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def own_address(address: str) -> str:
    """"" when this host can bind `address` (it is on one of its interfaces), else why not."""
    try:
        with socket.socket(_family(address), socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as err:
        return err.strerror or str(err)
    return ""


def answers(address: str, timeout: float = ANSWER_S, port: int = PROBE_PORT) -> str:
    """"" when `address` answers on `port` within `timeout` (accepting or refusing), else why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return ""
    except ConnectionRefusedError:
        return ""
    except socket.timeout:
        return f"no answer in {timeout:g} s"
    except OSError as err:
        return err.strerror or str(err)


def source_address(address: str) -> str:
    """The local address the kernel sends from to reach `address` ("" if it has no route); nothing is sent."""
    try:
        with socket.socket(_family(address), socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def probe(own: list[str], peers: list[str], timeout: float = ANSWER_S) -> dict[str, Any]:
    """What one host finds: its own addresses' binds, and per peer address its answer and source address."""
    answered: dict[str, str] = {}
    threads = [threading.Thread(target=lambda a=a: answered.__setitem__(a, answers(a, timeout))) for a in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"own": {a: own_address(a) for a in own}, "answers": answered,
            "source": {a: source_address(a) for a in peers}}


def problems(hostfile: Hostfile, found: list[dict[str, Any]]) -> list[str]:
    """One line per problem in `found` (probe's result per host, in hostfile order; host i probed host i+1)."""
    hosts, n, lines = hostfile.hosts, len(hostfile.hosts), []
    for host, result in zip(hosts, found):
        for address, why in result["own"].items():
            if why:
                lines.append(f"host {host.ssh} cannot use address {address} ({why}): it is not on any of its "
                             "interfaces; list the addresses that host's cables have (ifconfig / ip addr)")
    for i, (host, result) in enumerate(zip(hosts, found)):
        peer = hosts[(i + 1) % n]
        for address, why in result["answers"].items():
            if why:
                lines.append(f"host {host.ssh} cannot reach host {peer.ssh}'s address {address} ({why}); check "
                             f"that cable, or list on every host only the addresses whose cables are connected")
        by_source: dict[str, str] = {}
        for address, source in result["source"].items():
            if not source or ipaddress.ip_address(address).is_loopback:
                continue
            if source in by_source:
                lines.append(f"host {host.ssh} reaches host {peer.ssh}'s addresses {by_source[source]} and {address} "
                             f"both from its address {source} (one interface): two links on one cable add nothing; "
                             "give each cable its own subnet")
            by_source.setdefault(source, address)
    return lines


def probe_command(host: str, own: list[str], peers: list[str], *, cwd: str, python: str,
                  env: dict[str, str]) -> list[str]:
    """`ssh host '...'` running the probe there (same folder and interpreter, as the ranks)."""
    assigns = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH",) if env.get(k))
    args = [python, "-m", "meshtune.parallel.link_check", "--own", *own, "--peers", *peers]
    script = f"cd {shlex.quote(cwd)} && exec env {assigns} {shlex.join(args)}"
    return ["ssh", host, f"sh -c {shlex.quote(script)}"]


def check_links(hostfile: Hostfile, *, cwd: str, python: str, env: dict[str, str]) -> None:
    """Probe every host's links over ssh at once; raise a one-line error for the first problem."""
    hosts, n = hostfile.hosts, len(hostfile.hosts)
    procs = [subprocess.Popen(probe_command(h.ssh, h.ips, hosts[(i + 1) % n].ips, cwd=cwd, python=python, env=env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                              env=env) for i, h in enumerate(hosts)]
    found = []
    for host, proc in zip(hosts, procs):
        try:
            out, err = proc.communicate(timeout=ANSWER_S + SSH_EXTRA_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise ValueError(f"--hostfile {hostfile.path}: host {host.ssh} did not answer the link check over ssh "
                             f"in {ANSWER_S + SSH_EXTRA_S:g} s; check `ssh {host.ssh}` works, or pass "
                             "--no-link-check") from None
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = " ".join((err.strip().splitlines() or ["no output"])[-1].split())
            fix = (f"check that `ssh {host.ssh} true` works without a password prompt" if proc.returncode == SSH_FAILED
                   else f"check that {python} has meshtune on host {host.ssh}, in the same folder")
            raise ValueError(f"--hostfile {hostfile.path}: the link check on host {host.ssh} failed (exit "
                             f"{proc.returncode}: {tail}); {fix}, or pass --no-link-check")
        found.append(json.loads(lines[-1]))
    bad = problems(hostfile, found)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"--hostfile {hostfile.path}: {bad[0]}{more}; --no-link-check starts the ranks anyway")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshtune.parallel.link_check")
    p.add_argument("--own", nargs="*", default=[])
    p.add_argument("--peers", nargs="*", default=[])
    p.add_argument("--timeout", type=float, default=ANSWER_S)
    a = p.parse_args(argv)
    print(json.dumps(probe(a.own, a.peers, a.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
