"""Host time of a multi-layer launch's outputs: an output a layer against one array a kind split by layers.

Development probe (adapters issue). A step's DoRA norms are a launch per weight shape (up to 32 layers) with ~4
inputs and 3 outputs a layer. MLX gives each output of a primitive its own copy of the primitive's inputs, so a
launch with an output a layer carries n_in x n_out references to build, traverse and release; stacked (one output
a kind, the layers' rows one after another, mx.split into views) it carries n_in x 3. Here a stand-in primitive
(mx.depends on zeros, the inputs as its dependencies; small arrays, so the host's work is all there is) takes the
1B bench model's 112 layers in launches of k, eagerly and compiled, on the default device. Prints milliseconds to
build the outputs and to evaluate them, median of --reps.

    python scripts/probes/stacked_outputs.py [--reps 9]
"""
import argparse
import statistics
import time

import mlx.core as mx

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=9)
args = p.parse_args()

LAYERS, ROWS = 112, 8
inputs = [mx.ones((ROWS,)) for _ in range(4 * LAYERS)]  # W, A, B and m of each layer
mx.eval(inputs)


def launch(ins: list[mx.array], stacked: bool) -> list[mx.array]:
    n = len(ins) // 4
    if stacked:
        outs = mx.depends([mx.zeros((n * ROWS,)) for _ in range(3)], ins)
        return [part for x in outs for part in (mx.split(x, n) if n > 1 else [x])]
    return mx.depends([mx.zeros((ROWS,)) for _ in range(3 * n)], ins)


def all_layers(k: int, stacked: bool):
    def step(*ins):
        return [x for s in range(0, LAYERS, k) for x in launch(list(ins[4 * s:4 * (s + k)]), stacked)]
    return step


def times(fn) -> tuple[float, float]:
    t = []
    for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        outs = fn(*inputs)
        t1 = time.perf_counter()
        mx.eval(outs)
        t.append((t1 - t0, time.perf_counter() - t1))
    return tuple(statistics.median(x[i] for x in t[1:]) * 1e3 for i in range(2))


print(f"{LAYERS} layers in launches of k, {mx.default_device()}; ms, median of {args.reps}")
print(f"{'k':>3s} {'outputs':10s} {'eager build':>12s} {'eval':>7s} {'compiled build':>15s} {'eval':>7s}")
for k in (1, 4, 32):
    for stacked in (False, True):
        eager = times(all_layers(k, stacked))
        compiled = times(mx.compile(all_layers(k, stacked)))
        print(f"{k:3d} {'stacked' if stacked else 'a layer':10s} {eager[0]:12.2f} {eager[1]:7.2f} "
              f"{compiled[0]:15.2f} {compiled[1]:7.2f}", flush=True)
