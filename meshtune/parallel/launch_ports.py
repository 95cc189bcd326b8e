"""Ports for `meshtune launch`'s local ranks, held against every other launcher on this machine.

A port found free by binding port 0 is free only until its socket closes; the ranks bind it
a moment later. Two launchers started together could pick the same port in between, and
their rings would meet. So each picked port is also held, from the pick until the launcher
exits, by an `fcntl.flock` on a file named after it in a folder every launcher of this user
shares; a port whose file another launcher holds is passed over. The kernel drops the
locks when a launcher dies, however it dies.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path


def _folder() -> Path:
    folder = Path(tempfile.gettempdir()) / f"meshtune-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


class HeldPorts:
    """The ports one launcher picked, each held until `close` (or the launcher's exit); `folder` holds
    the lock files (default: the one every launcher of this user shares)."""

    def __init__(self, folder: Path | None = None) -> None:
        self._fds: list[int] = []
        self._folder = folder

    def take(self, n: int) -> list[int]:
        """n distinct TCP ports, free a moment ago on 127.0.0.1 and held by no other launcher."""
        folder, socks, ports = self._folder or _folder(), [], []
        try:
            while len(ports) < n:
                s = socket.socket()
                s.bind(("127.0.0.1", 0))  # kept bound until all are picked: the kernel never hands it out twice
                socks.append(s)
                port = s.getsockname()[1]
                fd = os.open(folder / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another launcher picked it and its ranks have not bound it yet
                    os.close(fd)
                    continue
                self._fds.append(fd)
                ports.append(port)
        finally:
            for s in socks:
                s.close()
        return ports

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> "HeldPorts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
