"""`meshtune bench scaling --in-process`: the scaling table measured inside one distributed job.

For accelerators (NCCL on GPUs, or any backend MLX's own launcher starts), every rank
runs this module; rank 0 prints. Each rank builds the same random model (`--preset 1b`:
~1B parameters, bench/models.py; without --preset, the largest size every rank's memory
fits, bench/fit.py) and three compiled steps over the same model and optimizer:
`compute only` (this rank's local batch, no gradient sync: what one GPU alone does with
the same batch), `after_backward` and `overlap` (buckets in reverse layer order,
all_sums on their own GPU stream). Rounds visit the three in turn so
clock drift falls on all of them. Exposed communication = synced step - compute-only
step; weak-scaling efficiency = compute-only step / synced step (each GPU keeps its
local batch, so N GPUs do N times the work per step).

    mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 -- \\
        python -m meshtune.cli bench scaling --in-process --preset 1b --json

Before timing, the compiled backward's gradients are summed both ways and compared
(largest relative difference per tensor, printed): rounding apart between the two
compiled graphs is ~1e-3 in bfloat16, buffers paired wrongly across streams are O(1).
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

from ..parallel.mesh import Mesh
from .fit import ORDER, Load, choose_preset, detect
from .models import PRESETS, Shape, add_adapters, build_model

MODES = ("compute", "after_backward", "overlap")


def sum_mismatch(model: nn.Module, mesh: Mesh, tokens: mx.array, lengths: mx.array, bucket_mb: float) -> float:
    """Largest relative difference between the compiled backward's gradients summed
    after_backward and summed overlapped (per tensor, |a - b|max / |a|max).

    The two are separately compiled graphs, so bfloat16 kernels may round apart (~1e-3);
    a sum that read unwritten buffers or paired wrong ones is off by O(1).
    """
    from ..parallel.data_parallel import sum_gradients
    from ..training.step import loss_terms

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
    """Median step seconds of the three modes for `kind` (lora or full) on this rank."""
    from ..parallel.data_parallel import build_step

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
            ce, n, _, _ = step(tokens, lengths, None, None, True)
            mx.eval(state, ce, n)
            return ce

        return run

    steps = {"compute": runner(Mesh.single(), "after_backward"),
             "after_backward": runner(mesh, "after_backward"), "overlap": runner(mesh, "overlap")}
    for run in steps.values():
        for _ in range(a.warmup):
            run()
    mismatch = sum_mismatch(model, mesh, tokens, lengths, a.bucket_mb)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:  # each mode goes first in some round
            mesh.all_sum(mx.array(0.0)).item()  # line the ranks up before each block
            steps[mode]()  # untimed: the switch from another graph's buffers
            for _ in range(a.steps):
                tic = time.perf_counter()
                steps[mode]()
                times[mode].append(time.perf_counter() - tic)
    params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return {"step_s": {m: statistics.median(t) for m, t in times.items()}, "trainable": params,
            "overlap_sum_mismatch": mismatch}


def _row(kind: str, r: dict[str, Any], n: int, tokens: int, one_rank_ms: float | None = None) -> dict[str, float]:
    s = r["step_s"]
    one, after, over = s["compute"], s["after_backward"], s["overlap"]
    if one_rank_ms is not None:
        one = one_rank_ms / 1e3  # a separate 1-process run's step, not this process's sync-free step
    return {
        f"tok_s_1_{kind}": tokens / one, f"tok_s_{n}_after_{kind}": n * tokens / after,
        f"tok_s_{n}_overlap_{kind}": n * tokens / over,
        f"weak_scaling_{kind}": one / min(after, over),
        f"overlap_speedup_{kind}": after / over,
        f"exposed_comm_ms_after_{kind}": 1e3 * (after - one),
        f"exposed_comm_ms_overlap_{kind}": 1e3 * (over - one),
        f"exposed_comm_fraction_after_{kind}": max(after - one, 0.0) / after,
        f"exposed_comm_fraction_overlap_{kind}": max(over - one, 0.0) / over,
    }


def _one_rank_ms(path: str) -> dict[str, float]:
    """Per kind, the compute step (ms) from the JSON line a 1-process run of this bench printed."""
    import pathlib

    try:
        line = [l for l in pathlib.Path(path).read_text().splitlines() if l.lstrip().startswith("{")][-1]
        data = json.loads(line)
        return {kind: float(data[f"step_ms_{kind}"]["compute"]) for kind in ("lora", "full")}
    except (OSError, IndexError, KeyError, ValueError) as err:
        raise ValueError(f"--one-rank-json {path}: no 1-rank result in it ({err}); run this bench in one "
                         "process with --json and pass that output") from None


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


def main(a: argparse.Namespace) -> int:
    backend = a.backend
    # "any" without a launcher is one process: the 1-rank baseline run (--one-rank-json's source).
    mesh = Mesh.from_world(mx.distributed.init(strict=backend != "any", backend=backend))
    a.preset, fit_line = agreed_preset(a, mesh)
    if mesh.rank == 0:
        print(fit_line, flush=True)
    for name, value in PRESETS[a.preset].items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    baseline = _one_rank_ms(a.one_rank_json) if a.one_rank_json else {}
    n = mesh.world_size
    shape = Shape(arch="qwen3", **{k: PRESETS[a.preset][k] for k in
                                   ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")})
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = mx.bfloat16 if gpu else mx.float32
    tokens = a.batch_size * a.seq_len
    result: dict[str, Any] = {"ranks": n, "backend": backend, "preset": a.preset, "batch_size": a.batch_size,
                              "seq_len": a.seq_len, "params": shape.params(), "mlx": mx.__version__}
    rows = {}
    for kind in ("lora", "full"):
        r = measure(kind, a, shape, mesh, dtype)
        rows[kind] = r
        result.update(_row(kind, r, n, tokens, baseline.get(kind)))
        result[f"overlap_sum_mismatch_{kind}"] = r["overlap_sum_mismatch"]
        result[f"step_ms_{kind}"] = {m: 1e3 * v for m, v in r["step_s"].items()}
        gc.collect()
        mx.clear_cache()
    result["exposed_comm_fraction_overlap"] = result["exposed_comm_fraction_overlap_full"]
    if mesh.rank == 0:
        from .adapters import describe_device

        print(f"scaling benchmark (in-process, {backend} backend, {n} ranks): {shape.describe()}, "
              f"{'bfloat16' if gpu else 'float32'}, local batch {a.batch_size} x {a.seq_len} per rank, "
              f"buckets {a.bucket_mb} MB, {a.rounds} rounds x {a.steps} steps per mode; {describe_device()}; "
              f"mlx {mx.__version__}")
        print(f"1 rank = a separate 1-process run ({a.one_rank_json})" if baseline else
              "1 rank = the same process's step without gradient sync (compute only)")
        print(f"{'':<6}{'1 rank tok/s':>14}{f'{n} after tok/s':>16}{f'{n} overlap tok/s':>18}"
              f"{'step ms 1 / after / overlap':>30}{'exposed ms after / overlap':>28}{'weak eff.':>11}"
              f"{'overlap':>9}{'sum rel. diff':>15}")
        for kind, r in rows.items():
            s = {m: 1e3 * v for m, v in r["step_s"].items()}
            s["compute"] = baseline.get(kind, s["compute"])  # the 1-rank column's own step
            print(f"{kind:<6}{result[f'tok_s_1_{kind}']:>14.0f}{result[f'tok_s_{n}_after_{kind}']:>16.0f}"
                  f"{result[f'tok_s_{n}_overlap_{kind}']:>18.0f}"
                  f"{s['compute']:>12.1f} /{s['after_backward']:>7.1f} /{s['overlap']:>7.1f}"
                  f"{result[f'exposed_comm_ms_after_{kind}']:>15.1f} /{result[f'exposed_comm_ms_overlap_{kind}']:>7.1f}"
                  f"{100 * result[f'weak_scaling_{kind}']:>10.1f}%{result[f'overlap_speedup_{kind}']:>8.2f}x"
                  f"{r['overlap_sum_mismatch']:>15.1e}")
        if a.json:
            print(json.dumps(result))
    return 0
