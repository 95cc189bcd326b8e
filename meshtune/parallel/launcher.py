"""Start N ranks (ring, NCCL, JACCL; here or over ssh), and fail loudly and together: `meshtune launch`'s engine.

    meshtune launch -n 2 -- meshtune train -c run.yaml
    meshtune launch --hostfile hosts.json -- meshtune train -c run.yaml   # one rank per host, over ssh
    meshtune launch -n 2 --backend nccl -- meshtune train -c run.yaml     # one rank per GPU of this machine

Ranks are started directly, not through `mlx.launch` (whose output threads busy-poll and which exits 0
when a rank fails: docs/performance.md, "Launcher"): each rank's output is read on a blocking thread
and prefixed `[rank i]`, and rank_watch.py stops them all when one is lost. Local ring ranks are
pinned one a core by default. Every hostfile address is one ring link; NCCL and JACCL ranks get the
environment mlx.launch gives them (docs/parallel/cluster.md, docs/parallel/gpus.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import shlex
from pathlib import Path
from typing import IO, Callable

from ..runtime.hostfile import JACCL_BACKENDS, Host, Hostfile
from .launch_ports import HeldPorts
from ..runtime.relaunch import LAUNCH_ENV
from ..runtime.stop_signals import StopSignals
from ..runtime.watchdog import BACKEND_ERROR, HEARTBEAT_ENV
from .rank_watch import Rank, watch_ranks

BACKENDS = ("ring", "nccl", *JACCL_BACKENDS)


def write_ring_hostfile(n: int, folder: Path, addresses: list[list[str]] | None = None,
                        held: HeldPorts | None = None) -> Path:
    """The ring backend's hostfile: per rank, one "ip:port" per address of `addresses[rank]` (its links;
    127.0.0.1 unless given), each with a port of its own; the ports stay `held` against other launchers
    until it closes (a caller without one holds them only while picking)."""
    path = folder / "hostfile.json"
    links = addresses or [["127.0.0.1"]] * n
    with HeldPorts() as own:
        ports = iter((held or own).take(sum(len(ips) for ips in links)))
    path.write_text(json.dumps([[f"{ip}:{next(ports)}" for ip in ips] for ips in links]))
    return path


def jaccl_env(hostfile: Hostfile, backend: str, held: HeldPorts | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(variables, files: variable -> content) every rank gets for JACCL, as mlx.launch's launch_jaccl gives."""
    with HeldPorts() as own:
        port = (held or own).take(1)[0]
    coordinator = f"{hostfile.hosts[0].ips[0]}:{port}"
    variables = {"MLX_JACCL_COORDINATOR": coordinator, **({"MLX_JACCL_RING": "1"} if backend == "jaccl-ring" else {})}
    return variables, {"MLX_IBV_DEVICES": json.dumps([h.rdma for h in hostfile.hosts])}


# Environment a remote rank gets from this machine (ssh forwards none of it).
FORWARD_ENV = ("PYTHONPATH", "LD_PRELOAD", "MESHTUNE_SYSTEM_BLAS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
               LAUNCH_ENV)
PID_MARK = "meshtune-remote-pid"
HOSTFILE_POLL_S = 5  # how often a remote host's watcher checks whether its rank has ended


def ssh_command(host: str, rank: int, n: int, command: list[str], files: dict[str, str], run_id: str,
                cwd: str, env: dict[str, str], variables: dict[str, str] | None = None) -> list[str]:
    """`ssh host '<script>'` that writes the rank's `files` there (variable -> content: the ring hostfile,
    JACCL's devices), says its pid and execs the rank with each variable naming its file and `variables`
    (the backend's, the hostfile's "envs") set.

    The script runs under `sh -c`, whatever the host's login shell. Same working directory
    and paths on every host, as mlx.launch assumes. The pid
    line lets the launcher kill the remote rank: killing the local ssh alone does not.
    The files are removed there once the rank's process ends, however it ends: a
    watcher in the background polls the pid the rank is exec'd into (the script's `$$`);
    its own command line names only that pid and the files.
    """
    assigns = {k: env[k] for k in FORWARD_ENV if env.get(k)}
    assigns.update(variables or {})
    assigns.update(MLX_RANK=str(rank), MLX_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1")
    write = remove = ""
    remote = {name: f"/tmp/meshtune-{run_id}-rank{rank}" + ("" if name == "MLX_HOSTFILE" else f"-{name.lower()}")
              + ".json" for name in files}
    if files:  # one ring rank needs none
        assigns.update(remote)
        write = "".join(f"printf '%s' {shlex.quote(text)} > {remote[name]} && " for name, text in files.items())
        watcher = f'trap "" HUP; while kill -0 "$0" 2>/dev/null; do sleep {HOSTFILE_POLL_S}; done; rm -f "$@"'
        remove = f"sh -c {shlex.quote(watcher)} $$ {' '.join(remote.values())} </dev/null >/dev/null 2>&1 & "
    script = (f"cd {shlex.quote(cwd)} && {write}echo {PID_MARK} $$ || exit 1; {remove}"
              f"exec env {' '.join(f'{k}={shlex.quote(v)}' for k, v in assigns.items())} {shlex.join(command)}")
    return ["ssh", host, f"sh -c {shlex.quote(script)}"]  # POSIX sh whatever the login shell (csh, fish)


def _pump(rank: Rank, stream: IO[bytes], out: IO[str], muted: threading.Event) -> None:
    # readline blocks: no polling, no core spent while the rank is quiet.
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if not text.endswith("\n"):  # a progress bar's last redraw: end it, or the next line joins it
            text += "\n"
        if rank.host is not None and rank.remote_pid is None and text.startswith(PID_MARK):
            rank.remote_pid = int(text.split()[1])
            continue
        if muted.is_set():  # the launcher has said its one line; the rest is the fallout
            continue
        # "[ring] Socket 4 was closed by the peer" (after a bar redraw), many times; the
        # traceback of the failed collective follows, so everything after it is held too.
        if rank.held or BACKEND_ERROR.search(text):
            rank.held.append(text)
            continue
        out.write(f"[rank {rank.index}] {text}")
        out.flush()


def nccl_env(n: int, env: dict[str, str], held: HeldPorts) -> list[dict[str, str]]:
    """Per rank, what joins n ranks on this machine over NCCL: rank 0's address and port, one GPU each."""
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    port = str(held.take(1)[0])
    return [dict(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=port,
                 CUDA_VISIBLE_DEVICES=visible[i % len(visible)] if visible else str(i)) for i in range(n)]


def check_hosts(n: int, hostfile: Hostfile | None) -> None:
    if hostfile is not None and len(hostfile.hosts) != n:
        raise ValueError(f"-n {n} but the hostfile lists {len(hostfile.hosts)} hosts; give one entry per rank "
                         "or leave -n out")


def launch_ranks(n: int, command: list[str], *, pin: bool = False, env: dict[str, str] | None = None,
                 timeout: float | None = None, hosts: list[str] | list[list[str]] | None = None,
                 wrap: Callable[[int], list[str]] | None = None, out: IO[str] | None = None,
                 hostfile: Hostfile | None = None, err: IO[str] | None = None,
                 backend: str = "ring") -> int:
    """Run `command` as n ranks (ring; nccl on this machine; jaccl over a hostfile); 0, or the failing rank's
    code (see rank_watch.watch_ranks).

    `hosts` gives each rank's IP (or its addresses, one per link) and `wrap(rank)` a command prefix (e.g. entering a
    network namespace of the shaped-link bed); both default to plain loopback.
    `hostfile` (mlx.launch's, one host per rank) starts rank i through `ssh` on its host instead,
    its ring over every address the host lists.
    """
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if not command:
        raise ValueError("no command given; e.g. meshtune launch -n 2 -- meshtune train -c run.yaml")
    check_hosts(n, hostfile)
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend}: meshtune launch starts {', '.join(BACKENDS)} ranks")
    if backend == "nccl" and (hostfile or hosts):
        raise ValueError("--backend nccl: meshtune launch starts NCCL ranks on this machine only; for several "
                         "hosts use mlx.launch --backend nccl --hostfile ...")
    if backend in JACCL_BACKENDS and hostfile is None:
        raise ValueError(f"--backend {backend} joins hosts over RDMA: give --hostfile with each host's \"rdma\" "
                         "devices (mlx.distributed_config writes one)")
    ssh_hosts: list[Host] | None = hostfile.hosts if hostfile else None
    base = dict(os.environ if env is None else env)
    cores = sorted(os.sched_getaffinity(0)) if pin else []
    if backend != "ring":
        base.pop("MLX_HOSTFILE", None)  # an outer ring launcher's; the ranks must not try it
    variables = dict(e.split("=", 1) for e in hostfile.envs if "=" in e) if hostfile else {}
    files: dict[str, str] = {}
    # The ports stay held until the ranks have ended: no launcher started meanwhile picks them (launch_ports.py).
    with tempfile.TemporaryDirectory(prefix="meshtune-launch-") as tmp, HeldPorts() as held:
        per_rank = nccl_env(n, base, held) if backend == "nccl" else [{} for _ in range(n)]
        if backend in JACCL_BACKENDS:
            jaccl_variables, files = jaccl_env(hostfile, backend, held)
            variables.update(jaccl_variables)
        addresses = ([h.ips for h in ssh_hosts] if ssh_hosts else
                     [[ip] if isinstance(ip, str) else list(ip) for ip in hosts] if hosts else None)
        ring = write_ring_hostfile(n, Path(tmp), addresses, held) if n > 1 and backend == "ring" else None
        if ring is not None:
            files = {"MLX_HOSTFILE": ring.read_text()}
        beats = Path(tmp) / "heartbeats"
        beats.mkdir()
        ranks, muted = [], threading.Event()
        # Signals recorded from before the first rank starts: every started rank is then stopped with the rest.
        with StopSignals() as interrupts:
            for i in range(n):
                rank_env = dict(base, MLX_RANK=str(i), MLX_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1",
                                **per_rank[i], **variables)
                rank_env[HEARTBEAT_ENV] = str(beats)
                if ring is not None:
                    rank_env["MLX_HOSTFILE"] = str(ring)
                preexec = None
                if pin and cores and not ssh_hosts:
                    core = cores[i % len(cores)]
                    rank_env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
                    preexec = (lambda c=core: os.sched_setaffinity(0, {c}))  # noqa: E731
                if ssh_hosts:
                    argv = ssh_command(ssh_hosts[i].ssh, i, n, command, files, Path(tmp).name, os.getcwd(), base,
                                       variables)
                else:
                    argv = [*(wrap(i) if wrap else []), *command]
                proc = subprocess.Popen(argv, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=preexec, start_new_session=True)
                rank = Rank(i, proc, host=ssh_hosts[i].ssh if ssh_hosts else None)
                ranks.append(rank)
                rank.pump = threading.Thread(target=_pump, args=(rank, proc.stdout, out or sys.stdout, muted),
                                             daemon=True)
                rank.pump.start()
            code, lost = watch_ranks(ranks, timeout, beats, err or sys.stderr, muted, interrupts.signals)
        for r in ranks:
            r.pump.join(timeout=5)
        if not lost:
            for r in ranks:
                (out or sys.stdout).writelines(f"[rank {r.index}] {line}" for line in r.held)
    return code
