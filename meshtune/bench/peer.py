"""`meshtune bench peer`: tokens/s of stock mlx_lm.lora and meshtune on the same job.

Both run as separate processes with the same environment (so the same BLAS; less the
MLX_MAX_OPS_PER_BUFFER that meshtune's command line sets on some GPUs, runtime/gpu_batches.py,
so that stock runs with MLX's own CUDA graph size), the
same model, data folder, global batch, max sequence length, LoRA rank/scale, layer
count, optimizer, learning rate, seed and iteration count. Speed is optimizer steps
over compute seconds of every report window after the first (the first holds
compilation and warm-up), evaluation excluded on both sides, as each trainer reports
it. Tokens/s is that step rate times the global batch times the mean example length
of the training set: the two trainers count loss tokens differently (mlx-lm also
counts one padding target per row), so their own token counts are not comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..run_dir import RunDir
from ..runtime.blas import describe_blas
from ..runtime.gpu_batches import environment_without_ours
from .flags import BenchParser, COUNT, at_least


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench peer", description=__doc__, formatter_class=argparse.HelpFormatter)
    p.add_argument("--model", default="", help="Model (default: the embedded tiny model).")
    p.add_argument("--data", default="", help="Data folder (default: the embedded arithmetic set).")
    p.add_argument("--iters", type=COUNT, default=120, help="Optimizer steps per run.")
    p.add_argument("--batch-size", type=COUNT, default=16, help="Global batch size.")
    p.add_argument("--max-seq-length", type=at_least(2), default=512, help="Maximum sequence length.")
    p.add_argument("--num-layers", type=int, default=-1, help="Blocks to adapt (-1: all).")
    p.add_argument("--rank", type=COUNT, default=8, help="LoRA rank.")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="Adam learning rate.")
    p.add_argument("--report-every", type=COUNT, default=20, help="Steps per report window.")
    p.add_argument("--repeats", type=COUNT, default=3,
                   help="Runs of each trainer, interleaved; the median is reported (this box is noisy).")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def steps_per_sec(windows: list[dict[str, float]]) -> float:
    """Steps over seconds of every window after the first."""
    later = windows[1:] or windows
    steps = sum(w["steps"] for w in later)
    seconds = sum(w["seconds"] for w in later)
    return steps / seconds if seconds else 0.0


def mean_example_tokens(model: str, data: str) -> float:
    """Mean tokens per training example, tokenized as both trainers do (chat template)."""
    from mlx_lm.utils import load_tokenizer, _download

    from ..data import load_split

    tokenizer = load_tokenizer(_download(model))
    train = load_split(Path(data) / "train.jsonl", tokenizer, mask_prompt=True)
    return float(train.lengths.mean())


def run_command(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}:\n{tail}")
    return proc.stdout


def run_stock(opts: dict[str, Any], env: dict[str, str]) -> list[dict[str, float]]:
    """Stock windows as {steps, seconds}, from stock's own reports."""
    out = run_command([sys.executable, "-m", "meshtune.bench.stock_runner", json.dumps(opts)], env)
    line = next(l for l in out.splitlines() if l.startswith("STOCK_RESULT "))
    windows, previous = [], 0
    for w in json.loads(line[len("STOCK_RESULT "):]):
        steps, previous = w["iteration"] - previous, w["iteration"]
        windows.append({"steps": steps, "seconds": steps / w["iterations_per_second"]})
    return windows


def run_meshtune(opts: dict[str, Any], env: dict[str, str], out_dir: Path) -> list[dict[str, float]]:
    """meshtune windows as {steps, seconds}, from metrics.jsonl."""
    flags = ["--model", opts["model"], "--data", opts["data"], "--iters", str(opts["iters"]),
             "--batch-size", str(opts["batch_size"]), "--max-seq-length", str(opts["max_seq_length"]),
             "--num-layers", str(opts["num_layers"]), "--learning-rate", str(opts["learning_rate"]),
             "--seed", str(opts["seed"]), "--adapter-path", str(out_dir),
             "--adapter.rank", str(opts["lora_parameters"]["rank"]),
             "--adapter.scale", str(opts["lora_parameters"]["scale"]),
             "--train.steps_per_report", str(opts["steps_per_report"]),
             "--train.steps_per_eval", str(opts["steps_per_eval"]),
             "--train.val_batches", str(opts["val_batches"]),
             "--train.save_every", str(opts["save_every"]), "--data.mask_prompt", "true"]
    run_command([sys.executable, "-m", "meshtune.cli", "--no-system-blas", "train", *flags], env)
    return metric_windows(out_dir)


def metric_windows(out_dir: Path) -> list[dict[str, float]]:
    """A meshtune run's report windows as {steps, seconds}, from its metrics.jsonl."""
    records = [json.loads(l) for l in RunDir(out_dir).metrics.read_text().splitlines()]
    windows, previous = [], 0
    for r in (r for r in records if r["type"] == "train"):
        steps, previous = r["step"] - previous, r["step"]
        windows.append({"steps": steps, "seconds": steps / r["steps_per_sec"]})
    return windows


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    from ..config import Config

    cfg = Config()
    opts = {
        "model": a.model or str(cfg.resolved_model_path()), "data": a.data or str(cfg.resolved_data_path()),
        "train": True, "fine_tune_type": "lora", "optimizer": "adam", "seed": 0,
        "num_layers": a.num_layers, "batch_size": a.batch_size, "iters": a.iters,
        "learning_rate": a.learning_rate, "max_seq_length": a.max_seq_length, "mask_prompt": True,
        "steps_per_report": a.report_every, "steps_per_eval": a.iters + 1, "val_batches": 1,
        "save_every": a.iters, "lora_parameters": {"rank": a.rank, "scale": 20.0, "dropout": 0.0},
    }
    if not a.model:  # a model of the caller's is the caller's size
        from .fit import Load, embedded_line

        print(embedded_line(a.batch_size, a.max_seq_length if a.data else 32, Load()), flush=True)
    env = dict(os.environ)
    blas = describe_blas()
    tokens_per_step = a.batch_size * mean_example_tokens(opts["model"], opts["data"])
    stocks, ourses = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            stock_opts = {**opts, "adapter_path": str(Path(tmp) / f"stock{i}")}
            stocks.append(tokens_per_step * steps_per_sec(run_stock(stock_opts, environment_without_ours(env))))
            ourses.append(tokens_per_step * steps_per_sec(run_meshtune(opts, env, Path(tmp) / f"meshtune{i}")))
    stock, ours = statistics.median(stocks), statistics.median(ourses)
    ratio = ours / stock if stock else float("nan")
    print(f"peer benchmark: LoRA rank {a.rank}, {a.iters} steps, global batch {a.batch_size}, "
          f"max_seq_length {a.max_seq_length}, num_layers {a.num_layers}")
    print(f"model {opts['model']}\ndata  {opts['data']}\n{blas}")
    print(f"tokens/s = steps/s x {tokens_per_step:.0f} tokens per global batch (mean example length)")
    print(f"median of {a.repeats} interleaved runs each")
    print(f"{'trainer':<16}{'tokens/s':>12}   runs")
    print(f"{'mlx_lm.lora':<16}{stock:>12.1f}   {', '.join(f'{v:.0f}' for v in stocks)}")
    print(f"{'meshtune':<16}{ours:>12.1f}   {', '.join(f'{v:.0f}' for v in ourses)}")
    print(f"{'ratio':<16}{ratio:>11.2f}x")
    if a.json:
        print(json.dumps({"stock_tok_s": stock, "meshtune_tok_s": ours, "ratio": ratio, "blas": blas}))
    return 0
