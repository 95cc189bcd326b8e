"""Where DoRA's extra step time goes in the whole 1B model, and which rewrite removes it.

Development probe (adapters issue): python scripts/probe_dora_step.py [--preset 1b] [--bases bf16,4bit]
Each variant swaps DoRALinear's training forward; LoRA is the baseline. Timed like
`meshtune bench adapters` (interleaved rounds, median). The bound variants drop work
(no norm, no m-gradient) and are not DoRA: they only show what each part costs.
"""
import argparse
import sys

import mlx.core as mx

from meshtune.adapters import dora as D
from meshtune.adapters.base_path import dense_weight_for, linear_forward
from meshtune.adapters.kernels import column_dot
from meshtune.bench import adapters as B
from meshtune.bench.models import PRESETS, Shape

ORIGINAL = D.DoRALinear.__call__
_kernels = {}


def _cuda() -> bool:
    return getattr(mx, "cuda", None) is not None and mx.cuda.is_available()


def inv_norm_kernel(w, a, bs, gram, w_sq):
    """1 / ||w_i + s b_i A^T|| per row in one kernel: one block per row, A's r columns in registers."""
    if "inv" not in _kernels:
        _kernels["inv"] = mx.fast.cuda_kernel(
            name="dora_inv_norm", input_names=["w", "a", "bs", "gram", "w_sq"], output_names=["inv"],
            source="""
                __shared__ float part[R * 256];
                int row = blockIdx.x;
                int t = threadIdx.x;
                float acc[R];
                for (int k = 0; k < R; ++k) acc[k] = 0.0f;
                for (int j = t; j < IN; j += 256) {
                    float wv = static_cast<float>(w[row * IN + j]);
                    for (int k = 0; k < R; ++k) acc[k] += wv * a[j * R + k];
                }
                for (int k = 0; k < R; ++k) part[k * 256 + t] = acc[k];
                __syncthreads();
                for (int stride = 128; stride > 0; stride >>= 1) {
                    if (t < stride) {
                        for (int k = 0; k < R; ++k) part[k * 256 + t] += part[k * 256 + t + stride];
                    }
                    __syncthreads();
                }
                if (t == 0) {
                    float cross = 0.0f, quad = 0.0f;
                    for (int k = 0; k < R; ++k) {
                        float ck = bs[k * OUT + row];
                        cross += ck * part[k * 256];
                        float gk = 0.0f;
                        for (int l = 0; l < R; ++l) gk += gram[k * R + l] * bs[l * OUT + row];
                        quad += ck * gk;
                    }
                    float sq = w_sq[row] + 2.0f * cross + quad;
                    inv[row] = rsqrtf(fmaxf(sq, 1e-30f));
                }
            """)
    out, inn = w.shape
    r = a.shape[1]
    return _kernels["inv"](inputs=[w, a, bs, gram, w_sq], template=[("R", r), ("IN", inn), ("OUT", out)],
                           grid=(256 * out, 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[(out,)], output_dtypes=[mx.float32])[0]


def colsum(g, y):
    return column_dot(g, y, kernel=True)


def _dense_and_base(self, x):
    dense = dense_weight_for(self.linear, x.size // x.shape[-1])
    base = x @ dense.T if dense is not None else linear_forward(self.linear, x, bias=False)
    return dense, base


def _bias(self, y):
    return y + self.linear["bias"] if "bias" in self.linear else y


def v_const(self, x):
    if not self.training:
        return ORIGINAL(self, x)
    dense, base = _dense_and_base(self, x)
    rs = mx.stop_gradient(self.m / mx.sqrt(self._w_sq)).astype(x.dtype)
    return _bias(self, rs * (base + self.lora_out(x)))


def v_no_mgrad(self, x):
    if not self.training:
        return ORIGINAL(self, x)
    dense, base = _dense_and_base(self, x)
    rs = (mx.stop_gradient(self.m) / self.row_norm(dense)).astype(x.dtype)
    return _bias(self, rs * (base + self.lora_out(x)))


def v_no_norm(self, x):
    if not self.training:
        return ORIGINAL(self, x)
    dense, base = _dense_and_base(self, x)
    rs = (self.m / mx.stop_gradient(mx.sqrt(self._w_sq))).astype(x.dtype)
    return _bias(self, rs * (base + self.lora_out(x)))


def _kernel_inv(self, dense):
    a = mx.stop_gradient(self.lora_a)
    bs = mx.stop_gradient(self.scale * self.lora_b)
    return mx.stop_gradient(inv_norm_kernel(dense, a, bs, a.T @ a, self._w_sq))


def v_kernel_norm(self, x):
    if not self.training:
        return ORIGINAL(self, x)
    dense, base = _dense_and_base(self, x)
    rs = (self.m * _kernel_inv(self, dense)).astype(x.dtype)
    return _bias(self, rs * (base + self.lora_out(x)))


def _fused(self, x, rs, dense, use_kernel):
    """The layer as one custom function: backward keeps x and the output, gives rs its column sum."""
    s = self.scale
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])

    @mx.custom_function
    def layer(x2, a, b, rs):
        z = x2 @ dense.T + (s * ((x2 @ a) @ b)).astype(x2.dtype)
        return rs * z

    @layer.vjp
    def layer_vjp(primals, g, out):
        x2, a, b, rs = primals
        gz = g * rs
        gzb = gz @ b.T.astype(gz.dtype)  # (T, r)
        gx = gz @ dense + (s * (gzb.astype(mx.float32) @ a.T)).astype(gz.dtype)
        ga = s * (x2.T @ gzb).astype(mx.float32)
        gb = s * ((x2 @ a.astype(x2.dtype)).T @ gz).astype(mx.float32)
        if use_kernel:
            gsum = colsum(g, out)
        else:
            gsum = (g * out).astype(mx.float32).sum(axis=0)
        safe = mx.where(rs == 0, mx.ones_like(rs), rs).astype(mx.float32)
        return gx, ga, gb, (gsum / safe).astype(rs.dtype)

    return layer(x2, self.lora_a, self.lora_b, rs).reshape(*shape[:-1], -1)


def v_fused(self, x, use_kernel=False, kernel_norm=False):
    if not self.training:
        return ORIGINAL(self, x)
    dense = dense_weight_for(self.linear, x.size // x.shape[-1])
    if dense is None:
        return ORIGINAL(self, x)
    inv = _kernel_inv(self, dense) if kernel_norm else 1.0 / self.row_norm(dense)
    rs = (self.m * inv).astype(x.dtype)
    return _bias(self, _fused(self, x, rs, dense, use_kernel))


VARIANTS = {
    "current": ORIGINAL,
    "bound: const scale": v_const,
    "bound: no m-grad": v_no_mgrad,
    "bound: no norm": v_no_norm,
    "fused vjp": v_fused,
}
if _cuda():
    VARIANTS.update({
        "kernel norm": v_kernel_norm,
        "fused vjp + colsum kernel": lambda s, x: v_fused(s, x, use_kernel=True),
        "fused vjp + both kernels": lambda s, x: v_fused(s, x, use_kernel=True, kernel_norm=True),
    })


def check_exact(shape, a, dtype):
    """Every real (non-bound) variant's loss and gradients against the current code on a small case."""
    import mlx.nn as nn

    from meshtune.bench.models import add_adapters, build_model, perturb_adapters

    small = Shape(arch="qwen3", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    model = build_model(small, dtype, quantized=False, seed=0)
    add_adapters(model, impl="meshtune", kind="dora", num_layers=-1, rank=8, scale=20.0)
    perturb_adapters(model, seed=1)
    model.train()
    tok = mx.random.randint(0, 512, (2, 65), key=mx.random.key(3))

    def loss(model):
        logits = model(tok[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tok[:, 1:]).mean()

    D.DoRALinear.__call__ = ORIGINAL
    ref_l, ref_g = nn.value_and_grad(model, loss)(model)
    from mlx.utils import tree_flatten
    ref = dict(tree_flatten(ref_g))
    for name, fn in VARIANTS.items():
        if name.startswith("bound") or name == "current":
            continue
        D.DoRALinear.__call__ = fn
        l, g = nn.value_and_grad(model, loss)(model)
        got = dict(tree_flatten(g))
        worst = max((mx.abs(got[k] - v).max() / (mx.abs(v).max() + 1e-12)).item() for k, v in ref.items())
        print(f"check {name:<28} loss diff {abs(l.item() - ref_l.item()):.2e}  worst rel grad diff {worst:.2e}", flush=True)
    D.DoRALinear.__call__ = ORIGINAL


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--bases", default="bf16,4bit")
    p.add_argument("--only", default="")
    args, rest = p.parse_known_args()
    a = B._settings(["--preset", args.preset, *rest])
    shape = Shape(arch=a.arch, layers=a.layers, hidden=a.hidden, intermediate=a.intermediate,
                  heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab)
    dtype = mx.bfloat16 if not B._on_cpu() else mx.float32
    check_exact(shape, a, dtype)
    variants = {k: v for k, v in VARIANTS.items() if not args.only or k in args.only.split(",")}
    for base in args.bases.split(","):
        steps = {"lora": B.build_step("meshtune", "lora", base, a, shape, dtype)}
        for name, fn in variants.items():
            # Each variant's model traces its compiled step with its own forward at first call.
            D.DoRALinear.__call__ = fn
            run = B.build_step("meshtune", "dora", base, a, shape, dtype)
            run()

            def bound(run=run, fn=fn):
                D.DoRALinear.__call__ = fn
                return run()
            steps[name] = bound
        ms = B.time_steps(steps, a)
        lora = ms["lora"]
        print(f"{base}: batch {a.batch_size} x {a.seq_len}, {a.steps} steps in {a.rounds} rounds")
        for k, v in ms.items():
            print(f"  {base} {k:<28} {v * 1e3:8.2f} ms  {v / lora:5.3f}x LoRA", flush=True)
        del steps
        B._release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
