"""The compiled training step's graph and build time, LoRA against DoRA, with the CUDA path stubbed on the CPU.

Development probe (adapters issue). On an H200 the overlapped step is the host's (probe_dora_step.py --host: it
waits ~0 ms for the GPU), and DoRA's build (the compiled call making the step's arrays) is ~3.5 ms over LoRA's.
That part needs no GPU: here meshtune's CUDA kernels are replaced by a stand-in of one node with the kernel's
inputs and outputs (mx.depends on zeros of the output shapes), CUDA is reported present, and the bench model's
step (16 blocks by default; the width does not change the graph) is built as on a GPU. It prints each kind's build
time (the compiled call, nothing evaluated, --calls calls a rep, median of --reps), the graph's nodes and edges
(mx.export_to_dot) and, with --diff, the node kinds whose counts differ.

    python scripts/probes/step_graph.py [--layers 16] [--kinds lora,dora] [--diff]

A kind "dora-factors" is DoRA with the norm launches writing the layers' A and B' (kernels._WRITE_FACTORS).
"""
import argparse
import collections
import io
import os
import re
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from meshtune import cuda
from meshtune.adapters import kernels as K, step_norms
from meshtune.bench.models import Shape

sys.path.insert(0, os.path.dirname(__file__))
from _steps import meshtune_step  # noqa: E402


def stand_in(name, input_names, output_names, source):
    """One node with the kernel's inputs and outputs, in place of an mx.fast.cuda_kernel."""
    def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        return mx.depends([mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)], list(inputs))
    return call


class Batch:
    """The probes' batch: one sequence of 16 tokens (the graph does not depend on its size)."""
    batch_size, seq_len = 1, 16


def stub_cuda(layers: int) -> Shape:
    """Report CUDA present with every kernel a stand-in and an H200's memory (so "auto" folds); the bench model's
    shape at `layers` blocks and a small width."""
    K._kernel, K.on_cuda, cuda.on_cuda = stand_in, (lambda: True), (lambda: True)
    step_norms._gpu_memory = lambda: 140 * 2**30
    return Shape(arch="qwen3", layers=layers, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kinds", default="lora,dora")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--diff", action="store_true")
    a = p.parse_args()
    shape = stub_cuda(a.layers)

    counts = {}
    print(f"{a.layers} blocks, CUDA path stubbed on {mx.default_device()}; build ms a call (median of {a.reps} reps "
          f"of {a.calls} calls)")
    for kind in a.kinds.split(","):
        K._WRITE_FACTORS = kind.endswith("-factors")
        step, state, tokens, lengths = meshtune_step(kind.removesuffix("-factors"), Batch, shape, mx.float32)
        for _ in range(3):  # traced, then the optimizer's state made: traced again
            ce, n, _, _ = step(tokens, lengths, None, None, True)
            mx.eval(state, ce, n)
        reps = []
        for _ in range(a.reps):
            t = time.perf_counter()
            for _ in range(a.calls):
                ce, n, _, _ = step(tokens, lengths, None, None, True)
            reps.append((time.perf_counter() - t) / a.calls * 1e3)
            mx.eval(state, ce, n)
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        dot = io.StringIO()
        mx.export_to_dot(dot, ce, n, *[v for _, v in tree_flatten(state) if isinstance(v, mx.array)])
        counts[kind] = collections.Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))
        leaves = [len(tree_flatten(s)) for s in state[:2]]
        print(f"  {kind:6s} build {statistics.median(reps):6.2f} ms  nodes {sum(counts[kind].values()):6d}  "
              f"edges {dot.getvalue().count('->'):6d}  state leaves: model {leaves[0]}, optimizer {leaves[1]}", flush=True)
        mx.eval(state, ce, n)
    if a.diff and len(counts) == 2:
        first, second = counts.values()
        for label in sorted(set(first) | set(second), key=lambda k: -abs(second[k] - first[k])):
            if first[label] != second[label]:
                print(f"  {second[label] - first[label]:+6d}  {label[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
