"""`meshtune bench scaling --in-process`: the scaling table measured inside one distributed job.

For accelerators (NCCL on GPUs, or any backend MLX's own launcher starts), every rank runs this
module; rank 0 prints. Each rank times its own step without gradient sync (the 1-rank figure) and
the N-rank steps with the sync after the backward and overlapped, in the same rounds (`measure`),
after checking that both sums agree (`sum_mismatch`); `_row` gives the ratios.

    mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 -- \\
        python -m meshtune.cli bench scaling --in-process --preset 1b --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..runtime.mesh import Mesh
from .fit import ORDER, Load, choose_preset, detect
from .models import PRESETS, Shape, add_adapters, build_model

MODES = ("compute", "after_backward", "overlap")
SYNCED = MODES[1:]


def sum_mismatch(model: nn.Module, mesh: Mesh, tokens: mx.array, lengths: mx.array, bucket_mb: float) -> float:
    """Largest relative difference between the compiled backward's gradients summed
    after_backward and summed overlapped (per tensor, |a - b|max / |a|max).

    The two are separately compiled graphs, so bfloat16 kernels may round apart (~1e-3);
    a sum that read unwritten buffers or paired wrong ones is off by O(1).
    """
    from ..parallel.gradient_sums import sum_gradients
    from ..training.model_loss import loss_terms

    loss_and_grad = nn.value_and_grad(model, loss_terms)
    after = mx.compile(lambda t, l: sum_gradients(loss_and_grad(model, t, l)[1], mesh, bucket_mb=bucket_mb))
    over = mx.compile(lambda t, l: sum_gradients(loss_and_grad(model, t, l)[1], mesh, mode="overlap",
                                                 bucket_mb=bucket_mb))(tokens, lengths)
    # One after the other: evaluated together, the comm stream's all_sums and the default
    # stream's could run in different orders on different ranks and pair wrong buffers.
    mx.eval(over)
    grads = after(tokens, lengths)
    mx.eval(grads)
    summed = [[g.astype(mx.float32) for _, g in tree_flatten(tree)] for tree in (grads, over)]
    worst = 0.0
    for x, y in zip(*summed):
        scale = mx.abs(x).max().item()
        worst = max(worst, mx.abs(x - y).max().item() / scale if scale > 0 else mx.abs(y).max().item())
    return worst


def measure(kind: str, a: argparse.Namespace, shape: Shape, mesh: Mesh, dtype: mx.Dtype) -> dict[str, Any]:
    """Per round, the median step seconds of the three modes for `kind` (lora or full),
    each the mean over ranks of every rank's own median.

    Each rank builds the same random model (`--preset 1b`: ~1B parameters, bench/models.py; without
    --preset, the largest size every rank's memory fits, bench/fit.py) and three compiled steps over
    the same model and optimizer: `compute` (this rank's local batch on a mesh of one, no gradient
    sync: what one GPU alone does with the same batch), `after_backward` and `overlap` (buckets in
    reverse layer order, all_sums on their own GPU stream). Every round times the 1-rank step first,
    then the two N-rank steps (their order alternating), so 1 rank and N ranks come from the same
    invocation and the same stretch of clock.
    """
    from ..parallel.data_parallel_step import build_step

    model = build_model(shape, dtype, quantized=False, seed=a.seed)
    add_adapters(model, impl="meshtune", kind=kind, num_layers=-1, rank=8, scale=20.0)
    model.train()
    optimizer = optim.Adam(learning_rate=1e-6)
    state = [model.state, optimizer.state]
    # Every rank its own batch (seeded by rank): data parallelism's local batch.
    key = mx.random.key(a.seed + 1 + mesh.rank)
    tokens = mx.random.randint(0, shape.vocab, (a.batch_size, a.seq_len + 1), key=key)
    lengths = mx.array([[0, a.seq_len + 1]] * a.batch_size, dtype=mx.int32)
    mx.eval(tokens, lengths)

    def runner(m: Mesh, sync: str) -> Callable[[], Any]:
        step = build_step(model, optimizer, m, max_grad_norm=0.0, compile=True, sync=sync,
                          bucket_mb=a.bucket_mb)

        def run() -> Any:
            ce, n, _ = step.finish(tokens, lengths, None, None)
            mx.eval(state, ce, n)
            return ce

        return run

    # "compute": a mesh of one, so the compiled step has no cross-rank sum: this GPU alone.
    steps = {"compute": runner(Mesh.single(), "after_backward"),
             "after_backward": runner(mesh, "after_backward"), "overlap": runner(mesh, "overlap")}
    for run in steps.values():
        for _ in range(a.warmup):
            run()
    mismatch = sum_mismatch(model, mesh, tokens, lengths, a.bucket_mb)
    rounds = []
    for r in range(a.rounds):
        # 1 rank first, then the two synced modes, which alternate in second place.
        order = ("compute",) + (SYNCED if r % 2 == 0 else SYNCED[::-1])
        medians = {}
        for mode in order:
            mesh.all_sum(mx.array(0.0)).item()  # line the ranks up before each block
            steps[mode]()  # untimed: the switch from another graph's buffers
            times = []
            for _ in range(a.steps):
                tic = time.perf_counter()
                steps[mode]()
                times.append(time.perf_counter() - tic)
            medians[mode] = statistics.median(times)
        rounds.append([medians[m] for m in MODES])
    # Mean over ranks: each rank's 1-rank step is its own GPU alone; the synced steps agree anyway.
    mean = (mesh.all_sum(mx.array(rounds, dtype=mx.float32)) / mesh.world_size).tolist()
    params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return {"rounds_s": [dict(zip(MODES, row)) for row in mean], "trainable": params,
            "overlap_sum_mismatch": mismatch}


def spread(values: list[float]) -> tuple[float, list[float]]:
    """Median and [min, max] of per-round values."""
    return statistics.median(values), [min(values), max(values)]


def _row(kind: str, r: dict[str, Any], n: int, tokens: int) -> dict[str, Any]:
    """The JSON figures of one kind: step times are medians over rounds; each ratio is
    taken per round (the same round's 1-rank and N-rank steps) and given as its median
    over rounds and its spread [min, max].

    Weak-scaling efficiency = 1-rank step / N-rank step: each GPU keeps its local batch, so N GPUs
    do N times the work per step, and this is N-rank tokens/s over N x 1-rank tokens/s (the faster
    synced mode; each mode's own in weak_scaling_after/_overlap). Overlap speedup = after_backward
    step / overlap step. Exposed communication = synced step - 1-rank step.
    """
    per = r["rounds_s"]
    one, after, over = (statistics.median(x[m] for x in per) for m in MODES)
    ratios = {
        "weak_scaling": [x["compute"] / min(x["after_backward"], x["overlap"]) for x in per],
        "weak_scaling_after": [x["compute"] / x["after_backward"] for x in per],
        "weak_scaling_overlap": [x["compute"] / x["overlap"] for x in per],
        "overlap_speedup": [x["after_backward"] / x["overlap"] for x in per],
    }
    out: dict[str, Any] = {
        f"tok_s_1_{kind}": tokens / one, f"tok_s_{n}_after_{kind}": n * tokens / after,
        f"tok_s_{n}_overlap_{kind}": n * tokens / over,
        f"exposed_comm_ms_after_{kind}": 1e3 * (after - one),
        f"exposed_comm_ms_overlap_{kind}": 1e3 * (over - one),
        f"exposed_comm_fraction_after_{kind}": max(after - one, 0.0) / after,
        f"exposed_comm_fraction_overlap_{kind}": max(over - one, 0.0) / over,
        f"step_ms_{kind}": {"compute": 1e3 * one, "after_backward": 1e3 * after, "overlap": 1e3 * over},
        f"step_ms_rounds_{kind}": {m: [1e3 * x[m] for x in per] for m in MODES},
    }
    for name, values in ratios.items():
        out[f"{name}_{kind}"], out[f"{name}_{kind}_spread"] = spread(values)
    return out


def agreed_preset(a: argparse.Namespace, mesh: Mesh) -> tuple[str, str]:
    """The preset every rank runs (the smallest any rank's memory fits) and this rank's line about it.

    The ranks of one host share its RAM on a CPU (counted as all of them); a GPU is each rank's own.
    """
    gpu = mx.default_device().type == mx.DeviceType.gpu
    load = Load(full=True, processes=1 if gpu else mesh.world_size, dtype_bytes=2 if gpu else 4)
    preset, line = choose_preset(a.preset, load, detect(), batch=a.batch_size, seq=a.seq_len)
    if a.preset is None and mesh.world_size > 1:
        smallest = ORDER[min(mesh.all_ints(ORDER.index(preset)))]
        if smallest != preset:
            line += f"; {smallest}, the largest every rank fits"
        preset = smallest
    return preset, line


def _ratio(value: float, bounds: list[float], percent: bool) -> str:
    """A ratio and its spread over rounds as the table prints it: 86.0% (84.1-88.2) or 1.03x (1.01-1.05)."""
    if percent:
        return f"{100 * value:.1f}% ({100 * bounds[0]:.1f}-{100 * bounds[1]:.1f})"
    return f"{value:.2f}x ({bounds[0]:.2f}-{bounds[1]:.2f})"


def main(a: argparse.Namespace) -> int:
    backend = a.backend
    # "any" without a launcher is one process: then every mode is the same 1-rank step.
    mesh = Mesh.from_world(mx.distributed.init(strict=backend != "any", backend=backend))
    a.preset, fit_line = agreed_preset(a, mesh)
    if mesh.rank == 0:
        print(fit_line, flush=True)
    for name, value in PRESETS[a.preset].items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    n = mesh.world_size
    shape = Shape(arch="qwen3", **{k: PRESETS[a.preset][k] for k in
                                   ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")})
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    tokens = a.batch_size * a.seq_len
    result: dict[str, Any] = {"ranks": n, "backend": backend, "preset": a.preset, "batch_size": a.batch_size,
                              "seq_len": a.seq_len, "params": shape.params(), "mlx": mx.__version__,
                              "rounds": a.rounds, "steps": a.steps, "one_rank": "mean over ranks"}
    rows = {}
    for kind in ("lora", "full"):
        r = measure(kind, a, shape, mesh, dtype)
        rows[kind] = r
        result.update(_row(kind, r, n, tokens))
        result[f"overlap_sum_mismatch_{kind}"] = r["overlap_sum_mismatch"]
        gc.collect()
        mx.clear_cache()
    result["exposed_comm_fraction_overlap"] = result["exposed_comm_fraction_overlap_full"]
    if mesh.rank == 0:
        from .adapters import describe_device

        print(f"scaling benchmark (in-process, {backend} backend, {n} ranks): {shape.describe()}, "
              f"{'bfloat16' if gpu else 'float32'}, local batch {a.batch_size} x {a.seq_len} per rank, "
              f"buckets {a.bucket_mb} MB, {a.rounds} rounds x {a.steps} steps per mode; {describe_device()}; "
              f"mlx {mx.__version__}")
        print("1 rank = each rank's own step without gradient sync (a mesh of one), timed first in every round, "
              f"then the {n}-rank after_backward and overlap steps; step ms = median over rounds of the mean over "
              "ranks of each rank's median; ratios per round, median (min-max over rounds)")
        print(f"{'':<6}{'1 rank tok/s':>14}{f'{n} after tok/s':>16}{f'{n} overlap tok/s':>18}"
              f"{'step ms 1 / after / overlap':>30}{'exposed ms after / overlap':>28}{'weak eff. (min-max)':>23}"
              f"{'overlap (min-max)':>21}{'sum rel. diff':>15}")
        for kind, r in rows.items():
            s = result[f"step_ms_{kind}"]
            weak = _ratio(result[f"weak_scaling_{kind}"], result[f"weak_scaling_{kind}_spread"], True)
            over = _ratio(result[f"overlap_speedup_{kind}"], result[f"overlap_speedup_{kind}_spread"], False)
            print(f"{kind:<6}{result[f'tok_s_1_{kind}']:>14.0f}{result[f'tok_s_{n}_after_{kind}']:>16.0f}"
                  f"{result[f'tok_s_{n}_overlap_{kind}']:>18.0f}"
                  f"{s['compute']:>12.1f} /{s['after_backward']:>7.1f} /{s['overlap']:>7.1f}"
                  f"{result[f'exposed_comm_ms_after_{kind}']:>15.1f} /{result[f'exposed_comm_ms_overlap_{kind}']:>7.1f}"
                  f"{weak:>23}{over:>21}{r['overlap_sum_mismatch']:>15.1e}")
        if a.json:
            print(json.dumps(result))
    return 0
