"""`meshtune bench torch`: meshtune beside PyTorch + transformers + PEFT, same model, batch and adapters.

One process times meshtune's compiled step and a PEFT user's eager loop in turn, per fine-tuning
kind: tokens/s, peak memory and useful TFLOP/s against each framework's matmul peak (torch_side.py
is the PyTorch side). HELP, the command's --help, says how; docs/performance.md ("PyTorch + PEFT")
holds the figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..runtime.blas import describe_blas
from ..runtime.heap import keep_freed_memory
from ..training.in_flight import overlaps_steps
from .adapters import meshtune_step_runner, describe_device, time_step_rounds
from . import fit
from ..runtime.device_memory import Machine, detect
from .fit import GB, Load
from .models import BITS, GROUP_SIZE, Shape, add_adapters, build_model
from .flags import BenchParser, COUNT, at_least

HELP = """`meshtune bench torch`: meshtune beside PyTorch + transformers + PEFT, same model, batch and adapters.

On NVIDIA hardware the alternative to meshtune is a PEFT training loop. This suite builds
the same random Qwen3-shaped model (tied embedding) in both frameworks and times, in one
process, meshtune's compiled training step and the step a PEFT user runs: eager PyTorch,
SDPA attention, AdamW (fused on CUDA), transformers' own label shift (torch_side.py). For
LoRA, DoRA and full fine-tuning it prints tokens/s, peak memory and useful TFLOP/s with its
fraction of each framework's measured matmul peak; 4-bit LoRA is meshtune's alone.

    meshtune bench torch                       # 1.7b on a GPU with the memory for it, else tiny
    meshtune bench torch --preset tiny --json  # seconds on a CPU; what the test runs
    meshtune bench torch --preset 1.7b --json  # Qwen3-1.7B's shape, batch 4 x 1024, one GPU

Method. Per fine-tuning kind both models are built from the reference shape (random
weights, bfloat16 on a GPU, float32 on the CPU), adapted with rank 8 on every linear layer
of every block (meshtune scale 20 = PEFT lora_alpha 20 x 8 = 160; full: every parameter
trains in both), given AdamW lr 1e-5 (weight decay 0.01, both frameworks' default) and one
fixed random batch. --warmup steps of each (the first compiles or picks kernels) are untimed;
then --rounds rounds alternate the frameworks (meshtune's steps, torch's steps, ...), so a
drifting host hits both, and the median step is reported; both are freed before the next
kind. meshtune's step is `parallel.data_parallel_step.build_step` as `meshtune train` runs it
(overlapped on a GPU, runtime.overlap_steps), with freed memory kept and, on the CPU, its
vectorised SwiGLU. Useful FLOPs per step: 4 x N x tokens for LoRA and DoRA (forward plus the
activations' backward; adapter FLOPs left out), 6 x N x tokens for full fine-tuning, N the
parameters counted once (the tied embedding once); the same N and formula on both sides, so
the TFLOP/s ratio is the tokens/s ratio. The matmul peak of each framework is measured here:
back-to-back --matmul-size square matmuls in the run's dtype, the best of three windows.
Peak memory is each framework's own allocator's peak during its kind (torch's is tracked on
CUDA only).
"""

LIBRARIES = ("torch", "transformers", "peft")
KINDS = ("lora", "dora", "qlora", "full")
LABELS = {"lora": "LoRA", "dora": "DoRA", "qlora": "4-bit LoRA", "full": "full"}
TORCH_KINDS = ("lora", "dora", "full")  # 4-bit LoRA is meshtune's alone
# Useful FLOPs per parameter and token: forward 2, backward to the activations 2, to the weights 2.
FLOPS_PER_PARAM_TOKEN = {"lora": 4, "dora": 4, "qlora": 4, "full": 6}
LR = 1e-5
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=1024,
                 batch_size=2, seq_len=32, warmup=2, steps=6, rounds=3, matmul_size=512),
    "1.7b": dict(layers=28, hidden=2048, intermediate=6144, heads=16, kv_heads=8, vocab=151936,
                 batch_size=4, seq_len=1024, warmup=3, steps=12, rounds=4, matmul_size=8192),
}
SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")


def useful_flops(kind: str, params: int, tokens: int) -> int:
    """FLOPs a step of `kind` must do on `params` parameters and `tokens` tokens (attention's L^2 term left out)."""
    return FLOPS_PER_PARAM_TOKEN[kind] * params * tokens


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench torch", description=HELP)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="tiny (CPU) or 1.7b (Qwen3-1.7B's shape, a GPU). Default: 1.7b where it fits this "
                        "device's memory (bench/fit.py), else tiny; said in the first line.")
    for flag in ("batch-size", "seq-len", "warmup", "steps", "rounds", "matmul-size"):
        p.add_argument(f"--{flag}", type=at_least(0) if flag == "warmup" else COUNT, default=None,
                       help="Default: the preset's.")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="Fine-tuning kinds to time (qlora: 4-bit LoRA, meshtune only).")
    p.add_argument("--rank", type=COUNT, default=8, help="Adapter rank.")
    p.add_argument("--scale", type=float, default=20.0, help="meshtune's adapter scale (PEFT: alpha = scale x rank).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the weights and the batch.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def missing_libraries() -> list[str]:
    """Those of torch, transformers and peft that do not import here, each with the reason."""
    missing = []
    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except (ImportError, OSError) as err:
            missing.append(f"{name} ({err})")
    return missing


def choose_preset(requested: str | None, batch: int | None, seq: int | None, dtype_bytes: int,
                  machine: Machine) -> tuple[str, str]:
    """(preset, the line that says why), by fit.choose_preset: 1.7b where it fits a GPU, else tiny."""
    # Two frameworks each hold a fully trained model at the full-fine-tuning peak, like two ranks.
    return fit.choose_preset(requested, Load(full=True, processes=2, dtype_bytes=dtype_bytes), machine,
                             batch=batch, seq=seq, presets=PRESETS)


def _settings(argv: list[str]) -> argparse.Namespace:
    a = _parser().parse_args(argv)
    missing = missing_libraries()
    if missing:
        raise ValueError(f"meshtune bench torch needs PyTorch, transformers and PEFT; not importable here: "
                         f"{', '.join(missing)}; pip install torch transformers peft")
    a.on_gpu = mx.default_device().type == mx.DeviceType.gpu
    a.dtype = "bfloat16" if a.on_gpu else "float32"
    a.preset, a.fit_line = choose_preset(a.preset, a.batch_size, a.seq_len, 2 if a.on_gpu else 4, detect())
    for name, value in PRESETS[a.preset].items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    if min(a.batch_size, a.seq_len, a.steps, a.rounds, a.matmul_size) < 1 or a.warmup < 0:
        raise ValueError("--batch-size, --seq-len, --steps, --rounds and --matmul-size must be >= 1, --warmup >= 0")
    a.kinds = [k for k in KINDS if k in a.kinds]  # the table's order
    a.overlap = overlaps_steps("auto")
    return a


def mlx_model(a: argparse.Namespace, kind: str) -> nn.Module:
    """The random Qwen3 model of the preset with a tied embedding, adapted as `meshtune train` adapts it."""
    from ..adapters import apply_adapters

    shape = Shape("qwen3", **{k: getattr(a, k) for k in SHAPE_KEYS})
    model = build_model(shape, getattr(mx, a.dtype), quantized=False, seed=a.seed)
    # build_model's head is untied; Qwen3-1.7B ties it to the embedding, as transformers' model here does.
    model.pop("lm_head")
    model.args.tie_word_embeddings = True
    if kind == "qlora":
        nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(model.parameters())
    if kind == "full":
        apply_adapters(model, fine_tune_type="full", num_layers=-1, keys=None, rank=a.rank, scale=a.scale, dropout=0.0)
        model.unfreeze()  # every parameter, as the torch side trains them (norms and the embedding too)
    else:
        add_adapters(model, impl="meshtune", kind="dora" if kind == "dora" else "lora", num_layers=-1,
                     rank=a.rank, scale=a.scale)
    model.train()
    return model


def mlx_step(a: argparse.Namespace, model: nn.Module) -> Callable[[], mx.array]:
    """meshtune's compiled step on one fixed random batch of batch x seq tokens (seq + 1 with the target)."""
    run = meshtune_step_runner(model, optim.AdamW(learning_rate=LR), a.overlap)
    tokens = mx.random.randint(0, a.vocab, (a.batch_size, a.seq_len + 1), key=mx.random.key(a.seed))
    lengths = mx.array([[0, a.seq_len + 1]] * a.batch_size, dtype=mx.int32)
    mx.eval(tokens, lengths)

    def one_step() -> mx.array:
        return run(tokens, lengths)

    one_step.finish = run.finish
    return one_step


def _size(tree: Any) -> int:
    return sum(v.size for _, v in tree_flatten(tree))


def mlx_matmul_tflops(n: int, dtype: str, seconds: float, trials: int = 3) -> float:
    """The best TFLOP/s of `trials` windows of back-to-back n x n @ n x n matmuls in MLX."""
    a, b = (mx.random.normal((n, n), key=mx.random.key(i)).astype(getattr(mx, dtype)) for i in (1, 2))
    mx.eval(a, b)

    def window(k: int) -> float:
        tic = time.perf_counter()
        for start in range(0, k, 8):  # a few per evaluation: the GPU is never left idle between them
            mx.eval([a @ b for _ in range(min(8, k - start))])
        return time.perf_counter() - tic

    window(2)
    k = max(1, int(seconds / max(window(1), 1e-6)))
    return max(2 * n ** 3 * k / window(k) / 1e12 for _ in range(trials))


def measure_kind(a: argparse.Namespace, kind: str, ts: Any, progress: Callable[[str], None]) -> dict[str, dict]:
    """meshtune's and (for all but qlora) torch's figures for `kind`, their steps interleaved."""
    mx.reset_peak_memory()
    model = mlx_model(a, kind)
    counts = {"meshtune": {"trainable": _size(model.trainable_parameters())}}
    steps = {"meshtune": mlx_step(a, model)}
    if kind in TORCH_KINDS:
        ts.reset_peak()
        tmodel = ts.build_model({k: getattr(a, k) for k in SHAPE_KEYS}, a.dtype, a.seed)
        tmodel = ts.adapt(tmodel, kind, a.rank, a.scale * a.rank)
        counts["torch"] = {"trainable": ts.count(tmodel, trainable_only=True)}
        steps["torch"] = ts.step_runner(tmodel, LR, a.vocab, a.batch_size, a.seq_len, a.seed)
    rounds = time_step_rounds(steps, a, progress)
    peaks = {"meshtune": mx.get_peak_memory(), "torch": ts.peak_bytes()}
    tokens = a.batch_size * a.seq_len
    out = {}
    for side, per_round in rounds.items():
        step_s = statistics.median(t for r in per_round for t in r)
        tflops = useful_flops(kind, a.params, tokens) / step_s / 1e12
        out[side] = {**counts[side], "step_ms": step_s * 1e3, "tok_s": tokens / step_s,
                     "peak_gb": None if peaks[side] is None else peaks[side] / GB, "tflops": tflops,
                     "peak_fraction": tflops / a.matmul[side]}
    progress(f"{LABELS[kind]}: " + ", ".join(f"{s} {v['tok_s']:.0f} tok/s" for s, v in out.items()))
    del steps, model
    if kind in TORCH_KINDS:
        del tmodel
    ts.release()
    mx.clear_cache()
    return out


def param_counts(a: argparse.Namespace, ts: Any) -> dict[str, int]:
    """The dense model's parameters counted in each framework (tied embedding once)."""
    model = mlx_model(a, "lora")
    mine = _size(model.parameters()) - _size(model.trainable_parameters())  # the base, adapters left out
    tmodel = ts.build_model({k: getattr(a, k) for k in SHAPE_KEYS}, a.dtype, a.seed)
    theirs = ts.count(tmodel)
    del model, tmodel
    ts.release()
    return {"meshtune": mine, "torch": theirs}


def _cell(run: dict | None) -> str:
    if run is None:
        return f"{'(meshtune only)':>38}"
    peak = "n/a" if run["peak_gb"] is None else f"{run['peak_gb']:.3g}"
    return f"{run['tok_s']:>10.0f}{peak:>8}{run['tflops']:>10.3g}{100 * run['peak_fraction']:>9.1f}%"


def print_table(a: argparse.Namespace, runs: dict[str, dict], counts: dict[str, int], ts: Any) -> None:
    tokens = a.batch_size * a.seq_len
    same = "in both" if counts["meshtune"] == counts["torch"] else "MISMATCH"
    print(f"torch peer benchmark: Qwen3-shaped random model, {a.layers} layers x {a.hidden} hidden, intermediate "
          f"{a.intermediate}, {a.heads} heads / {a.kv_heads} kv heads, vocab {a.vocab} (tied embedding); "
          f"N = {counts['meshtune']:,} parameters {same} (torch {counts['torch']:,})")
    print(f"device {describe_device()}, {a.dtype}; {describe_blas()}")
    print(f"meshtune: MLX {mx.__version__}, its compiled training step (parallel/data_parallel_step.build_step), "
          + ("each dispatched while the one before runs" if a.overlap else "each waited for")
          + " (runtime.overlap_steps auto), as `meshtune train` runs it")
    print(f"torch: {ts.describe()}; Qwen3ForCausalLM + PEFT, eager (no torch.compile), SDPA attention, AdamW "
          f"({'fused' if a.on_gpu else 'foreach'}), labels shifted by transformers")
    print(f"adapters: rank {a.rank} on the 7 linear layers of all {a.layers} blocks, meshtune scale {a.scale:g} = "
          f"PEFT lora_alpha {a.scale * a.rank:g}; full: every parameter trains; AdamW lr {LR:g}; 4-bit: group "
          f"{GROUP_SIZE}, meshtune only")
    print(f"step: batch {a.batch_size} x {a.seq_len} tokens, {a.warmup} warm-up + {a.rounds} rounds x "
          f"{-(-a.steps // a.rounds)} timed steps, rounds alternating meshtune and torch; median step")
    print(f"useful FLOPs per step: 4 x N x tokens (LoRA, DoRA, 4-bit LoRA; adapter FLOPs left out), 6 x N x tokens "
          f"(full); matmul peak ({a.matmul_size}^3 {a.dtype}, best of 3): meshtune {a.matmul['meshtune']:.3g}, "
          f"torch {a.matmul['torch']:.3g} TFLOP/s")
    print(f"\n  {'':<12}{'trainable':>12}  {'meshtune':-^38}  {'torch + PEFT':-^38}{'meshtune/':>11}")
    head = f"{'tok/s':>10}{'peak GB':>8}{'TFLOP/s':>10}{'of peak':>10}"
    print(f"  {'':<12}{'':>12}  {head}  {head}{'torch':>11}")
    for kind, run in runs.items():
        torch_run = run.get("torch")
        ratio = f"{run['meshtune']['tok_s'] / torch_run['tok_s']:>10.2f}x" if torch_run else ""
        print(f"  {LABELS[kind]:<12}{run['meshtune']['trainable']:>12,}  {_cell(run['meshtune'])}  "
              f"{_cell(torch_run)}{ratio}")
    print(f"  (tokens per step {tokens}; peak GB: each framework's own allocator"
          + ("" if a.on_gpu else "; torch does not track its CPU memory") + ")")


def main(argv: list[str]) -> int:
    a = _settings(argv)
    print(a.fit_line, flush=True)
    keep_freed_memory()  # before any model exists, as `meshtune train` does (runtime.keep_freed_memory)
    ts = importlib.import_module(".torch_side", __package__).TorchSide(a.on_gpu)
    if not a.on_gpu:
        from ..runtime.fastmath import install_fast_swiglu

        install_fast_swiglu()  # runtime.fast_cpu_activations, on by default
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[bench torch +{time.perf_counter() - start:.0f}s] {message}", file=sys.stderr, flush=True)

    counts = param_counts(a, ts)
    a.params = counts["meshtune"]
    seconds = 0.5 if a.on_gpu else 0.3
    a.matmul = {"meshtune": mlx_matmul_tflops(a.matmul_size, a.dtype, seconds),
                "torch": ts.matmul_tflops(a.matmul_size, a.dtype, seconds)}
    progress(f"matmul peak: meshtune {a.matmul['meshtune']:.3g}, torch {a.matmul['torch']:.3g} TFLOP/s")
    runs = {kind: measure_kind(a, kind, ts, progress) for kind in a.kinds}
    print_table(a, runs, counts, ts)
    if a.json:
        print(json.dumps({
            "ratios": {f"{k}_tok_s": r["meshtune"]["tok_s"] / r["torch"]["tok_s"] for k, r in runs.items()
                       if "torch" in r},
            "runs": runs, "params": counts, "matmul_tflops": a.matmul, "matmul_size": a.matmul_size,
            "flops_per_param_token": {k: FLOPS_PER_PARAM_TOKEN[k] for k in a.kinds},
            "preset": a.preset, "shape": {k: getattr(a, k) for k in SHAPE_KEYS}, "dtype": a.dtype,
            "device": describe_device(), "torch_side": ts.versions(), "mlx": mx.__version__,
            "batch_size": a.batch_size, "seq_len": a.seq_len, "tokens_per_step": a.batch_size * a.seq_len,
            "warmup": a.warmup, "steps": a.steps, "rounds": a.rounds, "rank": a.rank, "scale": a.scale,
            "lora_alpha": a.scale * a.rank, "lr": LR, "overlap_steps": a.overlap,
        }))
    return 0
