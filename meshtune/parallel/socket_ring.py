"""Gradient all-reduce over plain blocking TCP sockets, off the thread that computes.

MLX's ring backend busy-polls its sockets: an all_sum keeps a core busy for its whole
wall time. Where a rank has one core, that spin takes the core from the backward it
was meant to overlap with. A blocking socket waits in the kernel instead, so compute
beside an exchange keeps its core (docs/performance.md, "A socket ring for one-core ranks").

`parallel.transport: sockets` sends the gradient buckets this way, in float32, while the compiled
backward computes the next bucket (`BucketPump`), over connections to each neighbour, one per
hostfile address, every transfer striped across them (`SocketRing`). Ring backend only: the hosts
come from its hostfile (MLX_HOSTFILE, `hostfile_links`), the ports from an exchange over the MLX group.
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


def hostfile_links() -> list[list[str]]:
    """Each rank's link addresses from the ring backend's hostfile (a list of "ip:port" lists, one per link)."""
    path = os.environ.get("MLX_HOSTFILE", "")
    if not path:
        raise ValueError("parallel.transport=sockets needs the ring backend's hostfile (MLX_HOSTFILE); "
                         "launch with `meshtune launch` or `mlx.launch --backend ring`, or set "
                         "parallel.transport: mlx")
    with open(path) as f:
        hosts = json.load(f)
    return [[a.rsplit(":", 1)[0] for a in (h if isinstance(h, list) else [h])] for h in hosts]


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


def _send(sock: socket.socket, view: memoryview) -> None:
    try:
        sock.sendall(view)
    except OSError as err:
        raise PeerLost(f"sending gradients to the next rank failed: {err}") from None


class _LinkWorker:
    """One persistent thread moving byte views over one socket, one direction, in the order given."""

    def __init__(self, sock: socket.socket, move: Any, name: str) -> None:
        self.sock, self.move = sock, move
        self.moved = 0  # bytes moved so far
        self.tasks: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def _run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                return
            view, done = task
            try:
                self.move(self.sock, view)
                self.moved += len(view)
                done.put(None)
            except Exception as err:  # handed to whoever waits on `done`
                done.put(err)


Pending = tuple  # (queue of each stripe's outcome, how many stripes)


class SocketRing:
    """A TCP ring between the ranks over every link: each sends to rank + 1 and receives from rank - 1,
    and with more than two ranks also the other way round.

    A rank with K addresses in the hostfile (one per cable) has K connections to each neighbour;
    every transfer is cut into K stripes, one per link, each moved by the link's own sender or
    receiver thread (blocking I/O), so all cables carry a share at once. With more than two ranks
    `all_sum` runs half of the buffer around the ring each way at once, so both directions of every
    cable carry data (two ranks already send to each other both ways)."""

    def __init__(self, rank: int, links: list[list[str]], exchange_ports: Any) -> None:
        """`exchange_ports(port) -> every rank's port`, run on every rank (an MLX all-gather)."""
        self.rank, self.size = rank, len(links)
        counts = {len(a) for a in links}
        if len(counts) != 1:
            raise ValueError(f"parallel.transport=sockets: the ranks list {sorted(counts)} links each in the ring "
                             "hostfile; list the same number of addresses for every host")
        self.links = counts.pop()
        nxt, prev = (rank + 1) % self.size, (rank - 1) % self.size
        self.forward = _Direction(rank, links, nxt, exchange_ports, "fwd")
        self.backward = _Direction(rank, links, prev, exchange_ports, "bwd") if self.size > 2 else None

    def post_send(self, buf: np.ndarray) -> Pending:
        """Start sending `buf` to the next rank, a stripe per link; `wait` on what this returns."""
        return _post(self.forward.senders, buf)

    def post_recv(self, buf: np.ndarray) -> Pending:
        """Start receiving the previous rank's next transfer into `buf`, a stripe per link."""
        return _post(self.forward.receivers, buf)

    @staticmethod
    def wait(pending: Pending) -> None:
        """Wait until every stripe of a posted transfer has moved; a failed one raises (PeerLost)."""
        done, count = pending
        errors = [done.get() for _ in range(count)]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def all_sum(self, buf: np.ndarray) -> np.ndarray:
        """The element-wise sum of every rank's `buf` (float32, 1-D), in place."""
        n = self.size
        if n == 1:
            return buf
        if self.backward is None:
            _ring_sum([(self.forward, self.rank, buf)], n)
            return buf
        # Half each way: going backward this rank sits at position -rank of a ring whose next is rank - 1.
        half = buf.size // 2
        _ring_sum([(self.forward, self.rank, buf[:half]), (self.backward, (-self.rank) % n, buf[half:])], n)
        return buf

    def close(self) -> None:
        for direction in (self.forward, self.backward):
            if direction is not None:
                direction.close()


class _Direction:
    """One way around the ring over every link: connections to `to` (a neighbour) and from the other
    neighbour, each with its persistent sender or receiver thread."""

    def __init__(self, rank: int, links: list[list[str]], to: int, exchange_ports: Any, name: str) -> None:
        listeners = []
        for address in links[rank]:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, 0))
            listener.listen(1)
            listeners.append(listener)
        ports = [exchange_ports(listener.getsockname()[1]) for listener in listeners]
        self.send_socks = [_connect(links[to][j], ports[j][to]) for j in range(len(listeners))]
        self.recv_socks = []
        for listener in listeners:
            listener.settimeout(CONNECT_SECONDS)
            self.recv_socks.append(listener.accept()[0])
            listener.close()
        for s in (*self.send_socks, *self.recv_socks):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Every link sends and receives on threads of its own, so that all ranks can send and receive at
        # once (ranks all blocking in send on full buffers would deadlock the ring) and every cable moves.
        self.senders = [_LinkWorker(s, _send, f"meshtune-{name}{j}-send") for j, s in enumerate(self.send_socks)]
        self.receivers = [_LinkWorker(s, _recv_into, f"meshtune-{name}{j}-recv")
                          for j, s in enumerate(self.recv_socks)]

    def close(self) -> None:
        for worker in (*self.senders, *self.receivers):
            worker.tasks.put(None)
        for s in (*self.send_socks, *self.recv_socks):
            try:
                s.close()
            except OSError:
                pass


def _ring_sum(parts: list[tuple[_Direction, int, np.ndarray]], n: int) -> None:
    """Ring all-reduces of each (direction, this rank's position on it, buffer), in place, step by step
    together: reduce-scatter (n - 1 steps; chunk position + 1 ends complete here), then all-gather."""
    plans = []
    for direction, r, buf in parts:
        bounds = np.linspace(0, buf.size, n + 1).astype(int)
        chunk = [buf[bounds[i]:bounds[i + 1]] for i in range(n)]
        plans.append((direction, r, chunk, np.empty(max(c.size for c in chunk), dtype=buf.dtype)))
    for gather in (False, True):
        for step in range(n - 1):
            moves = []
            for direction, r, chunk, scratch in plans:
                if gather:
                    out, inc = chunk[(r + 1 - step) % n], chunk[(r - step) % n]
                    into = inc
                else:
                    out, inc = chunk[(r - step) % n], chunk[(r - step - 1) % n]
                    into = scratch[:inc.size]
                moves.append((inc, into, _post(direction.senders, out), _post(direction.receivers, into)))
            for inc, into, sent, got in moves:
                SocketRing.wait(got)
                SocketRing.wait(sent)
                if not gather:
                    np.add(inc, into, out=inc)


def _connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            return socket.create_connection((address, port), timeout=CONNECT_SECONDS)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _post(workers: list[_LinkWorker], buf: np.ndarray) -> Pending:
    """`buf`'s bytes cut into one stripe per worker (link), each queued on its worker."""
    view = memoryview(buf).cast("B")
    k, done = len(workers), queue.Queue()
    for j, worker in enumerate(workers):
        worker.tasks.put((view[j * len(view) // k:(j + 1) * len(view) // k], done))
    return done, k


class BucketPump:
    """Buckets handed over as the backward finishes them, summed on communication threads.

    With two ranks the links never wait on a round trip: one thread posts each bucket to the
    links' senders as soon as it is computed, another receives the peer's in the same order
    and adds (both ranks hand over the same buckets in the same order). With more ranks one
    thread runs the ring's steps bucket by bucket. Every transfer is striped over the links.
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
            sending = None
            try:
                buf = np.array(buf, dtype=np.float32)
                if failed is None:
                    sending = self.ring.post_send(buf)  # the links' threads stream it; no wait here
            except Exception as err:  # raised on the training thread by collect()
                failed = err
            self._sent.put((key, buf, sending, failed))

    def _receive_pairs(self) -> None:
        while True:
            item = self._sent.get()
            if item is None:
                return
            key, buf, sending, err = item
            try:
                if err is not None:
                    raise err
                other = np.empty_like(buf)
                self.ring.wait(self.ring.post_recv(other))
                self.ring.wait(sending)
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
