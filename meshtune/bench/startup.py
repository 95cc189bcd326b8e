"""`meshtune bench startup`: seconds from process start to the first optimizer step of `meshtune train`, cold and warm.

Per fine-tuning kind, `meshtune train` as a child process with an empty MLX kernel cache, then
with it filled, each output line stamped. HELP, the command's --help, says how and what is whose;
docs/performance.md ("Time to first step") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from . import torch_peer
from .adapters import describe_device
from . import fit
from ..runtime.device_memory import Machine, detect
from .fit import Load
from .models import PRESETS as MODEL_PRESETS
from .models import Shape, write_model_folder
from .flags import BenchParser, COUNT, at_least

HELP = """`meshtune bench startup`: seconds from process start to the first optimizer step of `meshtune train`, cold and warm.

On an NVIDIA GPU, MLX's CUDA backend compiles each kernel with NVRTC the first time a
process meets it and keeps the result on disk in MLX_PTX_CACHE_DIR, so the first run on a
fresh machine pays for every compile and later runs read them back. This suite writes one
random model of the preset's shape (bfloat16 on a GPU, float32 on the CPU; the tokenizer is
the embedded tiny model's) and a text data set whose rows fill --seq-len tokens, then, per
fine-tuning kind, starts `python -m meshtune.cli train --iters 2 --steps-per-report 1
--val-batches 0` as a child process: once with MLX_PTX_CACHE_DIR (and the CUDA driver's
CUDA_CACHE_PATH) pointing at a fresh empty folder (cold), then --runs-per-cache times more
on the same folder, now filled (warm). Each kind has its own folder, so no kind warms
another's; meshtune's token cache is off (MESHTUNE_CACHE_DIR=off) in every run, so the
kernel cache is the only thing that differs. The child's stdout is read line by line and
each line stamped with the seconds since Popen. Phases: start (Popen to the first line:
the interpreter, the BLAS re-exec and the imports), load (to the "<kind> on N layers" line:
the model read and adapted), first step (to the "step 1: train loss" line: data, optimizer,
the step's compilation and its first run); total is Popen to step 1, and steady step is the
"step 2" stamp minus the "step 1" one, for reference. Every run finds the model file in the
OS page cache (it was just written) and Python's bytecode compiled, so a fresh machine's disk
reads are not in these figures. On the CPU there is no PTX cache: cold and warm differ only
by noise, and the tiny preset takes seconds.

    meshtune bench startup                        # 1.7b on a GPU with the memory for it; small on a CPU
    meshtune bench startup --preset tiny --json   # seconds on a CPU; what the test runs

What is whose: compiling a kernel with NVRTC the first time it is met is MLX's, and so is
the cache; meshtune controls which and how many distinct graphs it runs before the first
step (a step-0 validation pass, off here; adapter.base_path auto's start-up measurements,
which only a quantized base takes), and so how many kernels a cold start must compile.
"""

KINDS = ("full", "lora", "dora")
DEFAULT_KINDS = ("full", "lora")
SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
# Shapes and batch sizes come from the suites that own them; 1.7b is Qwen3-1.7B's (tied embedding).
PRESETS: dict[str, dict[str, int]] = {"tiny": MODEL_PRESETS["tiny"], "small": MODEL_PRESETS["small"],
                                      "1.7b": torch_peer.PRESETS["1.7b"]}
TIED = {"1.7b"}
ITERS = 2
MARKS = {  # phase end -> the first stdout line that ends it
    "loaded": re.compile(r"^(lora|dora|full) on \d+ layers"),
    "step1": re.compile(r"\bstep 1: train loss"),
    "step2": re.compile(r"\bstep 2: train loss"),
}
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains "
         "and old stone bridges under a pale morning sky").split()


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench startup", description=HELP)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="tiny, small (CPU) or 1.7b (Qwen3-1.7B's shape, a GPU). Default: the largest that fits "
                        "this device's memory (bench/fit.py), said in the first line.")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(DEFAULT_KINDS),
                   help="Fine-tuning kinds (--fine-tune-type) to start.")
    p.add_argument("--runs-per-cache", type=COUNT, default=1,
                   help="Warm runs per kind after the cold one (each on the cache the cold run filled).")
    p.add_argument("--batch-size", type=COUNT, default=None, help="Default: the preset's.")
    p.add_argument("--seq-len", type=at_least(2), default=None, help="--max-seq-length of the runs. Default: the preset's.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def preset_shape(name: str) -> Shape:
    return fit.preset_shape(name, presets=PRESETS)


def choose_preset(requested: str | None, batch: int | None, seq: int | None, dtype_bytes: int,
                  machine: Machine) -> tuple[str, str]:
    """(preset, the line that says why), by fit.choose_preset: the largest that fits a GPU, else tiny."""
    load = Load(full=True, dtype_bytes=dtype_bytes)  # full fine-tuning is the peak of the kinds
    return fit.choose_preset(requested, load, machine, batch=batch, seq=seq, presets=PRESETS)


def write_model(name: str, dtype: mx.Dtype, folder: Path) -> Path:
    """The preset's random model as a model folder; a tied preset's lm_head is dropped and tied."""
    write_model_folder(preset_shape(name), dtype, folder)
    if name in TIED:
        weights = mx.load(str(folder / "model.safetensors"))
        weights.pop("lm_head.weight", None)
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        del weights
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    mx.clear_cache()
    return folder


def write_data(folder: Path, model: Path, seq_len: int, rows: int, lengths: list[int] | None = None) -> Path:
    """train/valid.jsonl of `rows` text rows, each as many words as fit seq_len tokens (EOS included);
    with `lengths`, the train rows fit those lengths instead, one row each."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, fits in (("train", lengths or [seq_len] * rows), ("valid", [seq_len] * 2)):
        lines = []
        for seq_len in fits:
            words = [rng.choice(WORDS) for _ in range(2 * seq_len)]  # a word is at least one token
            lo, hi = 1, len(words)
            while lo < hi:  # the most words whose tokens plus EOS fit seq_len
                mid = (lo + hi + 1) // 2
                # verbose=False: no note that the row is longer than the tokenizer's model_max_length
                if len(tokenizer.encode(" ".join(words[:mid]), verbose=False)) + 1 <= seq_len:
                    lo = mid
                else:
                    hi = mid - 1
            lines.append(json.dumps({"text": " ".join(words[:lo])}) + "\n")
        (folder / f"{split}.jsonl").write_text("".join(lines))
    return folder


def run_train(cmd: list[str], env: dict[str, str], stderr_file: Path) -> dict[str, float]:
    """Start `cmd`, stamp its stdout lines; the stamps (seconds since Popen) of the first line and each MARK."""
    stamps: dict[str, float] = {}
    with open(stderr_file, "w") as err:
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        assert proc.stdout is not None
        for raw in proc.stdout:
            now = time.perf_counter() - began
            line = raw.rstrip("\n").split("\r")[-1]
            stamps.setdefault("first_line", now)
            for mark, pattern in MARKS.items():
                if mark not in stamps and pattern.search(line):
                    stamps[mark] = now
        code = proc.wait()
    if code != 0:
        tail = stderr_file.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"meshtune {' '.join(cmd[3:])} failed with exit code {code}:\n{tail}")
    missing = [m for m in ("first_line", *MARKS) if m not in stamps]
    if missing:
        raise RuntimeError(f"meshtune train printed no line for {', '.join(missing)} (patterns: "
                           f"{', '.join(p.pattern for p in MARKS.values())})")
    return stamps


def row(kind: str, cache: str, stamps: dict[str, float]) -> dict[str, object]:
    """One run's phases (seconds, each from the end of the one before) and its raw stamps."""
    return {"kind": kind, "cache": cache, "start": stamps["first_line"],
            "load": stamps["loaded"] - stamps["first_line"], "first_step": stamps["step1"] - stamps["loaded"],
            "total": stamps["step1"], "steady_step": stamps["step2"] - stamps["step1"], "stamps": stamps}


def measure(a: argparse.Namespace, work: Path, model: Path, data: Path) -> list[dict[str, object]]:
    """Per kind: one cold run on a fresh kernel cache, then the warm runs on the same cache."""
    rows = []
    for kind in a.kinds:
        cache = work / f"cache-{kind}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTUNE_CACHE_DIR": "off",
               "MLX_PTX_CACHE_DIR": str(cache / "mlx"), "CUDA_CACHE_PATH": str(cache / "cuda")}
        for i in range(1 + a.runs_per_cache):
            state = "cold" if i == 0 else "warm"
            out = work / f"run-{kind}-{i}"
            cmd = [sys.executable, "-m", "meshtune.cli", "train", "--model", str(model), "--data", str(data),
                   "--fine-tune-type", kind, "--iters", str(ITERS), "--steps-per-report", "1", "--val-batches", "0",
                   "--batch-size", str(a.batch_size), "--max-seq-length", str(a.seq_len), "--adapter-path", str(out)]
            r = row(kind, state, run_train(cmd, env, work / f"stderr-{kind}-{i}.txt"))
            print(f"[bench startup] {kind} {state}: total {r['total']:.2f} s", file=sys.stderr, flush=True)
            rows.append(r)
    return rows


def cold_over_warm(rows: list[dict[str, object]]) -> dict[str, float]:
    """Per kind: the median cold total over the median warm total."""
    out = {}
    for kind in dict.fromkeys(str(r["kind"]) for r in rows):
        totals = {c: statistics.median(float(r["total"]) for r in rows if r["kind"] == kind and r["cache"] == c)
                  for c in ("cold", "warm")}
        out[kind] = totals["cold"] / totals["warm"]
    return out


def print_table(a: argparse.Namespace, rows: list[dict[str, object]], ratios: dict[str, float]) -> None:
    shape = preset_shape(a.preset)
    params = shape.params() - (shape.vocab * shape.hidden if a.preset in TIED else 0)
    print(f"startup benchmark: {a.preset}, qwen3-shaped random model, {shape.layers} layers x {shape.hidden} hidden, "
          f"intermediate {shape.intermediate}, {shape.heads} heads / {shape.kv_heads} kv heads, vocab {shape.vocab}"
          f"{' (tied embedding)' if a.preset in TIED else ''}, {params / 1e6:.1f}M params, {a.dtype}; "
          f"batch {a.batch_size} x {a.seq_len}")
    print(f"device {describe_device()}; MLX {mx.__version__}")
    print(f"each run: python -m meshtune.cli train --fine-tune-type KIND --iters {ITERS} --steps-per-report 1 "
          f"--val-batches 0; cold: MLX_PTX_CACHE_DIR and CUDA_CACHE_PATH empty, warm: filled by the cold run"
          + ("" if a.on_gpu else " (the CPU has no PTX cache: cold and warm differ by noise)"))
    print("seconds: start = Popen to the first output line; load = to '<kind> on N layers'; first step = to "
          "'step 1'; total = Popen to 'step 1'; steady step = 'step 2' - 'step 1'")
    print(f"\n  {'kind':<6}{'cache':<7}{'start':>8}{'load':>8}{'first step':>12}{'total':>8}{'steady step':>13}")
    for r in rows:
        print(f"  {r['kind']:<6}{r['cache']:<7}{r['start']:>8.3f}{r['load']:>8.3f}{r['first_step']:>12.3f}"
              f"{r['total']:>8.3f}{r['steady_step']:>13.3f}")
    print("\n  cold total / warm total: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    a.kinds = [k for k in KINDS if k in a.kinds]
    a.on_gpu = mx.default_device().type == mx.DeviceType.gpu
    a.dtype = "bfloat16" if a.on_gpu else "float32"
    a.preset, fit_line = choose_preset(a.preset, a.batch_size, a.seq_len, 2 if a.on_gpu else 4, detect())
    print(fit_line, flush=True)
    a.batch_size = a.batch_size or PRESETS[a.preset]["batch_size"]
    a.seq_len = a.seq_len or PRESETS[a.preset]["seq_len"]
    if min(a.batch_size, a.seq_len) < 2:
        raise ValueError("--batch-size and --seq-len must be at least 2")
    with tempfile.TemporaryDirectory(prefix="meshtune-startup-") as tmp:
        work = Path(tmp)
        model = write_model(a.preset, getattr(mx, a.dtype), work / "model")
        data = write_data(work / "data", model, a.seq_len, rows=2 * a.batch_size)
        rows = measure(a, work, model, data)
    ratios = cold_over_warm(rows)
    print_table(a, rows, ratios)
    if a.json:
        print(json.dumps({"rows": rows, "cold_over_warm": ratios, "preset": a.preset,
                          "shape": {k: PRESETS[a.preset][k] for k in SHAPE_KEYS}, "tied": a.preset in TIED,
                          "dtype": a.dtype, "batch_size": a.batch_size, "seq_len": a.seq_len, "iters": ITERS,
                          "runs_per_cache": a.runs_per_cache, "device": describe_device(), "mlx": mx.__version__}))
    return 0
