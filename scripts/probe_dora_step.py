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
from meshtune.adapters.base_path import dense_weight_for
from meshtune.adapters import adapted_linear as AL
from meshtune.adapters.adapted_linear import adapted_linear
from meshtune.bench import adapters as B
from meshtune.bench.models import Shape

ORIGINAL = D.DoRALinear.__call__



def v_const(self, x):
    """Bound: LoRA's adapted product times a constant row scale (no norm, no m-gradient)."""
    if not self.training:
        return ORIGINAL(self, x)
    dense = dense_weight_for(self.linear, x.size // x.shape[-1])
    if dense is None:
        return ORIGINAL(self, x)
    rs = mx.stop_gradient(self.m / mx.sqrt(self._w_sq)).astype(x.dtype)
    y = rs * adapted_linear(x, dense, self.lora_a, self.lora_b, self.scale, x_lora=self.dropout(x))
    return y + self.linear["bias"] if "bias" in self.linear else y


# Candidate CUDA kernels for DoRA's small per-layer ops (untested on a GPU when written:
# check_exact below compares each variant's loss and gradients with the current code).
# Without CUDA the variants run the kernels' arithmetic in MLX ops instead.
_NORM = """
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < OUT) {
        float c[R];
        float cross = 0.0f;
        for (int k = 0; k < R; ++k) {
            c[k] = b[k * OUT + i];
            cross += c[k] * static_cast<float>(p[k * OUT + i]);
        }
        float quad = 0.0f;
        for (int k = 0; k < R; ++k) {
            float t = 0.0f;
            for (int l = 0; l < R; ++l) t += gram[k * R + l] * c[l];
            quad += c[k] * t;
        }
        float sc = s[0];
        float sq = w_sq[i] + 2.0f * sc * cross + sc * sc * quad;
        norm[i] = sqrtf(fmaxf(sq, 0.0f));
    }
"""
_MGRAD = """
    int lane = threadIdx.x & 31;
    int group = threadIdx.x >> 5;
    int col = blockIdx.x * 32 + lane;
    __shared__ float part[8][32];
    float acc = 0.0f;
    if (col < NCOLS) {
        for (int t = group; t < NROWS; t += 8)
            acc += static_cast<float>(g[t * NCOLS + col]) * static_cast<float>(y[t * NCOLS + col]);
    }
    part[group][lane] = acc;
    __syncthreads();
    if (group == 0 && col < NCOLS) {
        float sum = 0.0f;
        for (int k = 0; k < 8; ++k) sum += part[k][lane];
        float den = static_cast<float>(rs[col]) * norm[col];
        out[col] = den == 0.0f ? 0.0f : sum / den;
    }
"""
_kernels = {}


def _kernel(name, inputs, outputs, source):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source)
    return _kernels[name]


def norm_kernel(proj_rows, a, b, w_sq, scale):
    """AL.dora_norm in one kernel after the r x r Gram: a thread per output row."""
    r, out = proj_rows.shape
    gram = a.T @ a.astype(mx.float32)
    k = _kernel("probe_dora_norm", ["p", "b", "gram", "w_sq", "s"], ["norm"], _NORM)
    return k(inputs=[proj_rows, b.astype(mx.float32), gram, w_sq, mx.array([scale], dtype=mx.float32)],
             template=[("R", r), ("OUT", out)], grid=(((out + 255) // 256) * 256, 1, 1),
             threadgroup=(256, 1, 1), output_shapes=[(out,)], output_dtypes=[mx.float32])[0]


def mgrad_kernel(g, y, rs, norm):
    """AL.magnitude_grad in one kernel: 32 columns x 8 row groups a block, summed in shared memory."""
    rows, cols = g.shape
    k = _kernel("probe_dora_mgrad", ["g", "y", "rs", "norm"], ["out"], _MGRAD)
    return k(inputs=[g, y, rs, norm], template=[("NCOLS", cols), ("NROWS", rows)],
             grid=(((cols + 31) // 32) * 256, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(cols,)], output_dtypes=[mx.float32])[0]


ORIGINAL_NORM, ORIGINAL_MGRAD = AL.dora_norm, AL.magnitude_grad


def _with(norm=None, mgrad=None):
    """The current layer with AL's norm and m-gradient swapped. Left swapped after the call:
    the backward (where magnitude_grad runs) is traced after the forward returns."""
    def variant(self, x):
        AL.dora_norm, AL.magnitude_grad = norm or ORIGINAL_NORM, mgrad or ORIGINAL_MGRAD
        return ORIGINAL(self, x)
    return variant


def norm_like_kernel(proj_rows, a, b, w_sq, scale):
    """The norm kernel's arithmetic in MLX ops: where CUDA is absent, check_exact tests the swap and the math."""
    c = b.astype(mx.float32)  # (r, out): c[k, i]
    cross = (c * proj_rows.astype(mx.float32)).sum(axis=0)
    quad = (c * ((a.T @ a.astype(mx.float32)) @ c)).sum(axis=0)
    return mx.sqrt(mx.maximum(w_sq + 2 * scale * cross + scale * scale * quad, 0.0))


def mgrad_like_kernel(g, y, rs, norm):
    den = rs.astype(mx.float32) * norm
    total = (g.astype(mx.float32) * y.astype(mx.float32)).sum(axis=0)
    return mx.where(den == 0, 0.0, total / mx.where(den == 0, 1.0, den))


CUDA = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
NORM, MGRAD = (norm_kernel, mgrad_kernel) if CUDA else (norm_like_kernel, mgrad_like_kernel)
VARIANTS = {
    "current": _with(),
    "bound: const scale": v_const,
    "norm kernel": _with(norm=NORM),
    "m-grad kernel": _with(mgrad=MGRAD),
    "both kernels": _with(norm=NORM, mgrad=MGRAD),
}


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
    AL.dora_norm, AL.magnitude_grad = ORIGINAL_NORM, ORIGINAL_MGRAD


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
