import mlx.core as mx
from meshtune.adapters.adapted_linear import adapted_row_norm

from _steps import median_ms
T, IN, OUT, R, S = 4096, 2048, 6144, 8, 20.0
dt = mx.bfloat16
W = (mx.random.normal((OUT, IN)) * IN ** -0.5).astype(dt)
x = mx.random.normal((T, IN)).astype(dt)
a = mx.random.normal((IN, R)) * 0.02
b = mx.random.normal((R, OUT)) * 0.01
w_sq = (W.astype(mx.float32) ** 2).sum(-1)
m = mx.sqrt(w_sq)
mx.eval(W, x, a, b, w_sq, m)
def chain(proj):
    return m / adapted_row_norm(w_sq, proj, b.T, a.T @ a, S)
cases = {
 "x@W.T": lambda: x @ W.T,
 "[x;aT]@W.T": lambda: mx.concatenate([x, a.T.astype(dt)]) @ W.T,
 "[x;aT]@W.T + chain": lambda: (lambda z: (z[:T], chain(z[T:].T.astype(mx.float32))))(mx.concatenate([x, a.T.astype(dt)]) @ W.T),
 "W@a bf16": lambda: W @ a.astype(dt),
 "aT@W.T bf16": lambda: a.T.astype(dt) @ W.T,
 "aT contiguous @W.T": lambda: mx.contiguous(a.T.astype(dt)) @ W.T,
 "chain (W@a)": lambda: chain((W @ a.astype(dt)).astype(mx.float32)),
 "chain (aT@W.T)": lambda: chain((a.T.astype(dt) @ W.T).T.astype(mx.float32)),
 "chain tiny ops only": lambda: chain(mx.zeros((OUT, R))),
 "gram only": lambda: a.T @ a,
}
def timed(fn, n=50):
    return median_ms(mx.compile(fn), n, warmup=5)
res = {k: [] for k in cases}
for _ in range(3):
    for k, f in cases.items(): res[k].append(timed(f))
for k, v in res.items(): print(f"{k:<24} {sorted(v)[1]:.4f} ms", flush=True)
# a chain of 20 norms in one graph: launch cost amortised?
def many():
    return [chain((W @ (a + i).astype(dt)).astype(mx.float32)) for i in range(20)]
def many_t():
    return [chain((((a + i).T.astype(dt)) @ W.T).T.astype(mx.float32)) for i in range(20)]
print("20 chains W@a", timed(many, 20) / 20)
print("20 chains aT@WT", timed(many_t, 20) / 20)
