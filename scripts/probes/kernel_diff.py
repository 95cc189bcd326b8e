"""LoRA's and DoRA's GPU time per kernel, side by side, from `nsys stats --report cuda_gpu_kern_sum --format csv`
or from `ncu --csv --metrics gpu__time_duration.sum` (a row a launch).

Development probe (adapters issue): python kernel_diff.py kernels_lora.csv kernels_dora.csv [--steps 10]
Kernels are grouped by name with template arguments and launch details cut off; rows are
sorted by DoRA's extra time a step, largest first, and the totals close the table.
"""
import argparse
import csv
import io
import re
from collections import defaultdict


def _rows(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    # nsys and ncu may print notes before the CSV header.
    start = text.find('"ID","Process ID"')  # ncu
    start = start if start >= 0 else text.find("Time")  # nsys
    for row in csv.DictReader(io.StringIO(text[start:] if start >= 0 else text)):
        yield row


def _group(name):
    name = re.sub(r"<.*", "", name)  # template arguments
    name = re.sub(r"\(.*", "", name)  # parameter lists
    return name.strip().split("::")[-1][:70] or "?"


_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


def _one_cycle(rows, marker):
    """ncu's launches from the first launch named with `marker` up to the next one: a whole step,
    the model's set-up and the compiling step's first half left out."""
    at = [i for i, row in enumerate(rows) if marker in row.get("Kernel Name", "")]
    if len(at) < 2:
        raise SystemExit(f"kernel_diff: --cycle {marker!r} launches {len(at)} times; a step needs 2")
    return rows[at[0]:at[1]]


def totals(path, cycle=None):
    out = defaultdict(lambda: [0.0, 0])
    rows = list(_rows(path))
    if rows and "Metric Value" in rows[0]:  # ncu: a row a launch
        rows = [row for row in rows if row.get("Metric Name") == "gpu__time_duration.sum"]
        for row in _one_cycle(rows, cycle) if cycle else rows:
            ns = float(str(row["Metric Value"]).replace(",", "")) * _NS.get(row.get("Metric Unit", "ns"), 1.0)
            key = _group(row.get("Kernel Name", "?"))
            out[key][0] += ns
            out[key][1] += 1
        return out
    for row in rows:
        ns = float(str(row.get("Total Time (ns)", "0")).replace(",", "") or 0)
        count = int(float(str(row.get("Instances", row.get("Count", "0"))).replace(",", "") or 0))
        key = _group(row.get("Name", "?"))
        out[key][0] += ns
        out[key][1] += count
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("lora")
    p.add_argument("dora")
    p.add_argument("--steps", type=int, default=10, help="Steps in the profiled range (per-step figures).")
    p.add_argument("--cycle", default=None,
                   help="ncu only: one step, the launches between the first two kernels whose names hold this "
                        "(cross_entropy_vjp: once a step); --steps is then 1")
    args = p.parse_args()
    if args.cycle:
        args.steps = 1
    lora, dora = totals(args.lora, args.cycle), totals(args.dora, args.cycle)
    keys = sorted(set(lora) | set(dora), key=lambda k: -(dora[k][0] - lora[k][0]))
    print(f"{'kernel':72s} {'LoRA ms':>9s} {'DoRA ms':>9s} {'extra ms':>9s} {'LoRA n':>7s} {'DoRA n':>7s}  (a step)")
    for k in keys:
        lo, do = lora[k][0] / args.steps / 1e6, dora[k][0] / args.steps / 1e6
        print(f"{k:72s} {lo:9.3f} {do:9.3f} {do - lo:9.3f} {lora[k][1] // args.steps:7d} {dora[k][1] // args.steps:7d}")
    tl = sum(v[0] for v in lora.values()) / args.steps / 1e6
    td = sum(v[0] for v in dora.values()) / args.steps / 1e6
    print(f"{'total GPU kernel time':72s} {tl:9.3f} {td:9.3f} {td - tl:9.3f}")


if __name__ == "__main__":
    main()
