"""GPU time of DoRA's folded launch (norms, W', rs, A and B') shape by shape, staged A against resident A.

Development probe (adapters issue): for each weight shape of the bench's 1b model, the launch a
training step makes for that shape's layers (every layer its own W, A, B, m), timed alone
(--launches of it evaluated together, synchronised before and after, median of --reps) in each
kernel layout, interleaved rep by rep,
with the bytes it moves (W read, W' written) over its time.

    python scripts/probes/folded_launch_shapes.py [--reps 15] [--bits 0|4] [--merged]

With --merged, each layout writing W' = rs W and the merged W' = rs (W + s (A B)^T) (kernels.MERGED_FOLD).
"""
import argparse
import statistics
import time

import mlx.core as mx

from meshtune.adapters import kernels as K

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=15)
p.add_argument("--rank", type=int, default=8)
p.add_argument("--bits", type=int, default=0, help="0: a bfloat16 base; 4: a 4-bit base read packed")
p.add_argument("--launches", type=int, default=4,
               help="launches a timing, evaluated together (the synchronisation and dispatch floor shared)")
p.add_argument("--merged", action="store_true", help="each layout unmerged and merged (kernels.MERGED_FOLD)")
args = p.parse_args()
H, I, KV = 2048, 6144, 1024
SHAPES = {(H, H): 32, (KV, H): 32, (I, H): 32, (H, I): 16}  # (out, in): layers of the 1b model
LAYOUTS = {"staged": dict(_RESIDENT_A=False), "staged, tiles 1024": dict(_RESIDENT_A=False, FOLDED_TILE_ROWS=1024),
           "resident 128x2": dict(RESIDENT_ROWS=128, RESIDENT_BATCH=2)}
if args.merged:
    LAYOUTS = {"staged": dict(_RESIDENT_A=False), "staged merged": dict(_RESIDENT_A=False, merged=True),
               "resident": {}, "resident merged": dict(merged=True)}


def layers_of(out, inp, n):
    ws, a, b, m = [], [], [], []
    for _ in range(n):
        w = (mx.random.normal((out, inp)) * inp ** -0.5).astype(mx.bfloat16)
        if args.bits:
            w = K.PackedWeight(*mx.quantize(w, group_size=64, bits=args.bits), bits=args.bits, group_size=64)
        ws.append(w)
        a.append(mx.random.normal((inp, args.rank)) * 0.02)
        b.append(mx.random.normal((args.rank, out)) * 0.01)
        m.append(mx.ones((out,)))
    mx.eval(ws, a, b, m)
    return ws, a, b, m


def launch(ws, a, b, m, settings):
    settings = dict(settings)
    merged = settings.pop("merged", False)
    saved = {k: getattr(K, k) for k in settings}
    for k, v in settings.items():
        setattr(K, k, v)
    try:
        return K.row_norms_and_scaled_cuda(ws, a, b, [20.0] * len(ws), m, factors=K.writes_factors(), stacked=True,
                                           merged=merged)
    finally:
        for k, v in saved.items():
            setattr(K, k, v)


print(f"{mx.default_device()}, rank {args.rank}, {'bf16' if not args.bits else f'{args.bits}-bit packed'} bases; "
      f"ms a launch ({args.launches} a timing, median of {args.reps}, layouts interleaved) and TB/s by W read + W' written")
print(f"{'shape (out x in) x layers':28s}" + "".join(f"{k:>18s}" for k in LAYOUTS))
for (out, inp), n in SHAPES.items():
    ws, a, b, m = layers_of(out, inp, n)
    times = {k: [] for k in LAYOUTS}
    for rep in range(args.reps + 1):
        for name, settings in LAYOUTS.items():
            mx.synchronize()
            t0 = time.perf_counter()
            outs = [launch(ws, a, b, m, settings) for _ in range(args.launches)]
            mx.eval([[x for part in o[1:] for x in part] + [o[0][0].launch] for o in outs])
            t1 = time.perf_counter()
            if rep:
                times[name].append((t1 - t0) / args.launches)
            del outs
    moved = n * out * inp * (2 + (args.bits / 8 if args.bits else 2))
    cells = []
    for name in LAYOUTS:
        ms = statistics.median(times[name]) * 1e3
        cells.append(f"{ms:8.3f} ({moved / ms / 1e9:4.2f})")
    print(f"{f'{out} x {inp} x {n}':28s}" + "".join(f"{c:>18s}" for c in cells), flush=True)
    del ws, a, b, m
