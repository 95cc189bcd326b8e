"""What packing LoRA gradients into buckets costs per step on this device (data-parallel issue probe).

    python scripts/probes/pack_cost.py   # 1b preset, LoRA rank 8 on every linear: ~230 small float32 arrays
"""
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from meshtune.bench.models import PRESETS, Shape, add_adapters, build_model
from meshtune.parallel.data_parallel import _bucket_groups, _pack, _unpack

p = PRESETS["1b"]
shape = Shape(arch="qwen3", **{k: p[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")})
model = build_model(shape, mx.bfloat16, quantized=False, seed=0)
add_adapters(model, impl="meshtune", kind="lora", num_layers=-1, rank=8, scale=20.0)
flat = tree_flatten(model.trainable_parameters())
arrays = [v * 1.0 for _, v in flat]
mx.eval(arrays)
print(f"{len(arrays)} arrays, {sum(a.nbytes for a in arrays) / 2**20:.1f} MB")


def packed(arrays, mb):
    out = list(arrays)
    for members in _bucket_groups([(k, a) for (k, _), a in zip(flat, arrays)], "overlap", mb):
        parts = _unpack(_pack([arrays[i] for i in members]) * 1.0, [arrays[i] for i in members])
        for i, v in zip(members, parts):
            out[i] = v
    return out


cases = {"identity (x1.0)": lambda xs: [x * 1.0 for x in xs],
         "pack+unpack 25 MB": lambda xs: packed(xs, 25.0),
         "pack+unpack 1 MB": lambda xs: packed(xs, 1.0)}
for name, fn in cases.items():
    f = mx.compile(fn)
    for _ in range(3):
        mx.eval(f(arrays))
    t = []
    for _ in range(20):
        tic = time.perf_counter()
        mx.eval(f(arrays))
        t.append(time.perf_counter() - tic)
    print(f"{name:<22} {sorted(t)[10] * 1e3:7.2f} ms", flush=True)
