"""Gradient all-reduce over plain blocking TCP sockets, off the thread that computes.

MLX's ring backend busy-polls its sockets: an all_sum keeps a core busy for its whole
wall time. Where a rank has one core, that spin takes the core from the backward it
was meant to overlap with. A blocking socket waits in the kernel instead, so compute
beside an exchange keeps its core (docs/performance.md, "A socket ring for one-core ranks").

`parallel.transport: sockets` sends the gradient buckets this way, in float32, while
the compiled backward computes the next bucket: two ranks stream buckets to each other
(BucketPump), more run a ring all-reduce (reduce-scatter, then all-gather, n - 1 steps
each) between each rank and its neighbours. Ring backend only: the hosts come from
its hostfile (MLX_HOSTFILE), the ports from an exchange over the MLX group.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from typing import Any, Iterator

import numpy as np

from ..runtime.watchdog import PeerLost

CONNECT_SECONDS = 60.0


def hostfile_ips() -> list[str]:
    """Each rank's IP from the ring backend's hostfile (a list of "ip:port" lists)."""
    path = os.environ.get("MLX_HOSTFILE", "")
    if not path:
        raise ValueError("parallel.transport=sockets needs the ring backend's hostfile (MLX_HOSTFILE); "
                         "launch with `meshtune launch` or `mlx.launch --backend ring`, or set "
                         "parallel.transport: mlx")
    with open(path) as f:
        hosts = json.load(f)
    return [(h[0] if isinstance(h, list) else h).rsplit(":", 1)[0] for h in hosts]


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except OSError as err:  # reset by the peer, or its host gone
            raise PeerLost(f"receiving gradients from the other rank failed: {err}") from None
        if n == 0:
            raise PeerLost("a peer closed its gradient socket (its rank has stopped)")
        got += n


class SocketRing:
    """A TCP ring between the ranks: each sends to rank + 1 and receives from rank - 1."""

    def __init__(self, rank: int, ips: list[str], exchange_ports: Any) -> None:
        """`exchange_ports(port) -> every rank's port`, run on every rank (an MLX all-gather)."""
        self.rank, self.size = rank, len(ips)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ips[rank], 0))
        listener.listen(1)
        ports = exchange_ports(listener.getsockname()[1])
        nxt = (rank + 1) % self.size
        deadline = time.monotonic() + CONNECT_SECONDS
        while True:
            try:
                self.send_sock = socket.create_connection((ips[nxt], ports[nxt]), timeout=CONNECT_SECONDS)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        listener.settimeout(CONNECT_SECONDS)
        self.recv_sock, _ = listener.accept()
        listener.close()
        for s in (self.send_sock, self.recv_sock):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Sends run on their own thread so that every rank can send and receive at once
        # (all ranks blocking in send on full buffers would deadlock the ring).
        self._sends: queue.Queue = queue.Queue()
        self._sent: queue.Queue = queue.Queue()
        threading.Thread(target=self._sender, daemon=True, name="meshtune-ring-send").start()

    def _sender(self) -> None:
        while True:
            view = self._sends.get()
            if view is None:
                return
            try:
                self.send_sock.sendall(view)
                self._sent.put(None)
            except OSError as err:
                self._sent.put(err)

    def _step(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._sends.put(memoryview(send).cast("B"))
        _recv_into(self.recv_sock, memoryview(recv).cast("B"))
        err = self._sent.get()
        if err is not None:
            raise PeerLost(f"sending gradients to the next rank failed: {err}")

    def all_sum(self, buf: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's `buf` (float32, 1-D), in place."""
        n, r = self.size, self.rank
        if n == 1:
            return buf
        bounds = np.linspace(0, buf.size, n + 1).astype(int)
        chunk = [buf[bounds[i]:bounds[i + 1]] for i in range(n)]
        scratch = np.empty(max(c.size for c in chunk), dtype=buf.dtype)
        for step in range(n - 1):  # reduce-scatter: chunk (r + 1) ends complete here
            out, inc = chunk[(r - step) % n], chunk[(r - step - 1) % n]
            part = scratch[:inc.size]
            self._step(out, part)
            np.add(inc, part, out=inc)
        for step in range(n - 1):  # all-gather the complete chunks around the ring
            out, inc = chunk[(r + 1 - step) % n], chunk[(r - step) % n]
            self._step(out, inc)
        return buf

    def close(self) -> None:
        self._sends.put(None)
        for s in (self.send_sock, self.recv_sock):
            try:
                s.close()
            except OSError:
                pass


class BucketPump:
    """Buckets handed over as the backward finishes them, summed on communication threads.

    With two ranks the link never waits on a round trip: one thread sends each bucket
    as soon as it is computed, another receives the peer's in the same order and adds
    (both ranks hand over the same buckets in the same order). With more ranks one
    thread runs the ring's steps bucket by bucket.
    """

    def __init__(self, ring: SocketRing) -> None:
        self.ring = ring
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        if ring.size == 2:
            self._sent: queue.Queue = queue.Queue()
            threading.Thread(target=self._send_pairs, daemon=True, name="meshtune-pair-send").start()
            threading.Thread(target=self._receive_pairs, daemon=True, name="meshtune-pair-recv").start()
        else:
            threading.Thread(target=self._run, daemon=True, name="meshtune-ring-comm").start()

    def _run(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, buf = item
            try:
                # An mx.array already started by the training thread: np.array waits for it.
                self._done.put((key, self.ring.all_sum(np.array(buf, dtype=np.float32)), None))
            except Exception as err:  # handed to the training thread, which raises it
                self._done.put((key, None, err))

    def _send_pairs(self) -> None:
        failed = None
        while True:
            item = self._todo.get()
            if item is None:
                self._sent.put(None)
                return
            key, buf = item
            try:
                buf = np.array(buf, dtype=np.float32)
                if failed is None:
                    self.ring.send_sock.sendall(memoryview(buf).cast("B"))
            except Exception as err:  # raised on the training thread by collect()
                failed = err if not isinstance(err, OSError) else PeerLost(
                    f"sending gradients to the other rank failed: {err}")
            self._sent.put((key, buf, failed))

    def _receive_pairs(self) -> None:
        while True:
            item = self._sent.get()
            if item is None:
                return
            key, buf, err = item
            try:
                if err is not None:
                    raise err
                other = np.empty_like(buf)
                _recv_into(self.ring.recv_sock, memoryview(other).cast("B"))
                self._done.put((key, np.add(buf, other, out=buf), None))  # a + b == b + a: same bits on both
            except Exception as err:
                self._done.put((key, None, err))

    def submit(self, key: Any, buf: Any) -> None:
        """Sum `buf` (a float32 numpy array, or an mx.array already given to mx.async_eval)."""
        self._todo.put((key, buf))

    def collect(self, count: int) -> Iterator[tuple[Any, np.ndarray]]:
        """(key, sum) of `count` submitted buckets, as each sum arrives; a failure raises here."""
        for _ in range(count):
            key, buf, err = self._done.get()
            if err is not None:
                raise err
            yield key, buf
