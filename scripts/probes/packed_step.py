"""Does packing the gradients into buckets make a one-GPU step faster?

Development probe (data-parallel issue). On 2 H200s a full fine-tuning step with its
gradients summed after the backward (63 ms) beat the same process's step with no sum at
all (72-79 ms; docs/bench/scaling_2xh200*.txt). Here one process times, for LoRA and
full fine-tuning, meshtune's step on a one-process mesh ("plain") against the same step
on a mesh that claims two ranks over a one-process group ("packed"): the gradients go
through the same buckets, pack, all_sum (an identity on one process) and unpack as on
two ranks. If "packed" wins here too, the win is the bucketed graph, not communication.
"packed" packs each bucket with one kernel on CUDA (parallel/pack_kernel.py); "packed by
concatenate" with mx.concatenate (a copy kernel per array), as before that kernel.

    python scripts/probes/packed_step.py [--preset 1b] [--kinds lora,full] [--steps 10] [--cache-limit-gb 64]
"""
import argparse
import statistics
import time

import mlx.core as mx

from _steps import interleaved, meshtune_step
from meshtune.bench import adapters as B
from meshtune.mesh import Mesh
from meshtune.parallel import data_parallel as DP

ON_CUDA = DP.on_cuda


def runner(kind, mesh, a, shape, dtype, pack_kernel=True):
    step, state, tokens, lengths = meshtune_step(kind, a, shape, dtype, mesh=mesh)

    def run():
        DP.on_cuda = ON_CUDA if pack_kernel else (lambda: False)  # read when the compiled step is traced
        tic = time.perf_counter()
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(state, ce, n)
        return time.perf_counter() - tic

    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--kinds", default="lora,full")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cache-limit-gb", type=float, default=0.0,
                   help="mx.set_cache_limit first: is the plain full step's loss the allocator giving memory back?")
    args = p.parse_args()
    if args.cache_limit_gb:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    a = B._settings(["--preset", args.preset])
    shape = B.shape_of(a)
    dtype = mx.float32 if B._on_cpu() else mx.bfloat16
    group = mx.distributed.init()
    assert group.size() == 1, "run as one process"
    packed = Mesh(group=group, world_size=2, rank=0, dp=2, pp=1)
    for kind in args.kinds.split(","):
        runs = {"plain": runner(kind, Mesh.single(), a, shape, dtype), "packed": runner(kind, packed, a, shape, dtype),
                "packed by concatenate": runner(kind, packed, a, shape, dtype, pack_kernel=False)}
        times = interleaved(runs, args.steps)
        print(f"{kind}: " + "  ".join(f"{k} {statistics.median(t) * 1e3:.1f} ms" for k, t in times.items())
              + f"  (peak {mx.get_peak_memory() / 2**30:.1f} GiB, cache {mx.get_cache_memory() / 2**30:.1f} GiB)", flush=True)
        del runs
        B._release()


if __name__ == "__main__":
    main()
