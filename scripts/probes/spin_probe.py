"""Development probe for the data-parallel issue (see scripts/probes/run_shaped.py to run it on the shaped link)."""
import time
import mlx.core as mx
g = mx.distributed.init(backend="ring")
buf = mx.random.normal((8 * 2**20,)); mx.eval(buf)
mx.eval(mx.distributed.all_sum(buf + 0, group=g))
w, c = time.perf_counter(), time.process_time()
for _ in range(3):
    mx.eval(mx.distributed.all_sum(buf + 0, group=g))
print(f"rank {g.rank()}: all_sum 32MB x3 wall {1e3*(time.perf_counter()-w):.0f} ms, cpu {1e3*(time.process_time()-c):.0f} ms", flush=True)
