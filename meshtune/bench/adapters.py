"""`meshtune bench adapters`: stock mlx-lm and meshtune adapters side by side, one run.

Times the training step and the unfused decode of stock and meshtune LoRA and DoRA on a dense and
a 4-bit base, and prints the ratios the adapter work is judged by (adapters_targets.py). HELP, the
command's --help, says how; docs/performance.md holds the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from ..runtime.blas import describe_blas
from ..runtime.heap import keep_freed_memory
from ..training.in_flight import OneInFlight, overlaps_steps
from ..runtime.device_memory import detect
from .fit import Load, choose_preset
from .adapters_targets import RATIO_ROWS, TARGETS, met_target, target_verdict
from .models import BITS, GROUP_SIZE, PRESETS, Shape, add_adapters, build_model, perturb_adapters
from .flags import BenchParser, COUNT, at_least

if TYPE_CHECKING:
    from ..adapters import BasePath

HELP = """`meshtune bench adapters`: stock mlx-lm and meshtune adapters side by side, one run.

For a dense and a 4-bit base of the same random model it times the training step of
stock mlx-lm LoRA, stock DoRA, meshtune LoRA and meshtune DoRA (eight configurations),
and the unfused-adapter decode speed of the same four, then prints the ratios the
adapter work is judged by: 4-bit LoRA step / dense LoRA step, DoRA / LoRA step on each
base, and DoRA / LoRA generation tokens/s on each base, each for stock and meshtune.

    meshtune bench adapters                        # the largest preset this machine fits (bench/fit.py)
    meshtune bench adapters --preset tiny --json   # seconds; what the test runs
    meshtune bench adapters --preset small         # CPU, a couple of minutes on 2 cores
    meshtune bench adapters --preset 1b --json     # one GPU (MLX's CUDA or Metal build), ~1B params

Method. Each configuration builds a fresh model from the same seed (the 4-bit one via
`nn.quantize`, group 64), adds LoRA/DoRA rank 8 scale 20 on every linear layer of the
last --num-layers blocks, and runs Adam steps on one fixed random batch of
--batch-size x --seq-len tokens: --warmup steps (the first compiles) untimed, then
--steps steps timed from call to `mx.eval` returning, in --rounds rounds that visit all
eight configurations in turn (all eight models stay loaded); the median is reported. The
stock step is a copy of `mlx_lm.tuner.trainer.train`'s: `default_loss` under
`nn.value_and_grad`, `mx.compile` with model, optimizer and RNG state as inputs and
outputs, `average_gradients`, `optimizer.update`, the same `mx.eval` and its allocator
cache clear after every step. meshtune's is `meshtune.parallel.data_parallel_step.build_step`.
Generation is greedy `mlx_lm.generate.generate_step` at batch 1 after a short prompt, tokens/s over
the tokens after the first (prefill excluded), with random lora_b and a perturbed m so
the adapter is not an identity; per base the four models stay loaded and are decoded in
turn for max(3, --rounds) rounds, the median reported. Stock runs as shipped: its 4-bit
DoRA dequantizes the base weight on every call, which is its code.

The dense dtype is bfloat16 on a GPU and float32 on a CPU unless --dtype says otherwise
(MLX's CPU bfloat16 matmul bypasses BLAS and runs far slower than float32). JSON
keys ending in `_bf16` name the dense base whatever its dtype; `dense_dtype` says which.
"""

IMPLS = ("stock", "meshtune")
KINDS = ("lora", "dora")
BASES = ("bf16", "4bit")
LABELS = {"stock": "stock mlx-lm", "meshtune": "meshtune", "lora": "LoRA", "dora": "DoRA"}
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
PROMPT_TOKENS = 16
StepRunner = Callable[[mx.array, mx.array], mx.array]


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench adapters", description=HELP)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="Shapes and run sizes (flags below override): tiny, small (CPU), 1b (GPU). Default: the "
                        "largest that fits this device's memory (bench/fit.py), said in the first line.")
    p.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3", help="Model family of the shapes.")
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab", "batch-size", "seq-len",
                 "warmup", "steps", "gen-tokens"):
        p.add_argument(f"--{flag}", type=at_least(0) if flag == "warmup" else COUNT, default=None,
                       help="Default: the preset's.")
    p.add_argument("--num-layers", type=int, default=-1, help="Blocks to adapt, counted from the last (-1: all).")
    p.add_argument("--rank", type=COUNT, default=8, help="Adapter rank.")
    p.add_argument("--scale", type=float, default=20.0, help="Adapter scale.")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="Dense base dtype (auto: bfloat16 on a GPU, float32 on a CPU).")
    p.add_argument("--base-path", choices=["auto", "quantized", "dequantized"], default="auto",
                   help="meshtune's product for quantized bases (auto: measured crossover).")
    p.add_argument("--rounds", type=COUNT, default=3,
                   help="Timed steps are split into this many rounds over all configurations (interleaved).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the model weights and the batch.")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="Keep freed memory in the process, as training does (runtime.keep_freed_memory, "
                        "meshtune/runtime/heap.py; Linux with glibc): stock and meshtune both run under it.")
    p.add_argument("--overlap-steps", choices=["auto", "true", "false"], default="auto",
                   help="meshtune's steps as its training loop takes them (runtime.overlap_steps): each one "
                        "dispatched while the device runs the one before (auto: on a GPU). Stock mlx-lm's loop "
                        "waits for each step, as mlx_lm.lora does.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    p.add_argument("--combine", nargs="+", metavar="RUN", default=None,
                   help="Time nothing: judge the saved outputs of several --json invocations together, each "
                        "ratio per invocation and as their median (adapters_runs.py).")
    return p


def _settings(argv: list[str]) -> argparse.Namespace:
    """Parsed flags with every unset one taken from the preset."""
    a = _parser().parse_args(argv)
    if a.combine:  # times nothing: no model to size
        return a
    a.preset, a.fit_line = choose_preset(a.preset, memory_load(a), detect(), batch=a.batch_size, seq=a.seq_len)
    for name, value in PRESETS[a.preset].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.steps < 1 or a.gen_tokens < 2 or a.rounds < 1:
        raise ValueError("--steps and --rounds must be >= 1 and --gen-tokens >= 2 (decode speed needs two tokens)")
    # Whether meshtune's steps overlap here, as runtime.overlap_steps would decide.
    a.overlap = overlaps_steps({"true": True, "false": False}.get(a.overlap_steps, a.overlap_steps))
    return a


def memory_load(a: argparse.Namespace) -> Load:
    """What this bench holds at its peak: four dense models and four 4-bit ones (all eight stay
    loaded), plus the dense model each 4-bit one is quantized from, in the dense dtype."""
    return Load(dense=5, quantized=4, dtype_bytes=DTYPES[dense_dtype_name(a)].size)


def dense_dtype_name(a: argparse.Namespace) -> str:
    """--dtype, or for auto bfloat16 on a GPU and float32 on a CPU."""
    return a.dtype if a.dtype != "auto" else ("float32" if _on_cpu() else "bfloat16")


def generation_rounds(a: argparse.Namespace) -> int:
    """Decoding rounds per model: --rounds, at least three (batch-1 decoding is noisy)."""
    return max(3, a.rounds)


def shape_of(a: argparse.Namespace) -> Shape:
    """The model dimensions the parsed settings name."""
    return Shape(arch=a.arch, layers=a.layers, hidden=a.hidden, intermediate=a.intermediate,
                 heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def describe_device() -> str:
    """Backend and device name, e.g. "gpu (cuda, NVIDIA H200)" or "cpu (AMD EPYC)"."""
    cuda = getattr(mx, "cuda", None)
    backend = "cpu" if _on_cpu() else "cuda" if cuda is not None and cuda.is_available() else "metal"
    try:
        name = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):
        name = ""
    where = "cpu" if _on_cpu() else "gpu"
    return f"{where} ({', '.join(x for x in (backend if where == 'gpu' else '', name) if x)})"


def _stock_runner(model: nn.Module, optimizer: optim.Optimizer) -> StepRunner:
    """One step of mlx_lm.tuner.trainer.train (grad accumulation 1, one process), line for line."""
    from mlx.nn.utils import average_gradients
    from mlx_lm.tuner import trainer
    from mlx_lm.tuner.trainer import TrainingArgs, default_loss

    loss_value_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch: tuple[mx.array, mx.array], prev_grad: Any, do_update: bool) -> tuple:
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            optimizer.update(model, grad)
            grad = None
        return lvalue, toks, grad

    def run(tokens: mx.array, lengths: mx.array) -> mx.array:
        lvalue, toks, grad = step((tokens, lengths), None, True)
        mx.eval(state, lvalue, toks, grad)
        # Stock clears the allocator cache after every step (threshold 0 by default).
        getattr(trainer, "_clear_cache", lambda _: None)(TrainingArgs().clear_cache_threshold)
        return lvalue

    run.finish = lambda: None  # every step is waited for
    return run


def meshtune_step_runner(model: nn.Module, optimizer: optim.Optimizer, overlap: bool = False,
                         recomputed: tuple[type, ...] = ()) -> StepRunner:
    """One optimizer step of meshtune's loop (one micro-batch, one process); `recomputed`: the block classes
    gradient checkpointing recomputes (enable_grad_checkpoint's), as `meshtune train` tells its step.

    Overlapped (the loop's runtime.overlap_steps), a call dispatches its step and then waits
    for the previous call's, as meshtune.training.loop.train does; `run.finish()` waits for the last one.
    """
    from ..adapters import StepContext
    from ..runtime.mesh import Mesh
    from ..parallel.data_parallel_step import build_step

    step = build_step(model, optimizer, Mesh.single(), max_grad_norm=0.0, compile=True,
                      step_context=StepContext.for_run(recomputed=recomputed))
    state = [model.state, optimizer.state, mx.random.state]
    in_flight = OneInFlight(overlap)

    def run(tokens: mx.array, lengths: mx.array) -> mx.array:
        ce, n, _ = step.finish(tokens, lengths, None, None)
        loss = ce / n
        in_flight.run([state, loss], [loss])
        return loss

    run.finish = in_flight.finish
    return run


def _release() -> None:
    """Free the last configuration's model, optimizer and compiled graph before the next."""
    gc.collect()
    mx.clear_cache()


def build_step(impl: str, kind: str, base: str, a: argparse.Namespace, shape: Shape,
               dtype: mx.Dtype, paths: BasePath) -> Callable[[], mx.array]:
    """This configuration's model, optimizer and batch, as a call that runs one step (meshtune's bases
    multiplying through `paths`)."""
    model = build_model(shape, dtype, quantized=base == "4bit", seed=a.seed)
    add_adapters(model, impl=impl, kind=kind, num_layers=a.num_layers, rank=a.rank, scale=a.scale, base_path=paths)
    model.train()
    optimizer = optim.Adam(learning_rate=1e-5)
    run = _stock_runner(model, optimizer) if impl == "stock" else meshtune_step_runner(model, optimizer, a.overlap)
    # One fixed batch of full-length rows: lengths are (prompt offset 0, length), as mlx-lm's.
    tokens = mx.random.randint(0, shape.vocab, (a.batch_size, a.seq_len + 1), key=mx.random.key(a.seed))
    lengths = mx.array([[0, a.seq_len + 1]] * a.batch_size, dtype=mx.int32)
    mx.eval(tokens, lengths)

    def one_step() -> mx.array:
        return run(tokens, lengths)

    one_step.finish = run.finish  # waits for a step still in flight
    return one_step


def median_steps(rounds: dict[str, list[list[float]]]) -> dict[str, float]:
    """Each configuration's median step over all its rounds."""
    return {name: statistics.median([t for r in per for t in r]) for name, per in rounds.items()}


def time_step_rounds(steps: dict[str, Callable[[], mx.array]], a: argparse.Namespace,
                     progress: Callable[[str], None] = lambda message: None) -> dict[str, list[list[float]]]:
    """Seconds of each timed step of each configuration, a list a round.

    Run-to-run drift on a GPU (clocks, allocator state) moves single-configuration
    medians; timing every configuration in each of --rounds rounds spreads the drift
    over all of them, so the ratios compare like with like.
    """
    def finish(name: str) -> None:
        getattr(steps[name], "finish", lambda: None)()

    for name, run in steps.items():
        for _ in range(a.warmup):  # the first call compiles
            run()
        finish(name)
        progress(f"warmed up {name}")
    per_round = max(1, math.ceil(a.steps / a.rounds))
    times: dict[str, list[list[float]]] = {name: [] for name in steps}
    last: dict[str, mx.array] = {}
    for _ in range(a.rounds):
        for name, run in steps.items():
            this_round = []
            for _ in range(per_round):
                tic = time.perf_counter()
                last[name] = run()
                this_round.append(time.perf_counter() - tic)
            # An overlapped step still in flight is waited for inside its own configuration's
            # time (its last step's), never the next configuration's.
            tic = time.perf_counter()
            finish(name)
            this_round[-1] += time.perf_counter() - tic
            times[name].append(this_round)
    for name, loss in last.items():
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{name}: the loss is {loss.item()}; the timing would mean nothing")
    return times


STEP_RATIOS = {"qlora_over_lora_step": ("lora_4bit", "lora_bf16"),
               "dora_over_lora_step_bf16": ("dora_bf16", "lora_bf16"),
               "dora_over_lora_step_4bit": ("dora_4bit", "lora_4bit")}


def round_ratios(rounds: dict[str, list[list[float]]]) -> dict[str, list[float]]:
    """Each step ratio (ratios' keys) round by round, from each round's median step: how far one
    round's figure strays from another's, beside the whole run's medians."""
    out = {}
    for impl, prefix in (("meshtune", ""), ("stock", "stock_")):
        for key, (num, den) in STEP_RATIOS.items():
            out[prefix + key] = [statistics.median(n) / statistics.median(d)
                                 for n, d in zip(rounds[f"{impl}_{num}"], rounds[f"{impl}_{den}"])]
    return out


def _decode_tok_s(model: nn.Module, prompt: mx.array, tokens: int) -> float:
    """Greedy decode of `tokens` tokens; tokens/s over all but the first (which holds prefill)."""
    from mlx_lm.generate import generate_step

    tic, count = 0.0, 0
    for i, _ in enumerate(generate_step(prompt, model, max_tokens=tokens)):
        if i == 0:
            tic = time.perf_counter()
        else:
            count += 1
    return count / (time.perf_counter() - tic)


def generation_model(impl: str, kind: str, base: str, a: argparse.Namespace, shape: Shape,
                     dtype: mx.Dtype, paths: BasePath) -> Callable[[], float]:
    """This configuration's model with its unfused adapter, as a call that decodes and returns tokens/s."""
    model = build_model(shape, dtype, quantized=base == "4bit", seed=a.seed)
    add_adapters(model, impl=impl, kind=kind, num_layers=a.num_layers, rank=a.rank, scale=a.scale, base_path=paths)
    perturb_adapters(model, seed=a.seed + 1)
    model.eval()
    prompt = mx.random.randint(0, shape.vocab, (PROMPT_TOKENS,), key=mx.random.key(a.seed + 2))
    _decode_tok_s(model, prompt, 4)  # warm-up: kernel set-up and the allocator's first buffers
    return lambda: _decode_tok_s(model, prompt, a.gen_tokens)


def time_generate(base: str, a: argparse.Namespace, shape: Shape, dtype: mx.Dtype,
                  paths: BasePath) -> dict[str, float]:
    """Median decode tokens/s of the four configurations on this base, timed in interleaved rounds.

    Batch-1 decoding is launch-bound, so it moves with the host's load: each of
    generation_rounds(a) rounds decodes once with each of the four models, all four
    loaded, so drift falls on all of them and the DoRA / LoRA ratio compares like with like.
    """
    runs = {f"{impl}_{kind}_{base}": generation_model(impl, kind, base, a, shape, dtype, paths)
            for kind in KINDS for impl in IMPLS}
    tok_s: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(generation_rounds(a)):
        for name, run in runs.items():
            tok_s[name].append(run())
    return {name: statistics.median(v) for name, v in tok_s.items()}


def ratios(step_s: dict[str, float], gen: dict[str, float]) -> dict[str, float]:
    """The judged ratios for meshtune (bare keys) and stock (`stock_` keys)."""
    out = {}
    for impl, prefix in (("meshtune", ""), ("stock", "stock_")):
        s = {k[len(impl) + 1:]: v for k, v in step_s.items() if k.startswith(impl + "_")}
        g = {k[len(impl) + 1:]: v for k, v in gen.items() if k.startswith(impl + "_")}
        for key, (num, den) in STEP_RATIOS.items():
            out[prefix + key] = s[num] / s[den]
        out[prefix + "dora_over_lora_generate_4bit"] = g["dora_4bit"] / g["lora_4bit"]
        out[prefix + "dora_over_lora_generate_bf16"] = g["dora_bf16"] / g["lora_bf16"]
    return out


def _crossovers(paths: BasePath) -> dict[str, int | None]:
    """meshtune's measured quantized/dense crossover per layer shape (None: never dense): what `auto` chose."""
    from ..adapters.base_path import NEVER

    # measured()'s keys: experts, out, in, bits, group size, mode, dtype.
    return {"x".join(k.split(",")[1:3]): (None if v == NEVER else v) for k, v in paths.measured().items()}


def print_table(a: argparse.Namespace, shape: Shape, dense: str, step_s: dict[str, float],
                gen: dict[str, float], r: dict[str, float], crossovers: dict[str, int | None],
                by_round: dict[str, list[float]]) -> None:
    tokens = a.batch_size * a.seq_len
    label = {"bf16": dense, "4bit": f"{BITS}-bit"}
    print(f"adapters benchmark: {shape.describe()}")
    print(f"device {describe_device()}; dense base {dense}; 4-bit base: nn.quantize group {GROUP_SIZE}, "
          f"built from the dense one's seed")
    malloc = "freed memory kept in the process (meshtune/runtime/heap.py)" if a.keep_freed_memory else "defaults"
    print(f"{describe_blas()}; malloc: {malloc}")
    print("meshtune's steps: " + ("each dispatched while the device runs the one before, as its loop takes them "
                                  "(runtime.overlap_steps)" if a.overlap
                                  else "each waited for before the next (runtime.overlap_steps off)")
          + "; stock mlx-lm's: each waited for, as mlx_lm.lora's loop")
    layers = "all" if a.num_layers < 0 else f"the last {a.num_layers}"
    measured = ", ".join(f"{k}: {'never' if v is None else v}" for k, v in crossovers.items())
    print(f"adapters: rank {a.rank}, scale {a.scale:g}, every linear layer of {layers} blocks; meshtune base "
          f"path {a.base_path}" + (f" (dequantized from N tokens, per out x in: {measured})" if measured else ""))
    print(f"\ntraining step: batch {a.batch_size} x {a.seq_len} tokens, Adam, {a.warmup} warm-up + "
          f"{a.rounds} x {math.ceil(a.steps / a.rounds)} timed steps (rounds interleaved over the eight), "
          f"median ms/step (tokens/s)")
    print(f"  {'':<16}{LABELS['stock']:>22}{LABELS['meshtune']:>22}{'stock/meshtune':>16}")
    for base in BASES:
        for kind in KINDS:
            cells = [f"{step_s[f'{i}_{kind}_{base}'] * 1e3:9.1f} ({tokens / step_s[f'{i}_{kind}_{base}']:8.0f})"
                     for i in IMPLS]
            speedup = step_s[f"stock_{kind}_{base}"] / step_s[f"meshtune_{kind}_{base}"]
            print(f"  {LABELS[kind] + ' ' + label[base]:<16}{cells[0]:>22}{cells[1]:>22}{speedup:>15.2f}x")
    print(f"\ngeneration: unfused adapter, greedy, batch 1, {PROMPT_TOKENS}-token prompt, "
          f"{a.gen_tokens} tokens, decode tokens/s, median of {generation_rounds(a)} interleaved rounds")
    print(f"  {'':<16}{LABELS['stock']:>22}{LABELS['meshtune']:>22}{'meshtune/stock':>16}")
    for base in reversed(BASES):
        for kind in KINDS:
            st, ours = gen[f"stock_{kind}_{base}"], gen[f"meshtune_{kind}_{base}"]
            print(f"  {LABELS[kind] + ' ' + label[base]:<16}{st:>22.1f}{ours:>22.1f}{ours / st:>15.2f}x")
    print(f"\nratios{'':<32}{LABELS['stock']:>14}{LABELS['meshtune']:>12}{'meshtune by round':>20}   meshtune target")
    for key, text in RATIO_ROWS:
        text = text.format(dense=dense)
        target = target_verdict(key, r[key], _on_cpu())
        spread = f"{min(by_round[key]):.2f}-{max(by_round[key]):.2f}x" if key in by_round else ""
        print(f"  {text:<36}{r['stock_' + key]:>13.2f}x{r[key]:>11.2f}x{spread:>20}   {target}")
    print("  (by round: the lowest and highest of the ratio taken from each round's median steps alone)")


class _Progress:
    """Each stage's result as it comes, with the elapsed time, on stderr: a run cut short
    (a time limit on a lent GPU) still shows what it measured and where the time went."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[bench adapters +{time.perf_counter() - self.start:.0f}s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    a = _settings(argv)
    if a.combine:
        from .adapters_runs import main as combine_runs

        return combine_runs(a.combine, a.json)
    print(a.fit_line, flush=True)
    a.keep_freed_memory = a.keep_freed_memory and keep_freed_memory()  # before any model exists
    from ..adapters import BasePath

    paths = BasePath(a.base_path)  # every meshtune model's, as one run's layers share one
    shape = shape_of(a)
    dense = dense_dtype_name(a)
    dtype = DTYPES[dense]
    configs = [(impl, kind, base) for base in BASES for kind in KINDS for impl in IMPLS]
    progress = _Progress()
    steps = {f"{i}_{k}_{b}": build_step(i, k, b, a, shape, dtype, paths) for i, k, b in configs}
    rounds = time_step_rounds(steps, a, progress)
    step_s = median_steps(rounds)
    by_round = round_ratios(rounds)
    progress("timed the steps: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in step_s.items()))
    del steps
    _release()
    gen: dict[str, float] = {}
    for base in BASES:
        gen.update(measured := time_generate(base, a, shape, dtype, paths))
        progress(f"generation on the {base} base: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in measured.items()))
        _release()
    r = ratios(step_s, gen)
    crossovers = _crossovers(paths)
    print_table(a, shape, dense, step_s, gen, r, crossovers, by_round)
    if a.json:
        tokens = a.batch_size * a.seq_len
        print(json.dumps({
            **r,
            "step_ms": {k: v * 1e3 for k, v in step_s.items()},
            "step_tok_s": {k: tokens / v for k, v in step_s.items()},
            "generate_tok_s": gen,
            "targets": {k: f"{op} {b}" for k, b, op in TARGETS},
            "targets_met": {k: met_target(r[k], b, op) for k, b, op in TARGETS},
            "step_ratios_by_round": by_round,
            "device": describe_device(), "dense_dtype": dense, "blas": describe_blas(),
            "keep_freed_memory": a.keep_freed_memory, "overlap_steps": a.overlap,
            "base_path": a.base_path, "crossovers": crossovers, "preset": a.preset,
            "shape": {**vars(shape), "params": shape.params()},
            "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup,
            "gen_tokens": a.gen_tokens, "rank": a.rank, "scale": a.scale, "num_layers": a.num_layers,
        }))
    return 0
