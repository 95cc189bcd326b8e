"""`meshtune launch`: start N local ranks on MLX's ring backend, and fail loudly.

    meshtune launch -n 2 -- meshtune train -c run.yaml
    meshtune launch -n 2 --pin -- python my_script.py

Ranks are started directly (MLX_RANK plus a ring hostfile on 127.0.0.1 that this
module writes), not through `mlx.launch`, whose per-rank output threads busy-poll
(15 CPU-seconds for two ranks idling 10 s, measured with mlx 0.32.4: on a 2-core box
that cost more throughput than the second rank added) and which exits 0 when a rank
fails. Here each rank's output is read by a blocking thread and prefixed `[rank i]`;
when any rank exits non-zero the others are stopped and that exit code is returned.
`--pin` gives rank i its own core (os.sched_setaffinity) and one BLAS thread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Callable


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports that were free a moment ago on 127.0.0.1."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def write_ring_hostfile(n: int, folder: Path, hosts: list[str] | None = None) -> Path:
    """The ring backend's hostfile: one list of "ip:port" per rank (127.0.0.1 unless `hosts`)."""
    path = folder / "hostfile.json"
    ips = hosts or ["127.0.0.1"] * n
    path.write_text(json.dumps([[f"{ip}:{p}"] for ip, p in zip(ips, free_ports(n))]))
    return path


def _pump(rank: int, stream: IO[bytes], out: IO[str]) -> None:
    # readline blocks: no polling, no core spent while the rank is quiet.
    for line in iter(stream.readline, b""):
        out.write(f"[rank {rank}] {line.decode(errors='replace')}")
        out.flush()


def launch_local(n: int, command: list[str], *, pin: bool = False, env: dict[str, str] | None = None,
                 timeout: float | None = None, hosts: list[str] | None = None,
                 wrap: Callable[[int], list[str]] | None = None, out: IO[str] | None = None) -> int:
    """Run `command` as n ring ranks on this machine; the first non-zero exit code, else 0.

    `hosts` gives each rank's IP and `wrap(rank)` a command prefix (e.g. entering a
    network namespace of the shaped-link bed); both default to plain loopback.
    """
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if not command:
        raise ValueError("no command given; e.g. meshtune launch -n 2 -- meshtune train -c run.yaml")
    base = dict(os.environ if env is None else env)
    cores = sorted(os.sched_getaffinity(0)) if pin else []
    with tempfile.TemporaryDirectory(prefix="meshtune-launch-") as tmp:
        hostfile = write_ring_hostfile(n, Path(tmp), hosts) if n > 1 else None
        procs, pumps = [], []
        for rank in range(n):
            rank_env = dict(base, MLX_RANK=str(rank), MLX_WORLD_SIZE=str(n), PYTHONUNBUFFERED="1")
            if hostfile is not None:
                rank_env["MLX_HOSTFILE"] = str(hostfile)
            preexec = None
            if pin and cores:
                core = cores[rank % len(cores)]
                rank_env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
                preexec = (lambda c=core: os.sched_setaffinity(0, {c}))  # noqa: E731
            prefix = wrap(rank) if wrap else []
            proc = subprocess.Popen([*prefix, *command], env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec, start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=_pump, args=(rank, proc.stdout, out or sys.stdout), daemon=True)
            t.start()
            pumps.append(t)
        code = _wait_all(procs, timeout)
        for t in pumps:
            t.join(timeout=5)
    return code


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait_all(procs: list[subprocess.Popen], timeout: float | None) -> int:
    """Wait for every rank; on the first failure (or timeout) stop the rest."""
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"[launch] rank {rank} exited with code {code}; stopping the other ranks", file=sys.stderr)
            _stop(procs)
            return code
        if all(c == 0 for c in codes):
            return 0
        if timeout is not None and time.monotonic() - start > timeout:
            print(f"[launch] ranks still running after {timeout:.0f}s; stopping them", file=sys.stderr)
            _stop(procs)
            return 124
        time.sleep(0.2)  # five wake-ups a second: negligible next to a busy-polling reader


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="meshtune launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-ranks", type=int, required=True, help="Ranks to start on this machine.")
    p.add_argument("--pin", action="store_true", help="One core and one BLAS thread per rank.")
    p.add_argument("--timeout", type=float, default=None, help="Stop all ranks after this many seconds.")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs.")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if command[:1] == ["meshtune"]:
        command = [sys.executable, "-m", "meshtune.cli", *command[1:]]
    preflight(a.num_ranks, command)
    return launch_local(a.num_ranks, command, pin=a.pin, timeout=a.timeout)


def preflight(n: int, command: list[str]) -> None:
    """Check a `meshtune train` command's config for n ranks before any rank starts.

    The layout rules (batch divisible by the data-parallel ranks, pp dividing n, no
    more stages than blocks) need the world size, which only the launcher knows up
    front; without this each rank would load the model first and fail n times.
    """
    if "meshtune.cli" not in command or "train" not in command:
        return
    from .cli import build_parser
    from .config import load_config, parse_override_args

    args, rest = build_parser().parse_known_args(command[command.index("meshtune.cli") + 1:])
    if args.command != "train":
        return
    overrides = parse_override_args(rest)
    if args.resume:
        overrides.append(("output.resume", "true"))
    cfg = load_config(args.config, overrides)
    cfg.validate(world_size=n)
    config = cfg.resolved_model_path() / "config.json"
    if cfg.parallel.pp > 1 and config.is_file():
        model = json.loads(config.read_text())
        blocks = model.get("num_hidden_layers") or (model.get("text_config") or {}).get("num_hidden_layers")
        if isinstance(blocks, int) and cfg.parallel.pp > blocks:
            raise ValueError(f"parallel.pp={cfg.parallel.pp} stages for a model of {blocks} blocks ({config}); "
                             f"use between 1 and {blocks} stages")
