"""Per-layer cost of LoRA vs DoRA through meshtune's adapted_linear, and of DoRA's pieces alone.

Development probe (adapters issue): python scripts/profile_adapted_linear.py  (one 6144 x 2048
layer at 4096 tokens, bf16; each line a compiled value_and_grad or a lone op, median ms).
OUT=1024 IN=2048: a k/v-projection's shape. On CUDA "row scale" and "cotangent" are
kernels.py's kernels, elsewhere the MLX ops; "cotangent" takes an output already computed.
"""
import os
import time

import mlx.core as mx

from meshtune.adapters import adapted_linear as AL
from meshtune.adapters import kernels
from meshtune.adapters.adapted_linear import adapted_linear, adapted_row_norm, dora_cotangent, dora_row_scale

T = int(os.environ.get("TOKENS", 4096))  # TOKENS=128 DTYPE=float32: the CPU 1b bench's batch
IN, OUT, R, S = int(os.environ.get("IN", 2048)), int(os.environ.get("OUT", 6144)), 8, 20.0
dt = getattr(mx, os.environ.get("DTYPE", "bfloat16"))
W = (mx.random.normal((OUT, IN)) * IN ** -0.5).astype(dt)
x = mx.random.normal((T, IN)).astype(dt)
w_sq = (W.astype(mx.float32) ** 2).sum(-1)
p = {"a": mx.random.normal((IN, R)) * 0.02, "b": mx.random.normal((R, OUT)) * 0.01, "m": mx.sqrt(w_sq)}
g = mx.random.normal((T, OUT)).astype(dt)


def inverse_row_norm(a, b):
    return 1 / adapted_row_norm(w_sq, (W @ a.astype(dt)).astype(mx.float32), b.T, a.T @ a, S)


rs0 = (p["m"] * inverse_row_norm(p["a"], p["b"])).astype(dt)
y0 = x @ W.T
mx.eval(W, x, w_sq, p, g, rs0, y0)


def row_scale(p):
    if kernels.on_cuda():
        norm = kernels.row_norms_cuda([W], [p["a"]], [p["b"]], [S])[0]
        return norm, (p["m"] / norm).astype(dt)
    return dora_row_scale(p["a"].astype(dt).T @ W.T, p["a"], p["b"], w_sq, p["m"], S, dt)


def loss(y):
    return (y * g).astype(mx.float32).sum()


cases = {
    "lora step": mx.compile(mx.value_and_grad(lambda p: loss(adapted_linear(x, W, p["a"], p["b"], S)))),
    "dora step": mx.compile(mx.value_and_grad(lambda p: loss(adapted_linear(x, W, p["a"], p["b"], S, magnitude=p["m"], w_sq=w_sq)))),
    "row scale (norm, rs)": mx.compile(row_scale),
    "cotangent (g rs, d m)": mx.compile(lambda p: kernels.cotangent_cuda(g, y0, p["m"], w_sq) if kernels.on_cuda()
                                        else dora_cotangent(g, y0, rs0, w_sq)),
    "x @ W.T alone": mx.compile(lambda p: x @ W.T),
    "g * rs": mx.compile(lambda p: g * rs0),
}


def timed(fn, n=40):
    for _ in range(5):
        mx.eval(fn(p))
    t = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(fn(p))
        t.append(time.perf_counter() - tic)
    return sorted(t)[len(t) // 2] * 1e3


def unpadded(fn):
    """fn traced with the extended product's rows left unpadded (ROW_MULTIPLE 1)."""
    def run(p):
        AL.ROW_MULTIPLE = 1
        try:
            return fn(p)
        finally:
            AL.ROW_MULTIPLE = 16
    return run


cases["dora step, rows unpadded"] = unpadded(
    mx.compile(mx.value_and_grad(lambda p: loss(adapted_linear(x, W, p["a"], p["b"], S, magnitude=p["m"], w_sq=w_sq)))))
res = {k: [] for k in cases}
for _ in range(3):
    for k, f in cases.items():
        res[k].append(timed(f))
for k, v in res.items():
    print(f"{k:<26} {sorted(v)[1]:.3f} ms", flush=True)
