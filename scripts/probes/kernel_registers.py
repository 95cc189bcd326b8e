"""Registers, shared memory and blocks an SM holds for the 1B step's DoRA row-norm kernels.

Development probe (adapters issue), no GPU needed (then the backward's m and B gradient kernels, below): the kernels' sources for the bench
model's three weight shapes (bf16, rank 8, a launch a shape) are built as MLX's CUDA build
builds them (meshtune.cuda.compiled_source) under each setting of kernels.py's knobs, and
compiled by nvcc for the H200 (sm_90) with ptxas's resource report. An SM has 65536
registers, 228 KB of shared memory (227 KB a block) and at most 32 blocks / 64 warps.

    python scripts/probes/kernel_registers.py [--nvcc PATH] [--only LABEL] [--step-launch [--merged]]

--step-launch: the launch as a training step makes it (A and B' written too, kernels.writes_factors()); with --merged
the merged W' (kernels.MERGED_FOLD).
"""
import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx

from meshtune.adapters import kernels as K
from meshtune.cuda import RecordingKernel

p = argparse.ArgumentParser()
p.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
p.add_argument("--only", default="", help="settings whose label contains this")
p.add_argument("--step-launch", action="store_true", help="with A and B' written, as a training step's launch")
p.add_argument("--merged", action="store_true", help="the merged W' (with --step-launch)")
a = p.parse_args()

SHAPES = ((2048, 6144, 32), (6144, 2048, 16), (2048, 2048, 32))  # (in, out, layers a launch) of the 1b preset
SETTINGS = {"default": {}, "W' 4 loads in flight": {"_SCALED_LOADS": 4},
            "A tiles of 256 rows": {"_TILE_FLOATS": 2048},
            "tiles of 256, W' 4 loads in flight": {"_TILE_FLOATS": 2048, "_SCALED_LOADS": 4},
            "8 warps x 1 row": {"_ROWS_PER_WARP": 1},
            "8 warps x 1 row, tiles of 256, 4 loads": {"_ROWS_PER_WARP": 1, "_TILE_FLOATS": 2048, "_SCALED_LOADS": 4},
            "two passes": {"_TWO_PASS": True}, "two passes, W' 4 loads in flight": {"_TWO_PASS": True, "_SCALED_LOADS": 4}}


def resources(source: str, tmp: Path) -> tuple[int, int]:
    path = tmp / "k.cu"
    path.write_text(source)
    done = subprocess.run([a.nvcc, "-std=c++17", "-arch=sm_90", "--cubin", "-w", "-Xptxas", "-v", str(path), "-o",
                           str(tmp / "k.cubin")], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    regs = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    smem = re.search(r"(\d+) bytes smem", done.stderr)
    return regs, int(smem.group(1)) if smem else 0


def blocks_an_sm(regs: int, smem: int, threads: int) -> int:
    per_thread = -(-regs // 8) * 8  # registers are allocated 8 at a time (a warp's 256)
    by_regs = 65536 // (per_thread * threads)
    by_smem = (228 * 1024) // (smem + 1024) if smem else 32  # 1 KB a block reserved
    return min(by_regs, by_smem, 32, 64 // (threads // 32))


print(f"{'kernel (1b step, bf16, rank 8)':<58}{'in x out':<14}registers  smem B  blocks/SM  warps/SM")
with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    for label, knobs in SETTINGS.items():
        if a.only not in label:
            continue
        saved = {k: getattr(K, k) for k in knobs}
        for k, v in knobs.items():
            setattr(K, k, v)
        sources: dict[str, str] = {}
        K._kernel = lambda name, i, o, s: RecordingKernel(sources, name, i, o, s)
        try:
            for inp, out, n in SHAPES:
                ws = [mx.zeros((out, inp), dtype=mx.bfloat16)] * n
                args = (ws, [mx.zeros((inp, 8))] * n, [mx.zeros((8, out))] * n, [2.0] * n)
                before = set(sources)
                K.row_norms_and_scaled_cuda(*args, [mx.ones((out,))] * n, factors=a.step_launch and K.writes_factors(),
                                            merged=a.step_launch and a.merged)
                for func in sorted(set(sources) - before):  # the two-pass layout: two kernels
                    regs, smem = resources(sources[func], tmp)
                    threads = (K._SEGMENT_THREADS if "segment_sums" in func else inp // 8 if "resident" in func
                               else K._WARPS * 32)
                    blocks = blocks_an_sm(regs, smem, threads)
                    part = ", segment sums" if "segment_sums" in func else ", W'" if "scale_rows" in func else ""
                    print(f"  norms and W', {label + part:<42}{inp:>5} x {out:<5}{regs:>11}{smem:>8}{blocks:>11}"
                          f"{blocks * threads // 32:>10}")
        finally:
            for k, v in saved.items():
                setattr(K, k, v)

# The folded backward's m and B gradient kernels for the 1b step's output widths at 4096 tokens (bf16): B's product
# in the sums' pass (B_PRODUCT_IN_SUMS) at ranks 8, 16 and 64, and the column sums without it (rank 8), 256 threads.
print(f"{'kernel (1b step backward, bf16, 4096 tokens)':<58}{'rank x out':<14}registers  smem B  blocks/SM  warps/SM")
with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    sources = {}
    K._kernel = lambda name, i, o, s: RecordingKernel(sources, name, i, o, s)
    for out in (1024, 2048, 6144):
        g = mx.zeros((4096, out), dtype=mx.bfloat16)
        for r in (8, 16, 64):
            calls = [("B in the sums' pass", lambda: K.magnitude_and_b_grad_cuda(
                g, g, mx.zeros((4096, r), dtype=mx.bfloat16), mx.ones((out,)), mx.ones((out,)), 2.0))]
            if r == 8:
                calls.append(("column sums, B by a matmul", lambda: K.magnitude_grad_cuda(
                    g, g, mx.ones((out,)), mx.ones((out,)), b_product=mx.zeros((8, out), dtype=mx.bfloat16),
                    b_scale=2.0)))
            for label, call in calls:
                before = set(sources)
                call()
                for func in sorted(set(sources) - before):
                    regs, smem = resources(sources[func], tmp)
                    blocks = blocks_an_sm(regs, smem, 256)
                    part = ", 2nd" if "magnitude" in func else ""  # the kernel that adds the chunks
                    print(f"  {label + part:<56}{r:>5} x {out:<5}{regs:>11}{smem:>8}{blocks:>11}{blocks * 8:>10}")
