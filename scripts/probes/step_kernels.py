"""One meshtune training step on the bench's model, for a profiler: which kernels does it launch?

Development probe (adapters issue), on MLX's CUDA build, under Nsight Compute:
    MLX_USE_CUDA_GRAPHS=0 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python3 scripts/probes/step_kernels.py dora bf16 > dora.csv
Warms the compiled step up, then brackets one step with cudaProfilerStart/Stop, so only
its kernels are profiled; `--summary dora.csv` then prints the launches and GPU time by kernel name.
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


def summary(path):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    head = rows[0]
    name_i, unit_i, val_i = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
    agg = defaultdict(lambda: [0, 0.0])
    for r in rows[1:]:
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[unit_i], 1.0)
        name = r[name_i].split("(")[0].split("<")[0][:60]
        agg[name][0] += 1
        agg[name][1] += float(r[val_i].replace(",", "")) * scale
    total_n = sum(v[0] for v in agg.values())
    total_t = sum(v[1] for v in agg.values())
    print(f"{path}: {total_n} kernels, {total_t / 1e3:.2f} ms GPU time")
    for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {n:6d} {t / 1e3:8.3f} ms  {name}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", nargs="?", default="dora")
    p.add_argument("base", nargs="?", default="bf16")
    p.add_argument("--summary", nargs="*")
    args = p.parse_args()
    if args.summary:
        for f in args.summary:
            summary(f)
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
