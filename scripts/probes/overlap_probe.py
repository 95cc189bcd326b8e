"""Development probe for the data-parallel issue (see scripts/probes/run_shaped.py to run it on the shaped link)."""
import time
import mlx.core as mx
g = mx.distributed.init(backend="ring")
comm = mx.new_stream(mx.cpu)
a = mx.random.normal((512, 512)); mx.eval(a)
buf = mx.random.normal((8 * 2**20,)); mx.eval(buf)  # 32 MB
def compute():
    x = a
    for _ in range(40):
        x = mx.tanh(x @ a)
    return x
def t(fn, n=5):
    fn()
    ts = []
    for _ in range(n):
        tic = time.perf_counter(); fn(); ts.append(time.perf_counter() - tic)
    return sorted(ts)[n // 2] * 1e3
c = t(lambda: mx.eval(compute()))
s = t(lambda: mx.eval(mx.distributed.all_sum(buf + 0, group=g, stream=comm)))
def both():
    y = mx.distributed.all_sum(buf + 0, group=g, stream=comm)
    mx.async_eval(y)
    mx.eval(compute(), y)
b = t(both)
def seq():
    mx.eval(compute()); mx.eval(mx.distributed.all_sum(buf + 0, group=g))
q = t(seq)
print(f"rank {g.rank()}: compute {c:.1f} ms, all_sum 32MB {s:.1f} ms, both overlapped {b:.1f} ms, sequential {q:.1f} ms", flush=True)
