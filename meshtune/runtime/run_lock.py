"""One run per output folder: an exclusive lock on `--adapter-path`, held by the writer for the run's life.

Two runs writing one folder mix their checkpoints and prune each other's saves. So the
writer rank takes `fcntl.flock` on a lock file inside the folder before it reads or writes
anything there, and keeps it until the run ends; a second run finds it held and stops at
once with one line naming the holder's pid and host (written into the file). The kernel
drops a flock when its process dies, however it dies: a lock file left by a killed run is
taken over, with a note naming the run that left it. A run that ends removes the file
(and the folder, if the run made it and left it empty). After taking the lock, the files a
killed save left (`.NAME.tmp-PID...`) are removed: no other run can be writing them. The
holder alone clears the folder for `--output.overwrite` (`FolderLock.clear`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ..run_dir import RunDir, is_earlier_run, is_temp


def _read_holder(fd: int) -> dict[str, Any]:
    """What the file says about the run that holds (or held) it: {} if nothing readable."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}{when}"


class FolderLock:
    """The held lock on one output folder; `release` gives it back (the file goes)."""

    def __init__(self, folder: Path, fd: int, made_folder: bool) -> None:
        self.folder, self._fd, self._made_folder = folder, fd, made_folder

    def clear(self) -> int:
        """Remove the earlier run in the folder (output.overwrite): every entry but the lock is first
        renamed into one hidden folder, then that folder goes, so the new run's first file never sits
        beside the old run's (a kill half way leaves that folder, which the next lock removes).
        Returns how many entries went."""
        run = RunDir(self.folder)
        aside = run.earlier_run(os.getpid())
        entries = [p for p in self.folder.iterdir() if p.name != run.lock.name and p != aside]
        if not entries:
            return 0
        aside.mkdir(exist_ok=True)
        for entry in entries:
            os.rename(entry, aside / entry.name)
        shutil.rmtree(aside, ignore_errors=True)
        return len(entries)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            RunDir(self.folder).lock.unlink(missing_ok=True)  # while still held: no one locks a file that goes
        finally:
            os.close(self._fd)
            self._fd = -1
        if self._made_folder:
            try:
                self.folder.rmdir()  # only if empty: a run refused before writing anything leaves no folder
            except OSError:
                pass


def lock_folder(folder: Path, say: Callable[[str], None] = print) -> FolderLock:
    """Take the folder's lock or raise a one-line ValueError naming the run that holds it.

    Creates the folder if needed (check it is writable first: runtime/outdir.check_writable)."""
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = RunDir(folder).lock
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ValueError(f"output.adapter_path={folder} is in use by another run ({_describe(holder)}); "
                             "wait for it to end, stop it, or choose another --adapter-path") from None
        # The holder before us may have removed the file between our open and our lock: then ours is
        # a lock on a file no one else will find, so take the one at the path again.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    left = _read_holder(fd)
    if left.get("pid"):
        say(f"note: taking over {path}, left by a run that ended without releasing it ({_describe(left)})")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    os.fsync(fd)
    _remove_leftover_temps(folder, say)
    return FolderLock(folder, fd, made)


def _remove_leftover_temps(folder: Path, say: Callable[[str], None]) -> None:
    """Remove the temp files of writes a killed run never finished (`.adapters.safetensors.tmp-PID...`) and
    an earlier run an overwrite had set aside but not yet removed."""
    leftovers = [p for p in folder.iterdir() if (p.is_file() and is_temp(p)) or (p.is_dir() and is_earlier_run(p))]
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    if leftovers:
        say(f"note: removed {len(leftovers)} unfinished temp file{'s' * (len(leftovers) != 1)} of an earlier "
            f"run's interrupted write ({leftovers[0].name}{', ...' if len(leftovers) > 1 else ''})")
