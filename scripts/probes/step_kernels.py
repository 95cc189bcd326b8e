"""One meshtune training step on the bench's model, for a profiler: which kernels does it launch?

Development probe (adapters issue), on MLX's CUDA build, under Nsight Compute:
    MLX_USE_CUDA_GRAPHS=0 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python3 scripts/probes/step_kernels.py dora bf16 > dora.csv
Warms the compiled step up, then brackets one step with cudaProfilerStart/Stop, so only
its kernels are profiled; `--summary lora.csv dora.csv` then prints both totals and
every kernel whose launches or GPU time differ between them.
"""
import argparse
import csv
import ctypes
import ctypes.util
import glob
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))


def cudart():
    names = [ctypes.util.find_library("cudart")] + sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    import site
    for d in site.getsitepackages():
        names += sorted(glob.glob(f"{d}/nvidia/cu*/lib/libcudart.so*")) + sorted(glob.glob(f"{d}/nvidia/cuda_runtime/lib/libcudart.so*"))
    for n in names:
        if n:
            try:
                return ctypes.CDLL(n)
            except OSError:
                pass
    raise SystemExit("no libcudart found")


def per_kernel(path):
    """{kernel name: [launches, GPU microseconds]} from one Nsight Compute CSV."""
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    name_i, unit_i, val_i = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
    agg = defaultdict(lambda: [0, 0.0])
    for r in rows[1:]:
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit_i]]
        name = r[name_i].split("(")[0][:72]
        agg[name][0] += 1
        agg[name][1] += float(r[val_i].replace(",", "")) * scale
    return agg


def summary(first, second):
    """Totals of both profiles, then every kernel whose launches or time differ (> 50 us)."""
    a, b = per_kernel(first), per_kernel(second)
    for path, agg in ((first, a), (second, b)):
        print(f"{path}: {sum(v[0] for v in agg.values())} kernels, {sum(v[1] for v in agg.values()) / 1e3:.2f} ms GPU time")
    print(f"launches first, second; GPU ms first, second; kernel")
    for k in sorted(set(a) | set(b), key=lambda k: -(b.get(k, [0, 0])[1] - a.get(k, [0, 0])[1])):
        x, y = a.get(k, [0, 0.0]), b.get(k, [0, 0.0])
        if x[0] != y[0] or abs(y[1] - x[1]) > 50:
            print(f"{x[0]:5d} {y[0]:5d} {x[1] / 1e3:7.3f} {y[1] / 1e3:7.3f}  {k}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", nargs="?", default="dora")
    p.add_argument("base", nargs="?", default="bf16")
    p.add_argument("--summary", nargs=2, metavar=("FIRST_CSV", "SECOND_CSV"),
                   help="compare two profiles (e.g. lora.csv dora.csv) instead of running a step")
    args = p.parse_args()
    if args.summary:
        summary(*args.summary)
        return
    import mlx.core as mx

    from _steps import meshtune_step
    from meshtune.bench import adapters as B

    a = B._settings(["--preset", "1b"])
    step, state, tokens, lengths = meshtune_step(args.kind, a, B.shape_of(a), mx.bfloat16, quantized=args.base == "4bit")
    for _ in range(3):
        mx.eval(state, *step(tokens, lengths, None, None, True)[:2])
    rt = cudart()
    mx.synchronize()
    rt.cudaProfilerStart()
    mx.eval(state, *step(tokens, lengths, None, None, True)[:2])
    mx.synchronize()
    rt.cudaProfilerStop()


if __name__ == "__main__":
    main()
