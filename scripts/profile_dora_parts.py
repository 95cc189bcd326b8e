"""Which part of DoRA's training step costs what, on one 6144 x 2048 layer at 4096 tokens.

Development probe (adapters issue): python scripts/profile_dora_parts.py
"""
import time
from functools import partial

import mlx.core as mx

from meshtune.adapters.adapted_linear import adapted_row_norm
from meshtune.adapters.kernels import column_dot

T, IN, OUT, R = 4096, 2048, 6144, 8
dt = mx.bfloat16
mx.random.seed(0)
W = (mx.random.normal((OUT, IN)) * IN ** -0.5).astype(dt)
x = mx.random.normal((T, IN)).astype(dt)
w_sq = (W.astype(mx.float32) ** 2).sum(-1)
params = {"a": mx.random.normal((IN, R)) * 0.02, "b": mx.random.normal((R, OUT)) * 0.01, "m": mx.sqrt(w_sq)}
mx.eval(W, x, w_sq, params)


def lora(p):
    return x @ W.T + (20.0 * ((x @ p["a"]) @ p["b"])).astype(dt)


def norm(p):
    a, b = mx.stop_gradient(p["a"]), mx.stop_gradient(p["b"])
    proj = (W @ a.astype(dt)).astype(mx.float32)
    return mx.stop_gradient(adapted_row_norm(w_sq, proj, b.T, a.T @ a, 20.0))


def row_scaler(column_sum):
    """s * y as a custom function whose d/ds is column_sum(cotangent, y)."""
    @mx.custom_function
    def scale(s, y):
        return s * y

    @scale.vjp
    def scale_vjp(primals, cotangent, output):
        s, y = primals
        return column_sum(cotangent, y).reshape(s.shape).astype(s.dtype), cotangent * s

    return scale


# d/ds as a matmul over tokens rather than a column reduction, or by meshtune's CUDA kernel.
scale_rows = row_scaler(lambda g, y: mx.ones((1, g.shape[0]), dtype=g.dtype) @ (g * y))
scale_rows_k = row_scaler(lambda g, y: column_dot(g, y, kernel=True))
colsum_product = partial(column_dot, kernel=True)


def lora_concat(p):
    # x and A's r rows through W in one product; the r rows give W A for the norm.
    a = mx.stop_gradient(p["a"])
    both = mx.concatenate([x, a.T.astype(dt)]) @ W.T
    base, proj = both[:T], both[T:].T.astype(mx.float32)
    b = mx.stop_gradient(p["b"])
    n = mx.stop_gradient(adapted_row_norm(w_sq, proj, b.T, a.T @ a, 20.0))
    return base + (20.0 * ((x @ p["a"]) @ p["b"])).astype(dt), n


@mx.custom_function
def dora_linear(x, a, b, s):
    """The whole DoRA linear as one function whose backward keeps x and the output, not y."""
    return s * (x @ W.T + (20.0 * ((x @ a) @ b)).astype(dt))


@dora_linear.vjp
def dora_linear_vjp(primals, cotangent, output):
    x, a, b, s = primals
    g = cotangent
    gy = g * s
    gyb = gy.astype(mx.float32) @ b.T  # (T, r)
    gx = gy @ W + (20.0 * (gyb @ a.T)).astype(dt)
    ga = 20.0 * (x.astype(mx.float32).T @ gyb)
    gb = 20.0 * ((x @ a).T @ gy.astype(mx.float32))
    safe = mx.where(s == 0, mx.ones_like(s), s)
    gs = ((g * output).astype(mx.float32).sum(axis=0) / safe.astype(mx.float32)).astype(s.dtype)  # y = out / s
    return gx, ga, gb, gs


def loss_of(out):
    return out.astype(mx.float32).square().mean()


variants = {
    "lora": lambda p: loss_of(lora(p)),
    "lora*const": lambda p: loss_of(mx.stop_gradient(p["m"] / w_sq).astype(dt) * lora(p)),
    "lora*m (m grad)": lambda p: loss_of((p["m"] / mx.stop_gradient(w_sq)).astype(dt) * lora(p)),
    "lora*m custom vjp": lambda p: loss_of(scale_rows((p["m"] / mx.stop_gradient(w_sq)).astype(dt), lora(p))),
    "norm only (no m)": lambda p: loss_of(mx.stop_gradient(p["m"] / norm(p)).astype(dt) * lora(p)),
    "dora": lambda p: loss_of((p["m"] / norm(p)).astype(dt) * lora(p)),
    "dora custom vjp": lambda p: loss_of(scale_rows((p["m"] / norm(p)).astype(dt), lora(p))),
    "lora*m kernel vjp": lambda p: loss_of(scale_rows_k((p["m"] / mx.stop_gradient(w_sq)).astype(dt), lora(p))),
    "dora kernel vjp": lambda p: loss_of(scale_rows_k((p["m"] / norm(p)).astype(dt), lora(p))),
    "dora fused vjp": lambda p: loss_of(dora_linear(x, p["a"], p["b"], (p["m"] / norm(p)).astype(dt))),
    "dora concat": lambda p: (lambda yn: loss_of((p["m"] / yn[1]).astype(dt) * yn[0]))(lora_concat(p)),
    "dora concat+kernel": lambda p: (lambda yn: loss_of(scale_rows_k((p["m"] / yn[1]).astype(dt), yn[0])))(lora_concat(p)),
}
if not mx.cuda.is_available():
    variants = {k: v for k, v in variants.items() if "kernel" not in k}


def timed(fn, n=50):
    for _ in range(5):
        mx.eval(fn())
    t = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(fn())
        t.append(time.perf_counter() - tic)
    return sorted(t)[len(t) // 2] * 1e3


fns = {k: mx.compile(mx.value_and_grad(f)) for k, f in variants.items()}
res = {k: [] for k in fns}
for _ in range(3):
    for k, f in list(fns.items()):
        try:
            res[k].append(timed(lambda: f(params)))
        except Exception as err:  # a kernel this build cannot compile: say so, time the rest
            print(f"{k}: failed: {err}", flush=True)
            fns.pop(k)
            res.pop(k)
for k, v in res.items():
    print(f"{k:<20} {sorted(v)[1]:.3f} ms", flush=True)
# The fused vjp's gradients against autodiff's.
ref = mx.grad(variants["dora"])(params)
got = mx.grad(variants["dora fused vjp"])(params)
print("fused vjp max rel grad diff", {k: (mx.abs(ref[k] - got[k]).max() / mx.abs(ref[k]).max()).item() for k in ref})
# The kernel's sum against MLX's own.
if mx.cuda.is_available():
    g = mx.random.normal((T, OUT)).astype(dt)
    y = mx.random.normal((T, OUT)).astype(dt)
    want = (g.astype(mx.float32) * y.astype(mx.float32)).sum(axis=0)
    print("kernel colsum max abs err", mx.abs(colsum_product(g, y) - want).max().item())
