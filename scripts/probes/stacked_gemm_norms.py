"""DoRA's folded norms and W' for a shape's layers: meshtune's launch against MLX ops on stacked weights.

Development probe (adapters issue), one GPU. The norm launch (kernels.row_norms_and_scaled_cuda) runs well
under the memory's speed on an H200 (~0.5-0.7 TB/s by the bytes it moves: scripts/probes/packed_norms.py).
The alternative timed here needs a shape's frozen weights held as one (n, out, in) array (each layer's a view
of it): then W A for all its layers is one batched matmul, the norms DESIGN.md's identity in a few small ops,
and W' = rs W one elementwise multiply, each a single node however many layers. Same outputs (norm, W').
    python scripts/probes/stacked_gemm_norms.py [--reps 10]
"""
import argparse
import os
import sys

import mlx.core as mx

from meshtune.adapters import kernels

sys.path.insert(0, os.path.dirname(__file__))
from packed_norms import timed  # noqa: E402

SHAPES = ((32, 2048, 2048), (32, 1024, 2048), (32, 6144, 2048), (16, 2048, 6144))  # the 1B step's (layers, out, in)


def stacked_ops(ws, w_sq, a, b, m, s):
    """(norms (n, out), W' (n, out, in)) from stacked W (n, out, in), A (n, in, r), B (n, r, out), float32 m, w_sq."""
    proj = (ws @ a.astype(ws.dtype)).astype(mx.float32)  # (n, out, r): W A, one batched matmul
    bt = b.swapaxes(-1, -2)  # (n, out, r)
    gram = a.swapaxes(-1, -2) @ a  # (n, r, r)
    sq = w_sq + (bt * ((2 * s) * proj + (s * s) * (bt @ gram))).sum(-1)
    norm = mx.sqrt(mx.maximum(sq, 0.0))
    rs = (m / norm).astype(ws.dtype)
    return norm, rs[..., None] * ws


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the shapes (a CPU check)")
    args = p.parse_args()
    k = mx.random.split(mx.random.key(0), 4)
    totals = [0.0, 0.0, 0.0, 0.0]
    print("ms for a shape's layers (mean of reps)   launch   stacked ops   batched W A alone   W' alone")
    for n, out, inp in SHAPES:
        out, inp = max(32, int(out * args.scale)), max(64, int(inp * args.scale))
        ws = (mx.random.normal((n, out, inp), key=k[0]) / 32).astype(mx.bfloat16)
        a = mx.random.normal((n, inp, 8), key=k[1]) / 8
        b = mx.random.normal((n, 8, out), key=k[2]) / 8
        m = mx.random.uniform(0.5, 2.0, (n, out), key=k[3])
        w32 = ws.astype(mx.float32)
        w_sq = (w32 * w32).sum(-1)
        mx.eval(ws, a, b, m, w_sq)
        views, av, bv, mv = list(ws), list(a), list(b), list(m)  # a layer's arrays: views of the stacked ones
        launch = lambda: kernels.row_norms_and_scaled_cuda(views, av, bv, [20.0] * n, mv)[:2]  # noqa: E731
        ops = mx.compile(lambda: stacked_ops(ws, w_sq, a, b, m, 20.0))
        gemm = mx.compile(lambda: ws @ a.astype(ws.dtype))
        scale_only = mx.compile(lambda: (m / 2).astype(ws.dtype)[..., None] * ws)
        got_norm, got_w = ops()
        want_norm, want_w = launch()
        d = mx.abs(mx.concatenate(want_norm) - got_norm.reshape(-1)).max().item()
        t = [timed(f, args.reps) for f in (launch, ops, gemm, scale_only)]
        totals = [x + y for x, y in zip(totals, t)]
        print(f"  {n} x {out} x {inp:<6d}  {t[0]:8.3f}  {t[1]:12.3f}  {t[2]:18.3f}  {t[3]:9.3f}   (norms differ by {d:.2g})")
    print(f"  all four shapes       {totals[0]:8.3f}  {totals[1]:12.3f}  {totals[2]:18.3f}  {totals[3]:9.3f}")


if __name__ == "__main__":
    main()
