"""The folded norm launch on a 4-bit base read packed against the same launch on its dequantized copy.

Development probe (adapters issue), one GPU: the outputs' largest differences, mx.dequantize against
(q * scale rounded) + bias rounded, and each launch's time (and the dequantize's) for the 1B model's
shapes, 28 layers a launch as in the step.
    python scripts/probes/packed_norms.py [--layers 28] [--reps 20]
"""
import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from meshtune.adapters import kernels


def timed(fn, reps):
    """Milliseconds a call of `fn` (its arrays evaluated), the mean of `reps` after one warm-up call."""
    mx.eval(fn())
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    k = mx.random.split(mx.random.key(0), 4)
    for out, inp in ((2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144)):
        n = args.layers
        base = nn.QuantizedLinear.from_linear(nn.Linear(inp, out, bias=False), group_size=64, bits=4)
        base.scales, base.biases = base.scales.astype(mx.bfloat16), base.biases.astype(mx.bfloat16)
        packed = [kernels.packed_weight(base)] * n
        dense = mx.dequantize(base.weight, base.scales, base.biases, group_size=64, bits=4)
        a = [mx.random.normal((inp, 8), key=k[0]) / 8] * n
        b = [mx.random.normal((8, out), key=k[1]) / 8] * n
        m = [mx.random.uniform(0.5, 2.0, (out,), key=k[2])] * n
        s = [2.0] * n
        mx.eval(dense, a[0], b[0], m[0])
        # mx.dequantize against the kernel's arithmetic, in MLX ops
        shifts = mx.arange(8, dtype=mx.uint32) * 4
        q = ((base.weight[..., None] >> shifts) & 15).reshape(out, inp).astype(mx.float32)
        sc = mx.repeat(base.scales.astype(mx.float32), 64, axis=1)
        bi = mx.repeat(base.biases, 64, axis=1)
        for how, mine in (("(q s rounded) + b rounded", ((q * sc).astype(mx.bfloat16) + bi).astype(mx.bfloat16)),
                          ("q s + b in float32, rounded once", (q * sc + bi.astype(mx.float32)).astype(mx.bfloat16))):
            print(f"{out}x{inp}: mx.dequantize == {how}: {mx.array_equal(mine, dense).item()}, max diff "
                  f"{mx.abs(mine.astype(mx.float32) - dense.astype(mx.float32)).max().item():.3g}")
        got = kernels.row_norms_and_scaled_cuda(packed, a, b, s, m, factors=True)
        want = kernels.row_norms_and_scaled_cuda([dense] * n, a, b, s, m, factors=True)
        for name, g, w in zip(("norm", "W'", "rs", "A", "B'"), got, want):
            d = mx.abs(g[0].astype(mx.float32) - w[0].astype(mx.float32)).max().item()
            rel = d / max(mx.abs(w[0].astype(mx.float32)).max().item(), 1e-30)
            print(f"  {name:5s} max |diff| {d:.3g} (of the largest: {rel:.3g})")
        t_packed = timed(lambda: kernels.row_norms_and_scaled_cuda(packed, a, b, s, m, factors=True), args.reps)
        t_dense = timed(lambda: kernels.row_norms_and_scaled_cuda([dense] * n, a, b, s, m, factors=True), args.reps)
        t_deq = timed(lambda: [mx.dequantize(base.weight, base.scales, base.biases, group_size=64, bits=4)
                               for _ in range(n)], args.reps)
        print(f"  ms a launch of {n}: packed {t_packed:.3f}   dense {t_dense:.3f}   (+ {n} dequantizes {t_deq:.3f})")


if __name__ == "__main__":
    main()
