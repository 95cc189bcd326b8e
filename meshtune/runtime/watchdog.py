"""Turns a hung collective or a lost peer into a clean exit that names the lost rank.

When a rank is killed, stopped or cut off its peers block in a collective that never returns (MLX
has no timeout there; mlx issue 4475). A watchdog thread on every rank expects a heartbeat from the
loop; after `timeout_s` without one it prints one line and exits with EXIT_CODE (a peer still loading
is waited for up to STARTUP_GRACE timeouts). To name the lost peer the thread also writes
`rank<i>.json` (pid, host, step, time) into the run's heartbeat folder every `interval`, even while
its loop is blocked: a peer whose file went stale, or whose local process is gone or stopped, is the
one. A backend error from a closed connection becomes the same line and exit 75. docs/reliability.md,
"When a rank is lost", says what a user sees.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..run_dir import RunDir, heartbeat_file, heartbeat_temp

EXIT_CODE = 75  # EX_TEMPFAIL: the run can be resumed from its last checkpoint
HEARTBEAT_ENV = "MESHTUNE_HEARTBEAT_DIR"
# How MLX's distributed backends word a failed collective (e.g. "[ring] connection to a peer was lost").
# No space required after the tag: the ring backend's threads write to stderr at once,
# so lines interleave, e.g. "[ring]3  Sending to socketwas closed by the peer" or
# "was closed by the peer[ring]".
BACKEND_ERROR = re.compile(r"\[(ring|jaccl|mpi|nccl)\]")


class PeerLost(ConnectionError):
    """A peer's connection went away under a transport meshtune runs itself (the socket ring): the
    watchdog makes it the one line and exit 75, as it does a backend's failed collective."""


# A peer with no heartbeat yet is still loading (model, data), not lost: before this rank's first
# beat, the watchdog waits for such a peer up to this many timeouts (ranks start unevenly on a busy host).
STARTUP_GRACE = 6


def heartbeat_folder(adapter_path: Path) -> Path:
    """Where this run's ranks exchange heartbeats: the launcher's folder, else one in the run."""
    given = os.environ.get(HEARTBEAT_ENV)
    return Path(given) if given else RunDir(adapter_path).heartbeats


def write_heartbeat(folder: Path, rank: int, step: int, gave_up: bool = False) -> None:
    """Replace rank<i>.json atomically (a reader never sees half a file).

    `gave_up`: this rank is leaving because of a peer; peers must not blame it.
    """
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "step": step, "alive": time.time(),
              "gave_up": gave_up}
    tmp = heartbeat_temp(folder, rank)
    tmp.write_text(json.dumps(record))
    os.replace(tmp, heartbeat_file(folder, rank))


def read_heartbeat(folder: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads(heartbeat_file(folder, rank).read_text())
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """Why a local process cannot answer ('exited', 'stopped (SIGSTOP)'), or None if it runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exited" if Path("/proc/self/stat").exists() else None  # no procfs: cannot tell
    state = stat.rsplit(")", 1)[-1].split()[0]  # the command name in (...) may hold spaces
    if state in ("T", "t"):
        return "stopped (SIGSTOP)"
    if state in ("Z", "X"):
        return "exited"
    return None


def lost_peer(folder: Path, world_size: int, me: int | None, stale_s: float) -> tuple[int, int | None, str] | None:
    """(rank, its last finished step, why) of the peer that stopped answering first, else None.

    Survivors that left because of a peer mark their last heartbeat `gave_up` and are
    not blamed; of the rest, the one whose heartbeat went silent earliest is the cause.
    """
    host = socket.gethostname()
    now = time.time()
    lost = []
    for rank in range(world_size):
        if rank == me:
            continue
        record = read_heartbeat(folder, rank)
        if record is None or record.get("gave_up"):
            continue  # never started the loop (or another host without a shared folder), or left because of a peer
        alive = float(record.get("alive", now))
        why = process_state(int(record["pid"])) if record.get("host") == host else None
        if why is None and now - alive > stale_s:
            why = f"no heartbeat for {now - alive:.0f}s"
        if why:
            lost.append((alive, rank, record.get("step"), why))
    return min(lost)[1:] if lost else None


def peer_still_starting(folder: Path | None, world_size: int, me: int, idle: float, timeout_s: float) -> bool:
    """Whether a local-folder peer has not reached its loop yet and the startup grace is not used up."""
    if folder is None or idle > STARTUP_GRACE * timeout_s:
        return False
    return any(read_heartbeat(folder, rank) is None for rank in range(world_size) if rank != me)


class Watchdog:
    """`beat(step)` from the loop; exits the process when beats stop for `timeout_s`."""

    def __init__(self, timeout_s: float, rank: int, world_size: int, heartbeat_dir: Path | None = None) -> None:
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.heartbeat_dir = heartbeat_dir
        # Heartbeats at least 4 per timeout; a peer is stale after 3 missed ones.
        self.interval = min(0.5, timeout_s / 4) if timeout_s > 0 else 0.5
        self._step, self._last = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._gave_up = False
        self._beaten = False  # no step finished yet: a peer may still be starting

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0 and self.world_size > 1:
            if self.heartbeat_dir is not None:
                try:
                    self.heartbeat_dir.mkdir(parents=True, exist_ok=True)
                    write_heartbeat(self.heartbeat_dir, self.rank, self._step)
                except OSError:  # the side channel is a nicety: without it the watchdog still works
                    self.heartbeat_dir = None
            self._thread = threading.Thread(target=self._watch, name="meshtune-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        lost = isinstance(exc, PeerLost) or isinstance(exc, RuntimeError) and BACKEND_ERROR.match(str(exc))
        if self._thread is not None and lost:
            self.peer_lost(str(exc))
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.heartbeat_dir is not None and exc_type is None:  # a finished run leaves no heartbeat behind
            heartbeat_file(self.heartbeat_dir, self.rank).unlink(missing_ok=True)
            try:
                self.heartbeat_dir.rmdir()
            except OSError:  # peers' files still there, or the launcher's folder
                pass

    def beat(self, step: int) -> None:
        """A finished step (written to the heartbeat file now, so a peer names the exact step)."""
        self._step, self._last, self._beaten = step, time.monotonic(), True
        self._write()

    def _write(self, gave_up: bool = False) -> None:
        if self.heartbeat_dir is None or self._thread is None:
            return
        with self._lock:  # the loop and the thread share the temp file name
            self._gave_up = self._gave_up or gave_up  # once said, every later write says it too
            try:
                write_heartbeat(self.heartbeat_dir, self.rank, self._step, self._gave_up)
            except OSError:
                pass

    def alive(self) -> None:
        """Progress inside a step (an eval batch): the step number stays."""
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()
            idle = time.monotonic() - self._last
            starting = not self._beaten and peer_still_starting(self.heartbeat_dir, self.world_size, self.rank,
                                                                 idle, self.timeout_s)
            if idle > self.timeout_s and not starting:
                self._write(gave_up=True)
                print(f"\n{self.message(idle)}", file=sys.stderr, flush=True)  # below any progress bar
                os._exit(EXIT_CODE)

    def peer_lost(self, error: str) -> None:
        """The backend saw a peer go (a closed connection): one line, exit 75, no traceback.

        Under `meshtune launch` the launcher sees the lost rank itself and says the
        one line, so the rank exits quietly.
        """
        self._write(gave_up=True)
        if not os.environ.get(HEARTBEAT_ENV):
            line = self.message(time.monotonic() - self._last, cause=error)
            print(f"\n{line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)  # a normal exit would wait on the backend's threads

    def message(self, idle: float, cause: str | None = None) -> str:
        """The one line printed before exiting: the lost peer and its step when it can be named."""
        lost = None
        if self.heartbeat_dir is not None:
            lost = lost_peer(self.heartbeat_dir, self.world_size, self.rank, stale_s=3 * self.interval + 1)
        if lost is None and self.world_size == 2:
            # Every process is alive yet nothing arrives: a cut link or a hung peer. With
            # two ranks there is one peer to name.
            who = (f"rank {1 - self.rank} stopped answering (alive but unreachable: a cut link or a hang"
                   f"{': ' + cause if cause else ''})")
        elif lost is None:
            who = "a peer rank stopped answering (killed, stopped or cut off; which one cannot be told from here"
            who += f": {cause})" if cause else ")"
        else:
            rank, step, why = lost
            who = f"rank {rank} stopped answering at step {step} ({why}{'; ' + cause if cause else ''})"
        return (f"meshtune: rank {self.rank}: {who}; no progress here for {idle:.0f}s at step {self._step}; "
                f"exiting with {EXIT_CODE}. Resume with --resume from the last checkpoint.")
