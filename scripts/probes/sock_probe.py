"""Development probe for the data-parallel issue (see scripts/probes/run_shaped.py to run it on the shaped link)."""
import json, os, socket, threading, time
import numpy as np
import mlx.core as mx
rank = int(os.environ["MLX_RANK"])
hosts = json.load(open(os.environ["MLX_HOSTFILE"]))
ip0 = hosts[0][0].split(":")[0] if isinstance(hosts[0], list) else hosts[0].split(":")[0]
ip1 = hosts[1][0].split(":")[0] if isinstance(hosts[1], list) else hosts[1].split(":")[0]
PORT = 47123
if rank == 0:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((ip0, PORT)); srv.listen(1)
    conn, _ = srv.accept()
else:
    for _ in range(100):
        try:
            conn = socket.create_connection((ip0, PORT)); break
        except OSError:
            time.sleep(0.1)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = np.random.rand(8 * 2**20).astype(np.float32)  # 32 MB
out = np.empty_like(buf)
def exchange():
    t = threading.Thread(target=lambda: conn.sendall(memoryview(buf).cast("B")))
    t.start()
    view = memoryview(out).cast("B"); got = 0
    while got < len(view):
        got += conn.recv_into(view[got:])
    t.join()
    return buf + out
a = mx.random.normal((512, 512)); mx.eval(a)
def compute():
    x = a
    for _ in range(40):
        x = mx.tanh(x @ a)
    return x
def t(fn, n=3):
    fn(); ts = []
    for _ in range(n):
        tic = time.perf_counter(); fn(); ts.append(time.perf_counter() - tic)
    return sorted(ts)[n // 2] * 1e3
c = t(lambda: mx.eval(compute()))
e = t(exchange)
def both():
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", exchange())); th.start()
    mx.eval(compute()); th.join()
b = t(both)
cpu0 = time.process_time(); w0 = time.perf_counter(); exchange(); 
print(f"rank {rank}: compute {c:.0f} ms, socket exchange 32MB {e:.0f} ms (cpu {1e3*(time.process_time()-cpu0):.0f} of {1e3*(time.perf_counter()-w0):.0f} ms), both {b:.0f} ms", flush=True)
