"""What a lazy array closed over by a compiled function costs: it is recomputed on every call.

Development probe (adapters issue; why DoRA.set_base evaluates ||w_i||^2 at once):
    python scripts/probes/lazy_constant.py
One 4000 x 4000 float32 weight; f = compile(x * c) with c = ||w_i|| left lazy, then evaluated first.
"""
import time

import mlx.core as mx

w = mx.random.normal((4000, 4000))
mx.eval(w)
for evaluated in (False, True):
    c = mx.sqrt((w * w).sum(axis=-1))
    if evaluated:
        mx.eval(c)
    f = mx.compile(lambda x: x * c)
    x = mx.ones((4000,))
    mx.eval(f(x))
    tic = time.perf_counter()
    for _ in range(50):
        mx.eval(f(x))
    print(f"{'evaluated' if evaluated else 'lazy':<10} {(time.perf_counter() - tic) / 50 * 1e3:8.3f} ms a call", flush=True)
