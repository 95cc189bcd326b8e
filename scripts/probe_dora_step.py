"""Where DoRA's extra step time goes in the whole 1B model, and which rewrite removes it.

Development probe (adapters issue): python scripts/probe_dora_step.py [--preset 1b] [--bases bf16,4bit]
Each variant swaps DoRALinear's training forward; LoRA is the baseline. Timed like
`meshtune bench adapters` (interleaved rounds, median). The bound variants drop work
(no norm, no m-gradient) and are not DoRA: they only show what each part costs.
"""
import argparse
import sys

import mlx.core as mx

from meshtune.adapters import adapted_linear as AL
from meshtune.adapters import dora as D
from meshtune.adapters import kernels as K
from meshtune.adapters.base_path import dense_weight_for
from meshtune.adapters.adapted_linear import adapted_linear
from meshtune.bench import adapters as B
from meshtune.bench.models import Shape

ORIGINAL = D.DoRALinear.__call__
ON_CUDA = K.on_cuda


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


def _kernels(on):
    """The current layer with adapted_linear's CUDA kernels on (where CUDA is) or off (MLX ops).
    Left set after the call: the backward (where the cotangent kernel runs) is traced after the forward returns."""
    def variant(self, x):
        _reset()
        K.on_cuda = ON_CUDA if on else (lambda: False)
        return ORIGINAL(self, x)
    return variant


def _separate_rows(self, x):
    """MLX ops, W A as its own r-row product instead of r extra rows on the activations' product."""
    _reset()
    K.on_cuda = lambda: False
    AL.NORM_ROWS_ON_BASE_PRODUCT = False
    return ORIGINAL(self, x)


# The cotangent in one launch: kernels.cotangent_cuda's blocks (column strips by chunks of
# rows), then the last block of each strip to finish (a ticket from a counter) adds the
# strip's chunk sums in a fixed order and writes m's gradient, so the separate
# magnitude-gradient launch goes. The counters are a persistent zeroed array each last
# block resets; an earlier one-launch form (a block per 16 columns and every row, fewer
# blocks) lost at 380729a, docs/bench/probe_dora_step_h200.txt.
_LAST_BLOCK_SUM = """
    __threadfence();  // this block's row of part is visible to whichever block sums the strip
    __syncthreads();
    __shared__ unsigned int ticket;
    if (tid == 0) ticket = atomicAdd(const_cast<unsigned int*>(count) + blockIdx.x, 1u);
    __syncthreads();
    if (ticket == gridDim.y - 1) {
        for (int c = tid; c < CB; c += 256) {
            int col = blockIdx.x * CB + c;
            if (col < COLS) {
                float sum = 0.0f;
                for (int k = 0; k < (int)gridDim.y; ++k) sum += __ldcg(part + (long long)k * COLS + col);
                float den = static_cast<float>(rs[col]) * norm[col];
                dm[col] = den == 0.0f ? 0.0f : sum / den;
            }
        }
        if (tid == 0) const_cast<unsigned int*>(count)[blockIdx.x] = 0u;
    }
"""
ORIGINAL_COTANGENT = K.cotangent_cuda
COUNTERS = mx.zeros((4096,), dtype=mx.uint32)  # a strip is >= 32 columns; 4096 strips cover any layer here
mx.eval(COUNTERS)  # held evaluated: a lazy array closed over by the compiled step would be rebuilt each call


def one_launch_cotangent(g, y, rs, norm):
    rows, cols = g.shape
    vec = 16 // g.dtype.size
    vec = vec if cols % vec == 0 else 1
    strips = -(-cols // (32 * vec))
    assert strips <= COUNTERS.size
    chunk = -(-rows // max(1, min(-(-K._COTANGENT_BLOCKS // strips), rows // 32)))
    chunks = -(-rows // chunk)
    k = K._kernel("probe_dora_cotangent_last_block", ["g", "y", "rs", "norm", "count"], ["gz", "part", "dm"],
                  K._COTANGENT + _LAST_BLOCK_SUM)
    gz, _, dm = k(inputs=[g, y, rs, norm, COUNTERS],
                  template=[("ROWS", rows), ("COLS", cols), ("CHUNK", chunk), ("VEC", vec),
                            ("T", g.dtype), ("YT", y.dtype), ("RT", rs.dtype)],
                  grid=(strips * 256, chunks, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(rows, cols), (chunks, cols), (cols,)],
                  output_dtypes=[g.dtype, mx.float32, mx.float32])
    return gz, dm


def _one_launch(self, x):
    _reset()
    K.cotangent_cuda = one_launch_cotangent
    return ORIGINAL(self, x)


ORIGINAL_LAYOUT = K._WARPS, K._row_scale_layout, K._COTANGENT_BLOCKS


def _layout(warps, rows_per_warp, cotangent_blocks=ORIGINAL_LAYOUT[2]):
    """The current kernels with another row-scale block (warps x rows a warp) and cotangent grid
    (the defaults: 8 x 2 up to rank 16, 528 blocks); dora_kernel_cost.py times them alone."""
    def variant(self, x):
        _reset()
        K._WARPS, K._COTANGENT_BLOCKS = warps, cotangent_blocks
        K._row_scale_layout = lambda r, inp, wb: (rows_per_warp, *ORIGINAL_LAYOUT[1](r, inp, wb)[1:])
        return ORIGINAL(self, x)
    return variant


def _reset():
    K.on_cuda = ON_CUDA
    AL.NORM_ROWS_ON_BASE_PRODUCT = True
    K.cotangent_cuda = ORIGINAL_COTANGENT
    K._WARPS, K._row_scale_layout, K._COTANGENT_BLOCKS = ORIGINAL_LAYOUT


VARIANTS = {
    "current": _kernels(True),
    "MLX ops (no kernels)": _kernels(False),
    "MLX ops, separate W A product": _separate_rows,
    "one-launch cotangent (last block sums)": _one_launch,
    "row scale 4 warps x 1 row": _layout(4, 1),
    "row scale 8 warps x 1 row": _layout(8, 1),
    "cotangent 1056 blocks": _layout(8, 2, 1056),
    "bound: const scale": v_const,
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
    _reset()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--bases", default="bf16,4bit")
    p.add_argument("--only", default="")
    args, rest = p.parse_known_args()
    a = B._settings(["--preset", args.preset, *rest])
    shape = B.shape_of(a)
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
