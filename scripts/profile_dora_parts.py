"""Which part of DoRA's training step costs what, on one 6144 x 2048 layer at 4096 tokens.

Development probe (adapters issue): python scripts/profile_dora_parts.py
"""
import time

import mlx.core as mx

from meshtune.adapters.dora import adapted_row_norm

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


@mx.custom_function
def scale_rows(s, y):
    return s * y


@scale_rows.vjp
def scale_rows_vjp(primals, cotangent, output):
    s, y = primals
    # d/ds as a matmul over tokens rather than a column reduction
    gs = (mx.ones((1, cotangent.shape[0]), dtype=cotangent.dtype) @ (cotangent * y)).reshape(s.shape)
    return gs.astype(s.dtype), cotangent * s


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
}


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
    for k, f in fns.items():
        res[k].append(timed(lambda: f(params)))
for k, v in res.items():
    print(f"{k:<20} {sorted(v)[1]:.3f} ms", flush=True)
