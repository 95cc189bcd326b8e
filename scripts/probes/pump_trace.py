"""Timeline of the socket ring's buckets in real training steps (data-parallel issue, development probe).

    python scripts/probes/run_shaped.py scripts/probes/pump_trace.py   # 2 pinned ranks, 1gbit shaped link

Runs `meshtune train` (tiny model, full fine-tuning, overlap over sockets, 0.25 MB buckets)
with BucketPump's hand-overs timed: per bucket, ms from the step's first submit to
submitted / computed / sent / summed, averaged over steps 10-30. Rank 0 prints.
"""
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from meshtune.parallel import socket_ring as S

import mlx.core as mx

T = defaultdict(list)  # (step, key) -> [async_eval called, submitted, computed, sent, collected]
state = {"step": -1, "t0": 0.0, "last": 0.0, "called": 0.0, "sends": 0}
now = time.perf_counter
_async_eval = mx.async_eval


def async_eval(*args):
    state["called"] = now()
    return _async_eval(*args)


mx.async_eval = async_eval

orig_submit, orig_collect, orig_ring_init = S.BucketPump.submit, S.BucketPump.collect, S.SocketRing.__init__


def submit(self, key, buf):
    if key == 0:
        state["step"] += 1
        state["t0"] = state["last"]  # the previous step's last sum: its update, this forward and backward follow
        state["sends"] = 0
    T[(state["step"], key)] += [state["called"] - state["t0"], now() - state["t0"]]
    orig_submit(self, key, buf)


class TimedSocket:
    """The send socket, timed: a bucket is computed when its sendall starts (the pump's
    thread has just waited for it), sent when sendall returns. NOSEND=1 sends nothing."""

    def __init__(self, sock):
        self.sock = sock

    def sendall(self, data):
        step, key = state["step"], state["sends"]
        state["sends"] += 1
        T[(step, key)].append(now() - state["t0"])
        if not os.environ.get("NOSEND"):
            self.sock.sendall(data)
        T[(step, key)].append(now() - state["t0"])

    def __getattr__(self, name):
        return getattr(self.sock, name)


def ring_init(self, *args, **kwargs):
    orig_ring_init(self, *args, **kwargs)
    self.send_sock = TimedSocket(self.send_sock)


def recv_zeros(sock, view):
    """NOSEND=1: the peer's bucket is zeros, received at once (no network)."""
    view[:] = bytes(len(view))


def collect(self, count):
    for key, buf in orig_collect(self, count):
        state["last"] = now()
        T[(state["step"], key)].append(state["last"] - state["t0"])
        yield key, buf


S.BucketPump.submit, S.BucketPump.collect, S.SocketRing.__init__ = submit, collect, ring_init
if os.environ.get("NOSEND"):
    S._recv_into = recv_zeros

from meshtune.cli import main  # noqa: E402

out = tempfile.mkdtemp()
rank = int(os.environ.get("MLX_RANK", "0"))
code = main(["train", "--iters", "40", "--batch-size", "32", "--fine-tune-type", os.environ.get("KIND", "full"),
             "--num-layers", "-1", "--learning-rate", "1e-4", "--train.steps_per_report", "10",
             "--train.val_batches", "0", "--save-every", "40", "--parallel.grad_sync", os.environ.get("SYNC", "overlap"),
             "--parallel.bucket_mb", os.environ.get("BUCKET_MB", "0.25"), "--parallel.transport", "sockets",
             "--adapter-path", out])
if rank == 0:
    keys = sorted({k for _, k in T})
    print("bucket async_eval submit computed sent collected: ms from the previous step's last sum, mean of steps 10-30")
    for k in keys:
        rows = [T[(s, k)] for s in range(10, 30) if len(T[(s, k)]) == 5]
        if rows:
            m = np.mean(np.array(rows), axis=0)
            print(f"{k:6d} " + " ".join(f"{v * 1e3:8.2f}" for v in m))
sys.exit(code)
