"""`meshtune bench peer`: tokens/s of stock mlx_lm.lora and meshtune on the same job.

Both run as separate processes with the same environment (so the same BLAS), the
same model, data folder, global batch, max sequence length, LoRA rank/scale, layer
count, optimizer, learning rate, seed and iteration count. Throughput is the sum of
tokens over the sum of compute seconds of every report window after the first (the
first holds compilation and warm-up); evaluation time is excluded on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..blas import describe_blas


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshtune bench peer", description=__doc__)
    p.add_argument("--model", default="", help="Model (default: the embedded tiny model).")
    p.add_argument("--data", default="", help="Data folder (default: the embedded arithmetic set).")
    p.add_argument("--iters", type=int, default=120, help="Optimizer steps per run.")
    p.add_argument("--batch-size", type=int, default=16, help="Global batch size.")
    p.add_argument("--max-seq-length", type=int, default=512, help="Maximum sequence length.")
    p.add_argument("--num-layers", type=int, default=-1, help="Blocks to adapt (-1: all).")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank.")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="Adam learning rate.")
    p.add_argument("--report-every", type=int, default=20, help="Steps per report window.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def _throughput(windows: list[dict[str, float]]) -> float:
    """Tokens over seconds of every window after the first."""
    later = windows[1:] or windows
    tokens = sum(w["tokens"] for w in later)
    seconds = sum(w["seconds"] for w in later)
    return tokens / seconds if seconds else 0.0


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}:\n{tail}")
    return proc.stdout


def run_stock(opts: dict[str, Any], env: dict[str, str]) -> list[dict[str, float]]:
    """Stock windows as {tokens, seconds}, from stock's own reports."""
    out = _run([sys.executable, "-m", "meshtune.bench.stock_runner", json.dumps(opts)], env)
    line = next(l for l in out.splitlines() if l.startswith("STOCK_RESULT "))
    windows, previous = [], 0
    for w in json.loads(line[len("STOCK_RESULT "):]):
        tokens = w["trained_tokens"] - previous
        previous = w["trained_tokens"]
        windows.append({"tokens": tokens, "seconds": tokens / w["tokens_per_second"]})
    return windows


def run_meshtune(opts: dict[str, Any], env: dict[str, str], out_dir: Path) -> list[dict[str, float]]:
    """meshtune windows as {tokens, seconds}, from metrics.jsonl."""
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
    _run([sys.executable, "-m", "meshtune.cli", "--no-system-blas", "train", *flags], env)
    records = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"tokens": r["tokens"], "seconds": r["tokens"] / r["tokens_per_sec"]}
            for r in records if r["type"] == "train"]


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
    env = dict(os.environ)
    blas = describe_blas()
    with tempfile.TemporaryDirectory() as tmp:
        stock = _throughput(run_stock({**opts, "adapter_path": str(Path(tmp) / "stock")}, env))
        ours = _throughput(run_meshtune(opts, env, Path(tmp) / "meshtune"))
    ratio = ours / stock if stock else float("nan")
    print(f"peer benchmark: LoRA rank {a.rank}, {a.iters} steps, global batch {a.batch_size}, "
          f"max_seq_length {a.max_seq_length}, num_layers {a.num_layers}")
    print(f"model {opts['model']}\ndata  {opts['data']}\n{blas}")
    print(f"{'trainer':<16}{'tokens/s':>12}")
    print(f"{'mlx_lm.lora':<16}{stock:>12.1f}")
    print(f"{'meshtune':<16}{ours:>12.1f}")
    print(f"{'ratio':<16}{ratio:>11.2f}x")
    if a.json:
        print(json.dumps({"stock_tok_s": stock, "meshtune_tok_s": ours, "ratio": ratio, "blas": blas}))
    return 0
