"""`meshtune bench pipeline`: naive vs GPipe vs 1F1B at P stages for several micro-batch counts.

Every configuration is a real `meshtune train --parallel.pp P` run, compared with the whole batch
at once (naive, M=1), with the measured bubble and per-stage peak memory. HELP, the command's
--help, says how; docs/performance.md ("Pipeline") holds the figures.
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
from typing import Any

import mlx.core as mx

from ..runtime.blas import describe_blas
from ..parallel.launcher import launch_ranks
from ..parallel.pipeline.schedules import build as build_schedule, idle_fraction
from ..training.metrics import read_metrics
from .fit import Load, choose_preset, detect, embedded_line
from .models import PRESETS, Shape, write_model_folder
from .peer import metric_windows, steps_per_sec
from .flags import BenchParser, COUNT, at_least

HELP = """`meshtune bench pipeline`: naive vs GPipe vs 1F1B at P stages for several micro-batch counts.

Every configuration is `meshtune train --parallel.pp P` on the same global batch and
step count: on a CPU started by `meshtune launch --pin` (one core and one BLAS thread
per rank, ring backend); where MLX has CUDA, by `mlx.launch --backend nccl` (one GPU
per rank, no pinning). The model is a random Qwen3-shaped model of the adapters bench's
presets (`--preset`; 1b: ~1B parameters), by default on GPUs the largest one each GPU's
memory fits (bench/fit.py); on a CPU by default the embedded tiny one.
Steps/s comes from rank 0's report windows after the first; every configuration runs
`--repeats` times in interleaved rounds and its row is its median run. The baseline is the naive
schedule at M=1, the whole batch through the stages in turn, which is what runs without
micro-batches; at M > 1 GPipe and 1F1B run, and every row's ratio is over that baseline (in
the JSON `<schedule>_over_naive_m<M>`, and `best_over_m1` for the fastest), beside the
ideal P M / (M + P - 1). The bubble column is the share of the step the stages spent in
sends and receives, measured (the mean over stages), beside the schedule's analytic idle
share. Per stage: the peak memory and the peak activation memory (the peak above what
weights, adapters and optimizer state hold after setup), where 1F1B's bound of P
micro-batches in flight shows against GPipe's M.

    meshtune bench pipeline [--stages 2] [--micro-batches 1,2,4,8] [--iters 30] [--batch-size 16] [--repeats 3] [--json]
    meshtune bench pipeline --preset 1b --micro-batches 8 --batch-size 16   # 2 GPUs, NCCL
"""

SCHEDULE_NAMES = ("gpipe", "1f1b")  # at M > 1; the baseline is naive at M=1


def on_gpu() -> bool:
    """MLX built with CUDA: ranks go on GPUs over NCCL instead of pinned CPU cores."""
    return mx.cuda.is_available()


def _launch(stages: int, cmd: list[str]) -> tuple[int, str]:
    """Start `stages` ranks of `cmd`; (exit code, their output)."""
    if not on_gpu():
        log = io.StringIO()
        return launch_ranks(stages, cmd, pin=True, out=log), log.getvalue()
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
         ) -> tuple[float, float, list[float], list[float]]:
    """(steps/s, bubble share, peak GB per stage, activation GB per stage) of one configuration."""
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
    shares = [r.get("bubble_share", 0.0) for r in read_metrics(out) if r["type"] == "train"]
    later = shares[1:] or shares  # the windows steps/s counts
    bubble = sum(later) / len(later) if later else 0.0
    return steps_per_sec(metric_windows(out)), bubble, [f[1] for f in found], [f[2] for f in found]


def _median(runs: list[tuple[float, float, list[float], list[float]]]
            ) -> tuple[float, float, list[float], list[float]]:
    """The run of median steps/s (the lower of the middle two for an even count), whole: its bubble
    and memory belong to the same run."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


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
    p = _parser()
    a = p.parse_args(argv)
    a.model_folder = a.data_folder = None
    ms = _micro_batch_counts(p, a)
    print(_size(a), flush=True)
    rows, result, model_name = _measure(a, ms)
    best = max(rows[1:] or rows, key=lambda r: r[2])  # the fastest schedule at M > 1
    result["best_schedule"], result["best_over_m1"] = f"{best[1]} M={best[0]}", best[3]
    mlast = ms[-1]
    if mlast > 1:
        gp, ob = result[f"peak_gb_gpipe_m{mlast}"], result[f"peak_gb_1f1b_m{mlast}"]
        result["peak_mem_1f1b_over_gpipe"] = max(ob) / max(gp) if gp and ob else float("nan")
        ga, oa = result[f"act_gb_gpipe_m{mlast}"], result[f"act_gb_1f1b_m{mlast}"]
        result["act_mem_1f1b_over_gpipe"] = max(oa) / max(ga) if ga and oa and max(ga) > 0 else float("nan")
    _print_table(a, rows, model_name)
    print(f"best: {result['best_schedule']} at {result['best_over_m1']:.2f}x naive M=1")
    if a.json:
        print(json.dumps(result))
    return 0


def _parser() -> BenchParser:
    p = BenchParser(prog="meshtune bench pipeline", description=HELP)
    p.add_argument("--stages", type=COUNT, default=2, help="Pipeline stages.")
    p.add_argument("--data-parallel", type=COUNT, default=1,
                   help="Data-parallel replicas of the pipeline (ranks = stages x this), e.g. 2 for DP2 x PP2.")
    p.add_argument("--micro-batches", default="1,2,4,8",
                   help="Comma-separated micro-batch counts; 1 (the naive baseline) is always run.")
    p.add_argument("--iters", type=COUNT, default=30, help="Optimizer steps per run.")
    p.add_argument("--batch-size", type=COUNT, default=16, help="Global batch (divisible by every M).")
    p.add_argument("--fine-tune-type", choices=["lora", "dora", "full"], default="lora", help="What to train.")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="A random Qwen3-shaped model of this size (bench adapters' presets); default: on GPUs "
                        "the largest that fits (bench/fit.py), on a CPU the embedded tiny model.")
    p.add_argument("--seq-len", type=at_least(0), default=0,
                   help="Train on synthetic rows of about this many tokens (default: the embedded arithmetic "
                        "data, ~20 tokens a row); long rows make activations, and 1F1B's bound on them, show.")
    p.add_argument("--repeats", type=COUNT, default=3,
                   help="Runs of every configuration, in interleaved rounds; each row is its median run "
                        "(steps/s), with the runs' range beside it.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def _micro_batch_counts(p: BenchParser, a: argparse.Namespace) -> list[int]:
    """--micro-batches as sorted counts, 1 included; each must divide every pipeline's batch."""
    try:
        ms = sorted({1, *(int(m) for m in a.micro_batches.split(","))})
    except ValueError:
        p.error(f"--micro-batches {a.micro_batches!r}: give counts such as 1,4,8")
    if ms[0] < 1:
        p.error("--micro-batches: every count must be >= 1")
    if a.batch_size % a.data_parallel:
        p.error(f"--batch-size {a.batch_size} does not divide over --data-parallel {a.data_parallel}; give a "
                f"multiple of {a.data_parallel}")
    local = a.batch_size // a.data_parallel  # each pipeline's batch, cut into M micro-batches
    if any(local % m for m in ms):
        fits = ",".join(str(m) for m in range(1, local + 1) if local % m == 0)
        p.error(f"--micro-batches {','.join(str(m) for m in ms if local % m)} does not divide each pipeline's "
                f"batch of {local} (--batch-size {a.batch_size} / --data-parallel {a.data_parallel}); "
                f"give counts from {fits}")
    return ms


def _measure(a: argparse.Namespace, ms: list[int]) -> tuple[list[tuple], dict[str, Any], str]:
    """Every schedule at every M, in interleaved rounds: (table rows, the JSON result, the model in words)."""
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
        configs = [(1, "naive")] + [(m, name) for m in ms[1:] for name in SCHEDULE_NAMES]
        runs: dict[tuple[int, str], list] = {c: [] for c in configs}
        for r in range(a.repeats):  # rounds over every configuration: the machine's drift hits them alike
            for m, name in configs:
                runs[(m, name)].append(_run(name, a.stages, m, a, Path(tmp) / f"{name}-{m}-{r}"))
        baseline = _median(runs[(1, "naive")])
        for m, name in configs:
            rate, bubble, peaks, acts = _median(runs[(m, name)])
            spread = sorted(run[0] for run in runs[(m, name)])
            rows.append((m, name, rate, rate / baseline[0], bubble, peaks, acts, spread))
            result[f"{name}_steps_per_s_m{m}"] = rate
            result[f"{name}_steps_per_s_m{m}_runs"] = spread
            result[f"bubble_{name}_m{m}"] = bubble
            result[f"peak_gb_{name}_m{m}"] = peaks
            result[f"act_gb_{name}_m{m}"] = acts
            if m > 1:
                result[f"{name}_over_naive_m{m}"] = rate / baseline[0]
    return rows, result, model_name


def _print_table(a: argparse.Namespace, rows: list[tuple], model_name: str) -> None:
    where = ("mlx.launch --backend nccl (one GPU per rank)" if on_gpu() else
             f"meshtune launch --pin (one core per rank, OPENBLAS_NUM_THREADS=1); {describe_blas()}")
    layout = f"{a.stages} stages" + (f" x {a.data_parallel} data-parallel replicas" if a.data_parallel > 1 else "")
    print(f"pipeline benchmark: {layout}, {model_name}, {a.fine_tune_type}, global batch "
          f"{a.batch_size}, {a.iters} steps; {where}")
    print(f"each row: the median of {a.repeats} run{'s' if a.repeats > 1 else ''} (by steps/s), in interleaved rounds")
    print(f"{'M':>3} {'schedule':<8}{'steps/s':>10}{'runs':>14}{'vs M=1':>9}{'ideal':>8}{'bubble':>8}{'ideal':>7}   "
          f"peak GB per rank    activation GB per rank")
    for m, name, rate, speed, bubble, peaks, acts, spread in rows:
        # P stages in turn at M=1; the fill and drain at M. Bubble: the measured share of the step in
        # sends and receives (the mean over stages) beside the schedule's analytic idle share.
        ideal, idle = a.stages * m / (m + a.stages - 1), idle_fraction(build_schedule(name, a.stages, m))
        runs_range = f"{spread[0]:.2f}-{spread[-1]:.2f}"
        print(f"{m:>3} {name:<8}{rate:>10.2f}{runs_range:>14}{speed:>8.2f}x{ideal:>7.2f}x{bubble:>7.0%}{idle:>7.0%}   "
              f"{', '.join(f'{x:.4f}' for x in peaks):<18}{', '.join(f'{x:.4f}' for x in acts)}")
