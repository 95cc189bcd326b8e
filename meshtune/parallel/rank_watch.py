"""Watching started ranks: the first lost or failed one is named in one line and the others are stopped.

`watch_ranks` is parallel/launcher.py's wait: it polls every rank's process, passes a Ctrl-C or SIGTERM
on to the ranks as a request to save and stop, lets an exit every rank reaches on its own (bad input, a
non-finite step, a stop) arrive from all of them, and otherwise blames the rank a heartbeat
(runtime/watchdog.py) or a signal names.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..training import NONFINITE_EXIT_CODE, STOPPED_EXIT_CODE
from ..runtime.watchdog import EXIT_CODE, lost_peer, process_state, read_heartbeat


@dataclass
class Rank:
    """One started rank: its process (the rank itself, or the local ssh of a remote one)."""

    index: int
    proc: subprocess.Popen
    host: str | None = None  # ssh host of a remote rank
    remote_pid: int | None = None
    pump: threading.Thread | None = None  # reads its output; done when every process holding the pipe ended
    held: list[str] = field(default_factory=list)  # backend error lines, shown unless a lost rank explains them


SSH_FAILED = 255  # ssh's exit code when it could not connect or log in
STOPPED_FOR_S = 1.0  # a rank in state T this long is lost (not a passing ptrace stop)
CAUSE_WAIT_S = 3.0  # how long a rank's lost connection (75) waits for the rank that caused it to exit
# Exits every rank reaches on its own, each saying its own line: a non-finite step (every rank at the same
# step) and bad input or config (code 2: every rank reads the same files). The launcher waits this long for
# the others to get there before stopping them.
# A stop on request (code 3) is agreed too: the ranks save one checkpoint together and exit.
AGREED_EXIT_S = {NONFINITE_EXIT_CODE: 30.0, 2: 5.0, STOPPED_EXIT_CODE: 15.0}


def watch_ranks(ranks: list[Rank], timeout: float | None, beats: Path, err: IO[str],
           muted: threading.Event, interrupts: list[int] | None = None) -> tuple[int, bool]:
    """Wait for every rank; on the first lost or failed rank say one line and stop the rest.

    A signal in `interrupts` (Ctrl-C or SIGTERM to the launcher) is passed on to every rank as
    SIGTERM, which each takes as a request to save a checkpoint and stop (exit 3); a later one
    is said and changes nothing, so no save is cut short.

    Returns (exit code, whether a lost rank was named). Lost: killed by a signal
    (code 128 + signal) or stopped, state T in /proc/<pid>/stat (code 75, the
    watchdog's resumable code). A rank exiting non-zero gives its code; if that is
    75 (its watchdog, or its connection closing) and a heartbeat shows which other
    rank is gone or stopped, the line names that rank; with no heartbeat to go by, a
    rank that exits with another code within CAUSE_WAIT_S is named instead.
    """
    start, watch = time.monotonic(), _Watch(ranks, beats, err, muted, interrupts if interrupts is not None else [])
    while True:
        watch.pass_on_interrupts()
        if watch.passed_on:  # the user's stop: each rank saves and exits on its own, however long that takes
            done = watch.stopped_on_request()
            if done is not None:
                return done
            time.sleep(0.2)
            continue
        codes = [r.proc.poll() for r in ranks]
        # A rank killed by a signal is the cause; peers exiting 75 (a lost connection) are the effect.
        failed = sorted(((i, c) for i, c in enumerate(codes) if c not in (None, 0)),
                        key=lambda f: (f[1] >= 0, f[1] == EXIT_CODE))
        agreed = watch.agreed_exit(codes, failed)
        if agreed == "wait":
            time.sleep(0.05)
            continue
        if agreed is not None:
            return agreed, False
        found = watch.failure(codes, failed)
        if found is not None:
            return found
        if all(c == 0 for c in codes):
            return 0, False
        now = time.monotonic()
        found = watch.stopped_rank(now)
        if found is not None:
            return found
        if timeout is not None and now - start > timeout:
            print(f"meshtune launch: ranks still running after {timeout:.0f}s; stopping them", file=err, flush=True)
            _stop(ranks, grace=10)
            return 124, False
        time.sleep(0.2)  # five wake-ups a second: negligible next to a busy-polling reader


@dataclass
class _Watch:
    """What `watch_ranks` remembers between polls: the interrupts passed on, and since when an agreed exit,
    a lost connection without its cause, or a stopped rank has been seen."""

    ranks: list[Rank]
    beats: Path
    err: IO[str]
    muted: threading.Event
    interrupts: list[int]
    passed_on: int = 0
    agreed_since: float | None = None
    effect_since: float | None = None
    stopped_since: dict[int, float] = field(default_factory=dict)

    def pass_on_interrupts(self) -> None:
        """A new Ctrl-C or SIGTERM to the launcher: every rank is asked to save and stop, once."""
        if len(self.interrupts) <= self.passed_on:
            return
        name = signal.Signals(self.interrupts[-1]).name
        if self.passed_on:  # a save cut short would lose the run's last steps: the ranks finish theirs
            print(f"meshtune launch: {name} again: the ranks are already saving and stopping (kill -9 "
                  "stops them now, losing the steps since their last checkpoint)", file=self.err, flush=True)
        else:
            print(f"meshtune launch: {name}: every rank saves a checkpoint and stops", file=self.err, flush=True)
            for r in self.ranks:
                if r.proc.poll() is None:
                    _signal_rank(r, signal.SIGTERM, rank_only=True)
        self.passed_on = len(self.interrupts)

    def stopped_on_request(self) -> tuple[int, bool] | None:
        """Once every rank has ended after the user's stop: its exit code (3, or a rank's other code)."""
        if not all(r.proc.poll() is not None and not (r.pump and r.pump.is_alive()) for r in self.ranks):
            return None
        codes = [r.proc.returncode for r in self.ranks]
        other = [c for c in codes if c not in (0, STOPPED_EXIT_CODE)]
        return ((other[0] if other[0] > 0 else 128 + self.interrupts[0]) if other else max(codes)), False

    def agreed_exit(self, codes: list[int | None], failed: list[tuple[int, int]]) -> int | str | None:
        """An exit every rank reaches on its own: let the others get there (up to AGREED_EXIT_S), then
        pass the code on with nothing to add. The code; "wait" while the others may still get there."""
        agreed = failed[0][1] if failed and failed[0][1] in AGREED_EXIT_S else None
        if agreed is None or not all(c in (None, agreed) for c in codes):
            return None
        self.agreed_since = self.agreed_since or time.monotonic()
        if all(c == agreed for c in codes):
            return agreed
        return "wait" if time.monotonic() - self.agreed_since < AGREED_EXIT_S[agreed] else None

    def failure(self, codes: list[int | None], failed: list[tuple[int, int]]) -> tuple[int, bool] | None:
        """The first failed rank's line and code (or the peer its heartbeat names); None while none has."""
        i, code = failed[0] if failed else (None, None)
        lost = lost_peer(self.beats, len(self.ranks), i, stale_s=5.0) if code == EXIT_CODE else None
        # A rank that lost its connection, with no peer to blame, is an effect: the rank that broke
        # it may still be on its way out with its own code (an error's). Wait for that a little.
        if code == EXIT_CODE and lost is None and None in codes:
            self.effect_since = self.effect_since or time.monotonic()
            if time.monotonic() - self.effect_since < CAUSE_WAIT_S:
                return None
        if not failed:
            return None
        self.muted.set()
        ranks, beats, err = self.ranks, self.beats, self.err
        if code < 0:
            sig = -code
            why = f"killed by signal {sig} ({signal.Signals(sig).name})"
            return _fail(ranks, i, why, 128 + sig, beats, err), True
        if lost is not None:
            return _fail(ranks, lost[0], f"{lost[2]}; rank {i} exited with code {code}", code, beats, err), True
        host = ranks[i].host
        ssh = (f" (ssh's own failure code: check that `ssh {host} true` works without a password prompt)"
               if host is not None and code == SSH_FAILED else "")
        return _fail(ranks, i, "", code, beats, err, verb=f"exited with code {code}{ssh}"), False

    def stopped_rank(self, now: float) -> tuple[int, bool] | None:
        """A local rank in state T (SIGSTOP) for STOPPED_FOR_S: lost, with the watchdog's code."""
        for r in self.ranks:
            if r.host is None and (process_state(r.proc.pid) or "").startswith("stopped"):
                if now - self.stopped_since.setdefault(r.index, now) >= STOPPED_FOR_S:
                    self.muted.set()
                    return _fail(self.ranks, r.index, "stopped (SIGSTOP)", EXIT_CODE, self.beats, self.err), True
            else:
                self.stopped_since.pop(r.index, None)
        return None


def _fail(ranks: list[Rank], i: int, why: str, code: int, beats: Path, err: IO[str], verb: str = "") -> int:
    beat = read_heartbeat(beats, i)
    at = f" at step {beat['step']}" if beat else ""
    what = f"{verb}{at}" if verb else f"stopped answering{at} ({why})"
    running = [r.index for r in ranks if r.index != i and r.proc.poll() is None]
    exited = [r.index for r in ranks if r.index != i and r.index not in running]
    plural = lambda ids: f"rank{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"  # noqa: E731
    tail = [f"stopping {plural(running)}"] if running else []
    tail += [f"{plural(exited)} already exited"] if exited else []
    print(f"meshtune launch: rank {i} {what}; {', '.join(tail) or 'no other rank'}", file=err, flush=True)
    # Peers of a lost rank sit in a collective where SIGTERM is never handled: short grace.
    _stop(ranks, grace=2 if not verb else 10)
    return code


def _stop(ranks: list[Rank], grace: float) -> None:
    """SIGTERM every running rank (SIGKILL a stopped one: it cannot act on SIGTERM), SIGKILL after grace."""
    for r in ranks:
        if r.proc.poll() is None:
            stopped = r.host is None and (process_state(r.proc.pid) or "").startswith("stopped")
            _signal_rank(r, signal.SIGKILL if stopped else signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in ranks:
        try:
            r.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_rank(r, signal.SIGKILL)
            r.proc.wait()


def _signal_rank(r: Rank, sig: int, rank_only: bool = False) -> None:
    """`sig` to the rank (a remote one through ssh), then to its local process group (a remote rank's
    ssh) unless `rank_only`: a stop request must reach each rank once, and leave its output's ssh open."""
    if r.host is not None and r.remote_pid is not None:
        subprocess.run(["ssh", r.host, f"kill -{int(sig)} {r.remote_pid}"], capture_output=True, timeout=30,
                       stdin=subprocess.DEVNULL)
        if rank_only:
            return
    try:
        os.killpg(r.proc.pid, sig)
    except ProcessLookupError:
        pass
