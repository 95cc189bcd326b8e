"""Per-layer training cost of 4-bit LoRA vs DoRA (norm through the dense weight vs the quantized kernel).

A development probe for the adapters issue, run on the machine at hand:
    python scripts/profile_dora_layer.py
"""
import time

import mlx.core as mx
import mlx.nn as nn

from meshtune.adapters import DoRALinear, LoRALinear, set_base_path
from meshtune.adapters import base_path

set_base_path("auto")
SHAPES = [(6144, 2048), (2048, 6144), (2048, 2048), (1024, 2048)]
TOKENS = 4096


def layer(kind, out_dims, in_dims, quantized):
    mx.random.seed(0)
    lin = nn.Linear(in_dims, out_dims, bias=False)
    lin.set_dtype(mx.bfloat16)
    if quantized:
        lin = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    lay = (DoRALinear if kind.startswith("dora") else LoRALinear).from_base(lin, r=8, scale=20.0)
    lay.lora_b = mx.random.normal(lay.lora_b.shape) * 0.01
    lay.linear.freeze()
    if kind == "dora_qproj":  # the previous code: the norm's r rows through the quantized kernel
        lay._norm_terms_dense = lay._norm_terms
        lay._norm_terms = lambda dense=None, l=lay: DoRALinear._norm_terms(l, None)
    return lay


def timed(fn, n=30):
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    t = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        t.append(time.perf_counter() - tic)
    return sorted(t)[len(t) // 2] * 1e3


x = mx.random.normal((TOKENS, 1)).astype(mx.bfloat16)
for out_dims, in_dims in SHAPES:
    x = mx.random.normal((TOKENS, in_dims)).astype(mx.bfloat16)
    row = []
    for quantized in (False, True):
        for kind in ("lora", "dora", "dora_qproj"):
            if kind == "dora_qproj" and not quantized:
                continue
            lay = layer(kind, out_dims, in_dims, quantized)
            loss = lambda x, lay=lay: lay(x).astype(mx.float32).square().mean()
            vg = mx.compile(nn.value_and_grad(lay, loss))
            row.append((("4bit " if quantized else "bf16 ") + kind, timed(lambda: vg(x))))
    print(f"{out_dims}x{in_dims} @ {TOKENS} tokens, fwd+bwd ms: " + ", ".join(f"{k} {v:.3f}" for k, v in row),
          flush=True)
print("crossovers", base_path._crossovers)
