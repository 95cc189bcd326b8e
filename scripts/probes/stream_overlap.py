"""Whether MLX runs work on a second GPU stream beside the default one (adapters issue, DoRA's step).

Development probe: python scripts/probes/stream_overlap.py
DoRA's extra work in a step is memory-bound (the row norms' pass over W, m's column sums
over g and y) while the products around it are compute-bound; if MLX's CUDA backend runs
two streams at once, that work could hide behind the products. Times, eager and under
mx.compile: a chain of bf16 products alone; column sums alone; both on one stream; both
with the sums on a second stream. Median of 9.
"""
import mlx.core as mx

from _steps import median_ms

T, IN, OUT, N = (4096, 2048, 6144, 12) if mx.default_device() == mx.gpu else (256, 256, 512, 3)
main, side = mx.default_stream(mx.default_device()), mx.new_stream(mx.default_device())
key = mx.random.key(0)
x = mx.random.normal((T, IN), key=key).astype(mx.bfloat16)
ws = [mx.random.normal((OUT, IN), key=mx.random.key(i)).astype(mx.bfloat16) * 0.02 for i in range(N)]
gs = [mx.random.normal((T, OUT), key=mx.random.key(100 + i)).astype(mx.bfloat16) for i in range(N)]
ys = [mx.random.normal((T, OUT), key=mx.random.key(200 + i)).astype(mx.bfloat16) for i in range(N)]
mx.eval(x, ws, gs, ys)


def products(x):
    return [x @ w.T for w in ws]


def sums(stream):
    with mx.stream(stream):
        return [(g.astype(mx.float32) * y.astype(mx.float32)).sum(axis=0) for g, y in zip(gs, ys)]


def both(stream):
    return products(x) + sums(stream)


cases = {
    "products alone": lambda: products(x),
    "column sums alone": lambda: sums(main),
    "both, one stream": lambda: both(main),
    "both, sums on a second stream": lambda: both(side),
}
print(f"mlx {mx.__version__} {mx.default_device()}: {N} products {T}x{IN} @ {IN}x{OUT} bf16, {N} column sums of g*y ({T}x{OUT})")
for compiled in (False, True):
    for name, fn in cases.items():
        f = mx.compile(fn) if compiled else fn
        print(f"  {'compiled' if compiled else 'eager':<9} {name:<32} {median_ms(f, 9, warmup=1):8.2f} ms", flush=True)
