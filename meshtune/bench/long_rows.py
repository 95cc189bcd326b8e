"""`meshtune bench long-rows`: rows of thousands of tokens at batch 1, `meshtune train` beside PyTorch + PEFT.

Per row length, `meshtune train --grad-checkpoint` and a PyTorch + PEFT loop each run in a child
process of their own: tokens/s and peak memory, an out-of-memory reported in its cell. HELP, the
command's --help, says how; docs/performance.md ("Long rows") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..run_dir import RunDir
from . import torch_peer
from .adapters import describe_device
from .flags import BenchParser, COUNT, at_least
from .models import BITS, GROUP_SIZE
from .models import PRESETS as MODEL_PRESETS
from .startup import SHAPE_KEYS, TIED, write_data, write_model

HELP = """`meshtune bench long-rows`: rows of thousands of tokens at batch 1, `meshtune train` beside PyTorch + PEFT.

Long-context fine-tuning trains one long row a step with gradient checkpointing. This suite
writes one random model of the preset's shape (Qwen3, tied embedding; bfloat16 on a GPU,
float32 on the CPU; the tokenizer is the embedded tiny model's) and, per row length, a text
data set whose rows fill it. Then, per length, each side runs in a child process of its own,
so each has the whole device and an out-of-memory ends only its own cell:

- meshtune: `meshtune train --grad-checkpoint --batch-size 1 --max-seq-length L` itself, the
  command users run (its data pipeline, loop and reports), --warmup + --steps steps reported
  one by one; tokens/s is the median of the reports after the warm-up, peak memory the
  run's largest report (MLX's allocator). LoRA, and where asked DoRA and 4-bit LoRA (the same
  weights through mlx_lm.convert, group 64);
- torch: transformers' Qwen3ForCausalLM + PEFT LoRA (torch_side.py: eager, SDPA attention,
  fused AdamW on CUDA), gradient checkpointing on (`use_reentrant: False`, what transformers
  recommends), on a random batch of the same length, the same warm-up and steps; tokens/s is
  the median step, peak memory torch's allocator peak.

With `--step`, a third column: meshtune's compiled step alone (parallel/data_parallel_step.build_step,
what `meshtune bench torch` times) on the same model folder and a random row of the same length,
in a child process, and the command's tokens/s over the step's: where that ratio is below 1, the
command's path (its data, loop and reports) loses time outside the step.

Both sides: rank 8 on the 7 linear layers of every block (meshtune scale 20 = PEFT lora_alpha
160), AdamW lr 1e-5. An out-of-memory is reported as such in its cell.

    meshtune bench long-rows                           # 1.7b at 8k-64k on a GPU; small at 1k-4k on a CPU
    meshtune bench long-rows --preset tiny --no-torch  # seconds on a CPU; what the test runs
    meshtune bench long-rows --seq-lens 8192 16384 --kinds lora dora qlora --json
    meshtune bench long-rows --seq-lens 16384 --step                # the command beside its step alone
"""

KINDS = ("lora", "dora", "qlora")
LABELS = {"lora": "LoRA", "dora": "DoRA", "qlora": "4-bit LoRA"}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {**{k: MODEL_PRESETS["tiny"][k] for k in SHAPE_KEYS}, "seq_lens": [64, 128], "warmup": 1, "steps": 2},
    "small": {**{k: MODEL_PRESETS["small"][k] for k in SHAPE_KEYS}, "seq_lens": [1024, 2048, 4096],
              "warmup": 1, "steps": 3},
    "1.7b": {**{k: torch_peer.PRESETS["1.7b"][k] for k in SHAPE_KEYS}, "seq_lens": [8192, 16384, 32768, 65536],
             "warmup": 2, "steps": 4},
}
RANK, SCALE, LR = 8, 20.0, 1e-5
OOM = "out of memory"


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench long-rows", description=HELP)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="tiny (the test's), small (seconds a step on a CPU) or 1.7b (Qwen3-1.7B's shape, a GPU). "
                        "Default: 1.7b on a GPU, else small.")
    p.add_argument("--seq-lens", type=at_least(64), nargs="+", default=None, help="Row lengths. Default: the preset's.")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["lora"],
                   help="meshtune's kinds (torch runs LoRA beside them; dora and qlora are meshtune's rows).")
    p.add_argument("--warmup", type=at_least(0), default=None,
                   help="Steps left out of tokens/s (0: every step counts, the first with its compiling; "
                        "enough for peak memory). Default: the preset's.")
    p.add_argument("--steps", type=COUNT, default=None, help="Steps timed after the warm-up. Default: the preset's.")
    p.add_argument("--batch-size", type=COUNT, default=1, help="Rows a step (both sides).")
    p.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="Gradient checkpointing on both sides (--no-grad-checkpoint: off on both).")
    p.add_argument("--spread", action="store_true",
                   help="meshtune's rows of lengths spread evenly over (L/2, L], a new length each step, as "
                        "real data comes (torch keeps L); tokens/s then counts the tokens each step had.")
    p.add_argument("--train-args", default="", metavar="'FLAGS'",
                   help="More flags for meshtune train, in one quoted string (e.g. '--train.compile false').")
    p.add_argument("--no-torch", action="store_true", help="meshtune's rows only (no PyTorch here).")
    p.add_argument("--step", action="store_true",
                   help="Also time meshtune's compiled step alone on the same model and row length (a child "
                        "process), and print the command's tokens/s over the step's.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def _settings(argv: list[str]) -> argparse.Namespace:
    a = _parser().parse_args(argv)
    a.on_gpu = mx.default_device().type == mx.DeviceType.gpu
    a.preset = a.preset or ("1.7b" if a.on_gpu else "small")
    for name in ("seq_lens", "warmup", "steps"):
        if getattr(a, name) is None:
            setattr(a, name, PRESETS[a.preset][name])
    a.dtype = "bfloat16" if a.on_gpu else "float32"
    if not a.no_torch:
        missing = torch_peer.missing_libraries()
        if missing:
            raise ValueError(f"meshtune bench long-rows runs PyTorch + PEFT beside meshtune; not importable here: "
                             f"{', '.join(missing)}; pip install torch transformers peft, or pass --no-torch")
    return a


def _quantized(dense: Path, folder: Path) -> Path:
    """The dense model folder converted to 4 bits by mlx-lm's own converter (group 64)."""
    from contextlib import redirect_stdout

    from mlx_lm import convert

    with redirect_stdout(sys.stderr):  # its progress lines are not the table's
        convert(str(dense), mlx_path=str(folder), quantize=True, q_group_size=GROUP_SIZE, q_bits=BITS)
    return folder


def meshtune_row(a: argparse.Namespace, model: Path, data: Path, kind: str, seq_len: int, out: Path) -> dict[str, Any]:
    """`meshtune train` at batch 1 x seq_len with gradient checkpointing: median tok/s after the warm-up, peak GB."""
    cmd = [sys.executable, "-m", "meshtune.cli", "train", "--model", str(model), "--data", str(data),
           "--fine-tune-type", "dora" if kind == "dora" else "lora", "--train.grad_checkpoint", str(a.grad_checkpoint),
           "--batch-size", str(a.batch_size), "--max-seq-length", str(seq_len), "--iters", str(a.warmup + a.steps),
           "--steps-per-report", "1", "--val-batches", "0", "--save-every", str(10 ** 6),
           "--optimizer", "adamw", "--learning-rate", str(LR), "--num-layers", "-1", "--adapter.rank", str(RANK),
           "--adapter.scale", str(SCALE), "--adapter-path", str(out), *shlex.split(a.train_args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTUNE_CACHE_DIR": "off"}
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        if "out of memory" in done.stdout.lower():
            return {"error": OOM}
        raise RuntimeError(f"meshtune train at {seq_len} tokens failed with exit code {done.returncode}:\n"
                           f"{done.stdout[-3000:]}")
    records = [json.loads(line) for line in RunDir(out).metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("type") == "train"]
    timed = train[a.warmup:] or train[-1:]
    return {"tok_s": statistics.median(r["tokens_per_sec"] for r in timed),
            "peak_gb": max(r["peak_memory_gb"] for r in train), "steps": len(timed)}


def torch_row(a: argparse.Namespace, seq_len: int) -> dict[str, Any]:
    """PyTorch + PEFT LoRA at batch 1 x seq_len with gradient checkpointing, in a child process."""
    spec = {"shape": {k: PRESETS[a.preset][k] for k in SHAPE_KEYS}, "dtype": a.dtype, "seq_len": seq_len,
            "batch_size": a.batch_size, "grad_checkpoint": a.grad_checkpoint, "warmup": a.warmup, "steps": a.steps,
            "cuda": a.on_gpu}
    done = subprocess.run([sys.executable, "-m", "meshtune.bench.long_rows", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the torch side at {seq_len} tokens failed with exit code {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_row(a: argparse.Namespace, model: Path, kind: str, seq_len: int) -> dict[str, Any]:
    """meshtune's compiled step alone on `model` at batch x seq_len, in a child process (as torch_row)."""
    spec = {"side": "step", "model": str(model), "kind": kind, "seq_len": seq_len, "batch_size": a.batch_size,
            "grad_checkpoint": a.grad_checkpoint, "warmup": a.warmup, "steps": a.steps}
    done = subprocess.run([sys.executable, "-m", "meshtune.bench.long_rows", json.dumps(spec)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        if "out of memory" in done.stderr.lower():
            return {"error": OOM}
        raise RuntimeError(f"meshtune's step at {seq_len} tokens failed with exit code {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _step_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The step's measurement (run as `python -m meshtune.bench.long_rows SPEC`): the model loaded and
    adapted as `meshtune train` does, one fixed random row, the loop's overlap, each step waited for."""
    import mlx.optimizers as optim

    from ..adapters import apply_adapters
    from ..inference import load_model
    from ..runtime.fastmath import install_fast_swiglu
    from ..training.attention import install_chunked_attention, needs_chunked_attention
    from ..training.grad_checkpoint import enable_grad_checkpoint
    from ..training.in_flight import overlaps_steps
    from .adapters import meshtune_step_runner

    model, _ = load_model(spec["model"])
    if mx.default_device().type == mx.DeviceType.cpu:  # as `meshtune train` runs the model on this machine
        install_fast_swiglu()
    if needs_chunked_attention():  # as train installs it: ChunkedAttention itself leaves short rows to mlx-lm
        install_chunked_attention()
    apply_adapters(model, fine_tune_type="dora" if spec["kind"] == "dora" else "lora", num_layers=-1, keys=None,
                   rank=RANK, scale=SCALE, dropout=0.0)
    recomputed = (enable_grad_checkpoint(model.layers[0]),) if spec["grad_checkpoint"] else ()
    model.train()
    run = meshtune_step_runner(model, optim.AdamW(learning_rate=LR), overlaps_steps("auto"), recomputed)
    vocab = model.model.embed_tokens.weight.shape[0]
    batch, seq_len = spec["batch_size"], spec["seq_len"]
    tokens = mx.random.randint(0, vocab, (batch, seq_len + 1), key=mx.random.key(0))
    lengths = mx.array([[0, seq_len + 1]] * batch, dtype=mx.int32)
    mx.eval(tokens, lengths)
    for _ in range(spec["warmup"]):
        run(tokens, lengths)
    run.finish()
    mx.reset_peak_memory()
    times = []
    for _ in range(spec["steps"]):
        tic = time.perf_counter()
        run(tokens, lengths)
        run.finish()
        times.append(time.perf_counter() - tic)
    return {"tok_s": batch * seq_len / statistics.median(times), "peak_gb": mx.get_peak_memory() / 1e9,
            "steps": len(times)}


def _torch_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The torch side's measurement (run as `python -m meshtune.bench.long_rows SPEC`)."""
    import torch

    from .torch_side import TorchSide

    ts = TorchSide(spec["cuda"])
    try:
        model = ts.build_model(spec["shape"], spec["dtype"], seed=0)
        if spec["grad_checkpoint"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = ts.adapt(model, "lora", RANK, SCALE * RANK)
        run = ts.step_runner(model, LR, spec["shape"]["vocab"], spec["batch_size"], spec["seq_len"], seed=0)
        for _ in range(spec["warmup"]):
            run()
        run.finish()
        ts.reset_peak()
        times = []
        for _ in range(spec["steps"]):
            tic = time.perf_counter()
            run()
            run.finish()
            times.append(time.perf_counter() - tic)
    except torch.OutOfMemoryError:
        return {"error": OOM}
    peak = ts.peak_bytes()
    return {"tok_s": spec["batch_size"] * spec["seq_len"] / statistics.median(times),
            "peak_gb": None if peak is None else peak / 1e9,
            "steps": len(times), "versions": ts.versions()}


def _cell(run: dict[str, Any] | None) -> str:
    if run is None:
        return f"{'':>20}"
    if "error" in run:
        return f"{run['error']:>20}"
    peak = "n/a" if run.get("peak_gb") is None else f"{run['peak_gb']:.1f}"
    return f"{run['tok_s']:>12.0f}{peak:>8}"


def print_table(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    s = PRESETS[a.preset]
    print(f"long-rows benchmark: Qwen3-shaped random model ({a.preset}), {s['layers']} layers x {s['hidden']} hidden, "
          f"intermediate {s['intermediate']}, {s['heads']} heads / {s['kv_heads']} kv heads, vocab {s['vocab']} "
          f"({'tied embedding' if a.preset in TIED else 'meshtune untied, torch tied'}), {a.dtype}; "
          f"device {describe_device()}")
    print(f"batch {a.batch_size}, gradient checkpointing {'on' if a.grad_checkpoint else 'off'} (both sides)"
          f"{'; meshtune rows spread over (L/2, L], a new length each step' if a.spread else ''}; "
          f"rank {RANK} on the 7 linear layers of every block "
          f"(PEFT lora_alpha {SCALE * RANK:g}); AdamW lr {LR:g}; {a.warmup} warm-up + {a.steps} timed steps, median")
    print(f"meshtune: `meshtune train` (MLX {mx.__version__}); torch: transformers + PEFT, eager, "
          f"SDPA" + (", gradient checkpointing (non-reentrant)" if a.grad_checkpoint else ""))
    if a.step:
        print("step: meshtune's compiled step alone (parallel/data_parallel_step.build_step) on the same model, a random "
              "row of the same length; train/step: the command's tokens/s over the step's")
    step_head = (f"{'its step alone':^20}  {'train/':>7}  ", f"{'tok/s':>12}{'peak GB':>8}  {'step':>7}  ") \
        if a.step else ("", "")
    print(f"\n  {'row':>7}  {'':<11}{'meshtune train':^20}  {step_head[0]}{'torch + PEFT':^20}{'meshtune/':>11}"
          f"{'memory':>9}")
    print(f"  {'tokens':>7}  {'':<11}{'tok/s':>12}{'peak GB':>8}  {step_head[1]}{'tok/s':>12}{'peak GB':>8}"
          f"{'torch':>11}{'ratio':>9}")
    for r in rows:
        mine, step, theirs = r["meshtune"], r.get("step"), r.get("torch")
        ratio = mem = ""
        if theirs is not None and "error" not in mine and "error" not in theirs:
            ratio = f"{mine['tok_s'] / theirs['tok_s']:.2f}x"
            if theirs.get("peak_gb"):
                mem = f"{mine['peak_gb'] / theirs['peak_gb']:.2f}x"
        step_cells = ""
        if a.step:
            alone = f"{mine['tok_s'] / step['tok_s']:.2f}x" if "error" not in mine and "error" not in step else ""
            step_cells = f"{_cell(step)}  {alone:>7}  "
        print(f"  {r['seq_len']:>7}  {LABELS[r['kind']]:<11}{_cell(mine)}  {step_cells}{_cell(theirs)}{ratio:>11}"
              f"{mem:>9}")


def main(argv: list[str]) -> int:
    a = _settings(argv)
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[bench long-rows +{time.perf_counter() - start:.0f}s] {message}", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="meshtune-long-rows-") as tmp:
        work = Path(tmp)
        dense = write_model(a.preset, getattr(mx, a.dtype), work / "model")
        models = {"lora": dense, "dora": dense}
        if "qlora" in a.kinds:
            models["qlora"] = _quantized(dense, work / "model-4bit")
        for seq_len in a.seq_lens:
            spread = [seq_len // 2 + (i + 1) * (seq_len - seq_len // 2) // (a.warmup + a.steps)
                      for i in range(a.warmup + a.steps)] if a.spread else None
            data = write_data(work / f"data-{seq_len}", dense, seq_len, rows=2 * a.batch_size, lengths=spread)
            for kind in a.kinds:
                mine = meshtune_row(a, models[kind], data, kind, seq_len, work / f"run-{kind}-{seq_len}")
                step = step_row(a, models[kind], kind, seq_len) if a.step else None
                theirs = torch_row(a, seq_len) if kind == "lora" and not a.no_torch else None
                rows.append({"seq_len": seq_len, "kind": kind, "meshtune": mine, "step": step, "torch": theirs})
                progress(f"{seq_len} {kind}: meshtune {_cell(mine).strip()}"
                         + (f", its step {_cell(step).strip()}" if a.step else "")
                         + f", torch {_cell(theirs).strip() or '-'}")
    print_table(a, rows)
    if a.json:
        print(json.dumps({"rows": rows, "preset": a.preset, "shape": {k: PRESETS[a.preset][k] for k in SHAPE_KEYS},
                          "dtype": a.dtype, "device": describe_device(), "mlx": mx.__version__,
                          "warmup": a.warmup, "steps": a.steps, "batch_size": a.batch_size,
                          "grad_checkpoint": a.grad_checkpoint, "spread": a.spread, "step": a.step, "rank": RANK,
                          "scale": SCALE,
                          "lr": LR}))
    return 0


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    print(json.dumps(_step_child(_spec) if _spec.get("side") == "step" else _torch_child(_spec)))
