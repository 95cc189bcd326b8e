"""`meshtune bench plan`: meshtune plan's memory estimate for each rank beside the peak a real run of it reports.

Per layout, `meshtune plan --json` and the run itself on the same flags. HELP, the command's
--help, says how; docs/plan.md ("Measured error") holds the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..plan import layouts
from ..run_dir import METRICS_FILE
from ..runtime.blas import describe_blas
from ..training.metrics import read_metrics
from ..runtime.device_memory import detect
from .fit import Load, choose_preset, embedded_line
from .models import PRESETS, Shape, write_model_folder
from .pipeline import on_gpu, write_text_data
from .flags import BenchParser

HELP = f"""`meshtune bench plan`: meshtune plan's memory estimate for each rank beside the peak a real run of it reports.

For each layout of `--layouts` (1, dpN, ppN) it runs `meshtune plan --json` and the run
itself on the same flags: `meshtune train` for one rank, `meshtune launch -n N -- meshtune
train` for dpN (where MLX has CUDA, the ranks run over NCCL, one GPU each) and the same with
`--parallel.pp N` for ppN (1F1B over N micro-batches unless train flags say otherwise), for --iters
steps with no validation.
Measured is each rank's `peak_memory_gb_per_rank` (mx.get_peak_memory) in the last train
record of the run's {METRICS_FILE}; the estimate is the plan's total for that rank's stage,
printed with its parts. The model is by default the embedded tiny model on the embedded
arithmetic data (every batch padded to 32 tokens); with --preset a random Qwen3-shaped model
of the adapters bench's presets (bench/models.py; on GPUs by default the largest that fits,
bench/fit.py) saved to a temporary folder, and with --seq-len synthetic rows of exactly that
many tokens.

    meshtune bench plan [--layouts 1,dp2,pp2] [--fine-tune-type lora] [--batch-size 8] [--iters 4] [--json]
    meshtune bench plan --layouts 1 --quantize                 # the tiny model in 4 bits
    meshtune bench plan --layouts pp2 -- --parallel.schedule gpipe --parallel.micro_batches 4
    meshtune bench plan --preset 1b --layouts 1 --seq-len 1024 --batch-size 4   # a GPU

Flags after `--` are train's (`--section.key value`, mlx_lm.lora's) and go to both commands.
"""

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MEMORY_GB = 1e4  # the plan's per-rank memory: only its `fits` column depends on it, and that is not shown


@dataclass(frozen=True)
class Layout:
    """One layout of --layouts: its spelling, the plan's name for it, and its shape."""

    spec: str
    dp: int
    pp: int

    @property
    def ranks(self) -> int:
        return self.dp * self.pp

    @property
    def name(self) -> str:
        """The planner's name of this layout (its rows are matched by it)."""
        return layouts.Layout(self.dp, self.pp).name


def parse_layouts(text: str) -> list[Layout]:
    """`1,dp2,pp2` -> the layouts; a bad entry is a ValueError naming --layouts."""
    layouts = []
    for spec in (s.strip().lower() for s in text.split(",") if s.strip()):
        n = spec[2:] if spec[:2] in ("dp", "pp") else ""
        if spec == "1":
            layouts.append(Layout(spec, 1, 1))
        elif n.isdigit() and int(n) >= 2:
            layouts.append(Layout(spec, int(n), 1) if spec.startswith("dp") else Layout(spec, 1, int(n)))
        else:
            raise ValueError(f"--layouts {text}: '{spec}' is not 1, dpN or ppN (N >= 2); e.g. --layouts 1,dp2,pp2")
    if not layouts:
        raise ValueError(f"--layouts {text!r}: give at least one layout, e.g. --layouts 1,dp2,pp2")
    return layouts


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshtune.cli", *args]


def _plan_rows(flags: list[str], ranks: int, seq: int) -> dict[str, Any]:
    """`meshtune plan --json` for `ranks` ranks: its JSON (every layout on that many ranks, and 1 process)."""
    proc = subprocess.run(_cli("plan", *flags, "--ranks", str(ranks), "--memory-gb", str(MEMORY_GB),
                               "--seq-len", str(seq), "--json"), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"meshtune plan --ranks {ranks} failed with exit code {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_command(flags: list[str], layout: Layout, iters: int, out: Path) -> list[str]:
    """`meshtune train` of `layout` for `iters` steps, under `meshtune launch -n N` for several ranks."""
    cmd = _cli("train", *flags, "--iters", str(iters), "--val-batches", "0",
               "--steps-per-report", str(max(iters // 2, 1)), "--save-every", str(iters), "--adapter-path", str(out))
    if layout.pp > 1:
        cmd += ["--parallel.pp", str(layout.pp)]
    if layout.ranks == 1:
        return cmd
    return _cli("launch", "-n", str(layout.ranks), *(["--backend", "nccl"] if on_gpu() else []), "--", *cmd)


def _peaks(layout: Layout, out: Path) -> list[float]:
    """Each rank's peak memory in bytes: the last train record of the run's metrics.jsonl."""
    last = [r for r in read_metrics(out) if r.get("type") == "train"][-1]
    per_rank = last.get("peak_memory_gb_per_rank") or [last["peak_memory_gb"]] * layout.ranks
    if len(per_rank) != layout.ranks:
        raise RuntimeError(f"{layout.name}: {METRICS_FILE} gives {len(per_rank)} ranks' peaks, not {layout.ranks}")
    return [gb * 1e9 for gb in per_rank]


def measure(layouts: list[Layout], flags: list[str], iters: int, tmp: Path, jobs: int) -> list[list[float]]:
    """Each layout's per-rank peaks (bytes), `jobs` runs at a time (a peak is its own process's: running
    several at once changes the time, not the figures)."""
    outs = [tmp / f"run-{lay.spec}" for lay in layouts]
    for first in range(0, len(layouts), jobs):
        batch = list(range(first, min(first + jobs, len(layouts))))
        procs = {i: subprocess.Popen(_run_command(flags, layouts[i], iters, outs[i]), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True) for i in batch}
        logs = {i: proc.communicate()[0] for i, proc in procs.items()}
        for i, proc in procs.items():
            if proc.returncode:
                raise RuntimeError(f"{layouts[i].name} run failed with exit code {proc.returncode}:\n"
                                   f"{logs[i][-3000:]}")
    return [_peaks(lay, out) for lay, out in zip(layouts, outs)]


PARTS = (("weights", "weights"), ("adapters", "adapters"), ("optim", "optimizer"), ("comm", "comm_buffers"),
         ("grads", "grads"), ("activ.", "activations"), ("overlap", "overlap"), ("update", "update"))


def parts(stage: dict[str, Any]) -> dict[str, float]:
    """A stage's estimate by part: the static ones, then the two moments whose larger is the peak. The
    backward holds max(grads, activ.) + overlap (one block's activations and gradients alive at once); the
    update holds `update` (the gradients, and their squares or the new copies of what does not update in
    place: plan/estimate.py). The total is the static parts plus the larger moment."""
    kept = {key: stage[key] for _, key in PARTS if key != "overlap"}
    return {**kept, "overlap": stage["backward"] - max(stage["grads"], stage["activations"])}


def compare(layouts: list[Layout], flags: list[str], seq: int, iters: int, tmp: Path, jobs: int
            ) -> tuple[dict, list[dict]]:
    """(the plan for the most ranks, one row per rank of every layout: estimate, its parts, measured, error)."""
    plans = {n: _plan_rows(flags, n, seq) for n in sorted({lay.ranks for lay in layouts})}
    estimates = []
    for lay in layouts:
        row = next((r for r in plans[lay.ranks]["layouts"] if r["layout"] == lay.name), None)
        if row is None or "stages" not in row:
            raise ValueError(f"--layouts {lay.spec}: meshtune plan gives no estimate for {lay.name} "
                             f"({row['problem'] if row else 'no such layout'}); choose another layout")
        estimates.append(row)
    rows = []
    for lay, row, measured in zip(layouts, estimates, measure(layouts, flags, iters, tmp, jobs)):
        for rank, peak in enumerate(measured):
            stage = row["stages"][rank % len(row["stages"])]  # dp ranks share the one stage; pp rank r is stage r
            rows.append({"layout": lay.name, "spec": lay.spec, "rank": rank, "stage": stage["stage"],
                         "blocks": stage["blocks"], "parts": parts(stage),
                         "estimate": stage["total"], "measured": peak,
                         "error": (stage["total"] - peak) / peak})
    return plans[max(plans)], rows


def table(rows: list[dict]) -> list[str]:
    """The lines of the comparison, every size in one unit (MB, or GB when a figure reaches 1 GB)."""
    big = max(max(r["estimate"], r["measured"]) for r in rows) >= 1e9
    unit, div = ("GB", 1e9) if big else ("MB", 1e6)
    head = ["layout", "rank", "blocks", *(name for name, _ in PARTS), f"estimate {unit}", f"measured {unit}",
            "error"]
    cells = [head] + [[r["layout"], str(r["rank"]), f"{r['blocks'][0]}-{r['blocks'][1] - 1}",
                       *(f"{r['parts'][key] / div:.2f}" for _, key in PARTS),
                       f"{r['estimate'] / div:.2f}", f"{r['measured'] / div:.2f}", f"{r['error']:+.1%}"]
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = []
    for k, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _model(a: argparse.Namespace, batch: int, tmp: Path) -> tuple[list[str], str, int]:
    """(the flags both commands share, what the model and data are, tokens per example)."""
    if a.model and a.preset:
        raise ValueError("--model and --preset both name the model; give one of them")
    gpu = on_gpu()
    load = Load(full=a.fine_tune_type == "full", processes=1 if gpu else max(lay.ranks for lay in a.layouts),
                dtype_bytes=2 if gpu else 4)
    seq = a.seq_len or (PRESETS[a.preset]["seq_len"] if a.preset else 32)
    if a.preset or (gpu and not a.model):
        a.preset, line = choose_preset(a.preset, load, detect(), batch=batch, seq=seq)
        seq = a.seq_len or PRESETS[a.preset]["seq_len"]
    elif a.model:
        line = f"model: {a.model} (--model)"
    else:
        line = embedded_line(batch, seq, load) + "; pass --preset small for a larger one"
    print(line, flush=True)
    model, what = a.model or str(ASSETS / "tiny-llama"), a.model or "the embedded tiny model"
    if a.preset:
        dims = {k: PRESETS[a.preset][k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")}
        shape = Shape(arch="qwen3", **dims)
        model = str(write_model_folder(shape, mx.bfloat16 if gpu else mx.float32, tmp / "model"))
        what = f"{a.preset}: {shape.describe()}"
    if a.quantize:
        from mlx_lm import convert

        with contextlib.redirect_stdout(sys.stderr):  # convert's progress lines are not the bench's output
            convert(model, mlx_path=str(tmp / "q4"), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16")
        model, what = str(tmp / "q4"), f"{what} in 4 bits (group 64, bf16 scales)"
    flags = ["--model", model, "--num-layers", "-1", "--batch-size", str(a.batch_size),
             "--fine-tune-type", a.fine_tune_type, *a.train_flags]
    if a.seq_len or a.preset:
        # Rows of seq - 1 characters and their end token: seq tokens, padded to exactly seq model inputs.
        data = write_text_data(tmp / "data", seq - 1, rows=max(4 * a.batch_size, 64))
        flags += ["--data", str(data), "--data.pad_to", str(seq), "--max-seq-length", str(seq + 1)]
        return flags, f"{what}, synthetic rows of {seq} tokens", seq
    flags += ["--data", str(ASSETS / "data" / "arithmetic")]
    return flags, f"{what}, arithmetic data padded to 32 tokens", 32


def main(argv: list[str]) -> int:
    p = BenchParser(prog="meshtune bench plan", description=HELP)
    p.add_argument("--layouts", default="1,dp2,pp2", help="Comma-separated layouts: 1, dpN, ppN (default 1,dp2,pp2).")
    p.add_argument("--fine-tune-type", default="lora", choices=("lora", "dora", "full"), help="lora, dora or full.")
    p.add_argument("--batch-size", type=int, default=8, help="Global batch (default 8).")
    p.add_argument("--seq-len", type=int, default=0,
                   help="Train on synthetic rows of exactly this many tokens (default: the preset's; with no "
                        "--preset the embedded arithmetic data, padded to 32).")
    p.add_argument("--iters", type=int, default=4, help="Optimizer steps per run (default 4).")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="A random Qwen3-shaped model of this size (bench adapters' presets); default: on GPUs "
                        "the largest that fits (bench/fit.py), on a CPU the embedded tiny model.")
    p.add_argument("--model", default=None, help="A local model folder instead.")
    p.add_argument("--quantize", action="store_true",
                   help="Quantize the model to 4 bits first (group 64, bfloat16 scales: mlx_lm convert -q).")
    p.add_argument("--jobs", type=int, default=1,
                   help="Runs at once (default 1). A peak is its own process's, so this changes only the time; "
                        "keep 1 on GPUs, where runs would share a device.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.train_flags = argv[cut + 1:]
    a.layouts = parse_layouts(a.layouts)
    for flag, value in (("--batch-size", a.batch_size), ("--iters", a.iters), ("--jobs", a.jobs)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1, e.g. {flag} 4")
    if a.seq_len and a.seq_len < 2:
        raise ValueError(f"--seq-len {a.seq_len}: give at least 2 tokens, e.g. --seq-len 128")
    with tempfile.TemporaryDirectory(prefix="meshtune-bench-plan-") as tmp:
        flags, what, seq = _model(a, max(a.batch_size // max(lay.dp for lay in a.layouts), 1), Path(tmp))
        plan, rows = compare(a.layouts, flags, seq, a.iters, Path(tmp), a.jobs)
    where = "CUDA (one GPU per rank, NCCL)" if on_gpu() else f"CPU, ring backend; {describe_blas()}"
    extra = f" {' '.join(a.train_flags)}," if a.train_flags else ""
    print(f"plan benchmark: {what}; {a.fine_tune_type},{extra} optimizer {plan['optimizer']}, schedule "
          f"{plan['schedule']}, global batch {a.batch_size}, {a.iters} steps; {where}")
    print("estimate: meshtune plan's total for the rank's stage, weights + adapters + optim + comm + the larger "
          "of the backward's max(grads, activ.) + overlap and the update's hold (update);")
    print("measured: the rank's peak_memory_gb_per_rank (mx.get_peak_memory) in the run's last train record; "
          "error = (estimate - measured) / measured")
    print("\n".join(table(rows)))
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"largest error: {worst['error']:+.1%} ({worst['layout']}, rank {worst['rank']})")
    if a.json:
        print(json.dumps({"model": plan["model"], "what": what, "fine_tune_type": a.fine_tune_type,
                          "optimizer": plan["optimizer"], "schedule": plan["schedule"], "batch_size": a.batch_size,
                          "train_flags": a.train_flags, "seq_len": seq, "iters": a.iters, "rows": rows,
                          "max_abs_error": abs(worst["error"])}))
    return 0
