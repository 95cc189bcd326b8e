"""`meshtune bench pipeline`: naive vs GPipe vs 1F1B at P stages for several micro-batch counts.

Every configuration is `meshtune train --parallel.pp P` on the same global batch and
step count: on a CPU started by `meshtune launch --pin` (one core and one BLAS thread
per rank, ring backend); where MLX has CUDA, by `mlx.launch --backend nccl` (one GPU
per rank, no pinning). The model is a random Qwen3-shaped model of the adapters bench's
presets (`--preset`; 1b: ~1B parameters), by default on GPUs the largest one each GPU's
memory fits (bench/fit.py); on a CPU by default the embedded tiny one.
Steps/s comes from rank 0's report windows after the first. Beside it: the ideal
pipeline efficiency m / (m + p - 1) and the measured one (over the naive schedule's,
which keeps one stage busy at a time), and per stage the peak memory and the peak
activation memory (the peak above what weights, adapters and optimizer state hold
after setup), where 1F1B's bound of P micro-batches in flight shows against GPipe's M.

    meshtune bench pipeline [--stages 2] [--iters 30] [--batch-size 16] [--json]
    meshtune bench pipeline --preset 1b --micro-batches 8 --batch-size 16   # 2 GPUs, NCCL
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from ..runtime.blas import describe_blas
from ..cli.launch import launch_local
from .fit import Load, choose_preset, detect, embedded_line
from .models import PRESETS, Shape, write_model_folder
from .peer import metric_windows, steps_per_sec

SCHEDULE_NAMES = ("naive", "gpipe", "1f1b")


def on_gpu() -> bool:
    """MLX built with CUDA: ranks go on GPUs over NCCL instead of pinned CPU cores."""
    return mx.cuda.is_available()


def _launch(stages: int, cmd: list[str]) -> tuple[int, str]:
    """Start `stages` ranks of `cmd`; (exit code, their output)."""
    if not on_gpu():
        log = io.StringIO()
        return launch_local(stages, cmd, pin=True, out=log), log.getvalue()
    sibling = Path(sys.executable).with_name("mlx.launch")
    launcher = str(sibling) if sibling.exists() else shutil.which("mlx.launch") or "mlx.launch"
    # NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set); ranks see this PYTHONPATH.
    env = ["--env", f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', '0')}"]
    if os.environ.get("PYTHONPATH"):
        env += ["--env", f"PYTHONPATH={os.environ['PYTHONPATH']}"]
    proc = subprocess.run([launcher, "--backend", "nccl", "-n", str(stages), *env, "--", *cmd],
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def _run(schedule: str, stages: int, micro: int, a: argparse.Namespace, out: Path
         ) -> tuple[float, list[float], list[float]]:
    """(steps/s, peak GB per stage, activation GB per stage) of one configuration."""
    model = ["--model", str(a.model_folder)] if a.model_folder else []
    if a.data_folder:
        model += ["--data", str(a.data_folder), "--max-seq-length", str(a.seq_len + 8)]
    cmd = [sys.executable, "-m", "meshtune.cli", "train", *model, "--iters", str(a.iters), "--batch-size", str(a.batch_size),
           "--parallel.pp", str(stages), "--parallel.schedule", schedule, "--parallel.micro_batches", str(micro),
           "--fine-tune-type", a.fine_tune_type, "--num-layers", "-1", "--learning-rate", "1e-4",
           "--train.steps_per_report", str(max(a.iters // 3, 1)), "--train.val_batches", "0",
           "--save-every", str(a.iters), "--adapter-path", str(out)]
    if a.data_parallel > 1:
        cmd += ["--parallel.dp", str(a.data_parallel)]
    code, log = _launch(stages * a.data_parallel, cmd)
    if code:
        raise RuntimeError(f"{schedule} M={micro} failed with exit code {code}:\n{log[-3000:]}")
    # Each rank's own last line (launchers differ in how they prefix output).
    found = sorted((int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"rank (\d+) finished at step \d+ \(peak memory ([\d.]+) GB, activations ([-\d.]+) GB\)", log))
    return steps_per_sec(metric_windows(out)), [f[1] for f in found], [f[2] for f in found]


def write_text_data(folder: Path, length: int, rows: int) -> Path:
    """train/valid.jsonl of `rows` random lowercase texts of `length` characters (one token each
    under the embedded character-level tokenizer)."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        lines = [json.dumps({"text": "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(length))})
                 for _ in range(rows)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _size(a: argparse.Namespace) -> str:
    """Set a.preset when it is left to this machine's GPUs; the line that says what runs.

    Each rank holds 1/stages of one copy; CPU ranks share this machine's RAM, GPUs are one per rank.
    """
    gpu, ranks = on_gpu(), a.stages * a.data_parallel
    load = Load(full=a.fine_tune_type == "full", stages=a.stages, processes=1 if gpu else ranks,
                dtype_bytes=2 if gpu else 4)
    batch, seq = max(a.batch_size // a.data_parallel, 1), a.seq_len or 32
    if a.preset or gpu:
        a.preset, line = choose_preset(a.preset, load, detect(), batch=batch, seq=seq)
        return line
    return embedded_line(batch, seq, load) + "; pass --preset small for a larger one"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="meshtune bench pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2, help="Pipeline stages.")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="Data-parallel replicas of the pipeline (ranks = stages x this), e.g. 2 for DP2 x PP2.")
    p.add_argument("--micro-batches", default="2,4,8", help="Comma-separated micro-batch counts.")
    p.add_argument("--iters", type=int, default=30, help="Optimizer steps per run.")
    p.add_argument("--batch-size", type=int, default=16, help="Global batch (divisible by every M).")
    p.add_argument("--fine-tune-type", default="lora", help="lora, dora or full.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="A random Qwen3-shaped model of this size (bench adapters' presets); default: on GPUs "
                        "the largest that fits (bench/fit.py), on a CPU the embedded tiny model.")
    p.add_argument("--seq-len", type=int, default=0,
                   help="Train on synthetic rows of about this many tokens (default: the embedded arithmetic "
                        "data, ~20 tokens a row); long rows make activations, and 1F1B's bound on them, show.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    a = p.parse_args(argv)
    if a.data_parallel < 1 or a.stages < 1:
        p.error("--stages and --data-parallel must be >= 1")
    a.model_folder = a.data_folder = None
    ms = [int(m) for m in a.micro_batches.split(",")]
    print(_size(a), flush=True)
    rows, result = [], {}
    model_name = "embedded tiny model"
    with tempfile.TemporaryDirectory() as tmp:
        if a.preset:
            dims = {k: PRESETS[a.preset][k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
            shape = Shape(arch="qwen3", **dims)
            a.model_folder = write_model_folder(shape, mx.bfloat16 if on_gpu() else mx.float32, Path(tmp) / "model")
            model_name = shape.describe()
        if a.seq_len:
            a.data_folder = write_text_data(Path(tmp) / "data", a.seq_len, rows=max(4 * a.batch_size, 64))
            model_name += f", synthetic rows of {a.seq_len} tokens"
        for m in ms:
            naive_rate = None
            for name in SCHEDULE_NAMES:
                rate, peaks, acts = _run(name, a.stages, m, a, Path(tmp) / f"{name}-{m}")
                naive_rate = rate if name == "naive" else naive_rate
                rows.append((m, name, rate, rate / naive_rate, peaks, acts))
                result[f"{name}_steps_per_s_m{m}"] = rate
                result[f"peak_gb_{name}_m{m}"] = peaks
                result[f"act_gb_{name}_m{m}"] = acts
                if name != "naive":
                    result[f"{name}_over_naive_m{m}"] = rate / naive_rate
    mlast = ms[-1]
    gp, ob = result[f"peak_gb_gpipe_m{mlast}"], result[f"peak_gb_1f1b_m{mlast}"]
    result["peak_mem_1f1b_over_gpipe"] = max(ob) / max(gp) if gp and ob else float("nan")
    ga, oa = result[f"act_gb_gpipe_m{mlast}"], result[f"act_gb_1f1b_m{mlast}"]
    result["act_mem_1f1b_over_gpipe"] = max(oa) / max(ga) if ga and oa and max(ga) > 0 else float("nan")
    where = ("mlx.launch --backend nccl (one GPU per rank)" if on_gpu() else
             f"meshtune launch --pin (one core per rank, OPENBLAS_NUM_THREADS=1); {describe_blas()}")
    layout = f"{a.stages} stages" + (f" x {a.data_parallel} data-parallel replicas" if a.data_parallel > 1 else "")
    print(f"pipeline benchmark: {layout}, {model_name}, {a.fine_tune_type}, global batch "
          f"{a.batch_size}, {a.iters} steps; {where}")
    print(f"{'M':>3} {'schedule':<8}{'steps/s':>10}{'vs naive':>10}{'ideal':>8}   peak GB per rank    "
          f"activation GB per rank")
    for m, name, rate, speed, peaks, acts in rows:
        ideal = (m / (m + a.stages - 1)) / (1 / a.stages) if name != "naive" else 1.0
        print(f"{m:>3} {name:<8}{rate:>10.2f}{speed:>9.2f}x{ideal:>7.2f}x   {', '.join(f'{x:.4f}' for x in peaks):<18}"
              f"{', '.join(f'{x:.4f}' for x in acts)}")
    if a.json:
        print(json.dumps(result))
    return 0
