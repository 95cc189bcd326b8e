"""`meshtune bench scaling`: 1 rank vs N ranks, gradient sync after the backward vs overlapped.

Weak scaling of CPU ranks under `meshtune launch --pin`, on loopback and on shaped links
(netbed.py); on GPUs inside one distributed job (scaling_inproc.py). HELP, the command's --help,
says how; docs/performance.md ("Data-parallel gradient sync") holds the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..runtime.blas import describe_blas
from ..parallel.launcher import launch_ranks
from .fit import Load, embedded_line
from .peer import metric_windows, steps_per_sec
from .flags import BenchParser, COUNT, at_least, positive_float

HELP = """`meshtune bench scaling`: 1 rank vs N ranks, gradient sync after the backward vs overlapped.

Weak scaling: every rank keeps the same local batch, so N ranks process N times the
tokens per step; efficiency = (N-rank tokens/s) / (N x 1-rank tokens/s). Each
configuration runs through `meshtune launch --pin` (one core and one BLAS thread per
rank, so 1 rank and N ranks get the same compute per rank). Exposed communication is
the N-rank step time minus the 1-rank step time (the compute-only step of the same
local batch). Plain loopback, and with `--link RATE[:DELAY]` (root) also the
shaped-link bed of meshtune/bench/netbed.py, both in the same invocation. `--links 1,2` runs
the bed with 1 and with 2 shaped links per rank (every rank's addresses in the ring hostfile,
as a host with two cables lists them), plus the control: the largest count of connections
sharing one shaped link, which must gain nothing. The headline `multi_link_speedup` is the
best multi-link configuration's steps/s over one link with the sync after the backward on
MLX's ring (stock mlx-lm's way); `multi_link_over_best_single` over the best one-link one.

    meshtune bench scaling [--ranks 2] [--iters 60] [--local-batch 16] [--link 1gbit:20us] [--json]
    meshtune bench scaling --links 1,2 --link 600mbit --kinds full --json

On GPUs the ranks are started by a distributed launcher and measure in-process
(bench/scaling_inproc.py):

    mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 -- \
        python -m meshtune.cli bench scaling --in-process --preset 1b --json
"""


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench scaling", description=HELP)
    p.add_argument("--ranks", type=at_least(2), default=2, help="Ranks of the multi-rank runs (against 1 rank).")
    p.add_argument("--iters", type=COUNT, default=60, help="Optimizer steps per run.")
    p.add_argument("--local-batch", type=COUNT, default=16, help="Examples per rank per step.")
    p.add_argument("--bucket-mb", type=positive_float, default=None,
                   help="Gradient bucket size. Default 0.25 on CPU ranks (the tiny model's first bucket "
                        "starts early); in-process, the training default (parallel.bucket_mb, 25): on GPUs "
                        "small buckets leave more of the step exposed than their overlap hides.")
    p.add_argument("--link", default="", help="Also run on the shaped-link bed, e.g. 1gbit:20us (needs root).")
    p.add_argument("--links", type=_counts, default=[1],
                   help="Shaped links per rank on the bed, e.g. 1,2 (each a subnet of its own), and a control "
                        "of the largest count sharing one link. Needs --link.")
    p.add_argument("--kinds", type=_kinds, default=["lora", "full"], help="Fine-tune types to run: lora,full.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    g = p.add_argument_group("in-process (GPUs; run every rank under a distributed launcher)")
    g.add_argument("--in-process", action="store_true", help="Measure inside this distributed job.")
    g.add_argument("--preset", choices=["tiny", "small", "1b"], default=None,
                   help="Model shape (bench/models.py); default: the largest that fits (bench/fit.py).")
    g.add_argument("--backend", default="any", help="mx.distributed backend: nccl on GPUs, ring, mpi, any.")
    for flag in ("batch-size", "seq-len", "warmup"):
        g.add_argument(f"--{flag}", type=at_least(0) if flag == "warmup" else COUNT, default=None,
                       help="Per rank; default: the preset's.")
    g.add_argument("--steps", type=COUNT, default=5, help="Timed steps per mode per round.")
    g.add_argument("--rounds", type=COUNT, default=3,
                   help="Rounds, each timing 1 rank (no gradient sync) and then the N-rank modes; ratios per round.")
    g.add_argument("--seed", type=int, default=0, help="Seed of the weights (batches: seed + rank).")
    return p


TRANSPORTS = ("mlx", "sockets")


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give link counts like 1,2")
    return counts


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in ("lora", "full") for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: give lora, full or lora,full")
    return kinds


def _run(ranks: int, kind: str, sync: str, a: argparse.Namespace, out: Path, bed: Any = None,
         transport: str = "mlx") -> float:
    """Steps/s of one configuration (windows after the first)."""
    train = [sys.executable, "-m", "meshtune.cli", "train", "--iters", str(a.iters),
             "--batch-size", str(a.local_batch * ranks), "--fine-tune-type", kind, "--num-layers", "-1",
             "--learning-rate", "1e-4", "--train.steps_per_report", str(max(a.iters // 4, 1)),
             "--train.val_batches", "0", "--save-every", str(a.iters), "--parallel.grad_sync", sync,
             "--parallel.bucket_mb", str(a.bucket_mb), "--parallel.transport", transport, "--adapter-path", str(out)]
    log = io.StringIO()
    code = launch_ranks(ranks, train, pin=True, out=log, hosts=bed.addresses if bed and ranks > 1 else None,
                        wrap=bed.wrap if bed and ranks > 1 else None)
    if code != 0:
        raise RuntimeError(f"{kind} {sync} ({transport}) on {ranks} ranks failed with exit code {code}:\n"
                           f"{log.getvalue()[-3000:]}")
    return steps_per_sec(metric_windows(out))


def _table(a: argparse.Namespace, tmp: Path, label: str, bed: Any = None) -> tuple[list[tuple], dict[str, float]]:
    """One network's rows: LoRA and full, 1 rank vs N ranks, after_backward vs overlap, per transport.

    The headline overlap speedup of a kind is conservative: the faster after_backward
    of the two transports over the overlap of the best transport.
    """
    n, rows, result = a.ranks, [], {}
    for kind in a.kinds:
        one = _run(1, kind, "after_backward", a, tmp / f"{label}-{kind}-1")
        step1 = 1000 / one
        after, over = {}, {}
        for tr in TRANSPORTS:
            after[tr] = _run(n, kind, "after_backward", a, tmp / f"{label}-{kind}-after-{tr}", bed, tr)
            over[tr] = _run(n, kind, "overlap", a, tmp / f"{label}-{kind}-overlap-{tr}", bed, tr)
            sa, so = 1000 / after[tr], 1000 / over[tr]
            rows.append((kind, tr, one, after[tr], over[tr], step1, sa, so))
            result[f"step_ms_1_{kind}"] = step1  # the table's step times, as the docs quote them
            result[f"step_ms_after_{kind}_{tr}"], result[f"step_ms_overlap_{kind}_{tr}"] = sa, so
            result[f"overlap_speedup_{kind}_{tr}"] = sa / so
            result[f"exposed_comm_ms_after_{kind}_{tr}"] = sa - step1
            result[f"exposed_comm_ms_overlap_{kind}_{tr}"] = so - step1
        best_after, best_over = 1000 / max(after.values()), 1000 / max(over.values())
        result[f"weak_scaling_{kind}"] = max(*after.values(), *over.values()) / one  # equal work per rank
        result[f"overlap_speedup_{kind}"] = best_after / best_over
        result[f"overlap_speedup_{kind}_over_mlx_after"] = (1000 / after["mlx"]) / best_over
        result[f"exposed_comm_ms_after_{kind}"] = best_after - step1
        result[f"exposed_comm_ms_overlap_{kind}"] = best_over - step1
        result[f"exposed_comm_fraction_after_{kind}"] = max(best_after - step1, 0.0) / best_after
        result[f"exposed_comm_fraction_overlap_{kind}"] = max(best_over - step1, 0.0) / best_over
        for tr in TRANSPORTS:
            result[f"steps_per_s_after_{kind}_{tr}"], result[f"steps_per_s_overlap_{kind}_{tr}"] = after[tr], over[tr]
    result["exposed_comm_fraction_overlap"] = result[f"exposed_comm_fraction_overlap_{a.kinds[-1]}"]
    return rows, result


def _print(title: str, rows: list[tuple], result: dict[str, float], n: int) -> None:
    print(title)
    print(f"{'':<6}{'transport':<10}{'1 rank':>12}{f'{n} after_bwd':>16}{f'{n} overlap':>14}"
          f"   step ms (1 / after / overlap)   exposed ms (after / overlap)   overlap")
    for kind, tr, one, after, over, s1, sa, so in rows:
        print(f"{kind:<6}{tr:<10}{one:>9.1f} st/s{after:>12.1f} st/s{over:>10.1f} st/s   {s1:6.1f} / {sa:6.1f} / {so:6.1f}"
              f"   {sa - s1:10.1f} / {so - s1:6.1f}          {sa / so:.2f}x")
    for kind in sorted({r[0] for r in rows}, key=("lora", "full").index):
        print(f"{kind}: weak-scaling efficiency {100 * result[f'weak_scaling_{kind}']:.1f}%; overlap speedup "
              f"{result[f'overlap_speedup_{kind}']:.2f}x (best after_backward / best overlap), "
              f"{result[f'overlap_speedup_{kind}_over_mlx_after']:.2f}x over after_backward on MLX's all_sum "
              f"(stock mlx-lm's sync); communication {100 * result[f'exposed_comm_fraction_after_{kind}']:.0f}% "
              f"of the best after_backward step")


def multi_link_figures(by_bed: dict[str, dict[str, float]], kind: str) -> dict[str, float]:
    """The headline ratios of `kind` from each bed's figures (labels links<K>, control<K>): the best
    multi-link configuration's steps/s over one link's after-the-backward MLX sync, and over one link's best."""
    def best(figures: dict[str, float]) -> float:
        return max(v for k, v in figures.items() if k.startswith("steps_per_s_") and k.split("_")[4] == kind)

    single = by_bed.get("links1")
    multi = [f for label, f in by_bed.items() if label.startswith("links") and label != "links1"]
    if single is None or not multi:
        return {}
    out = {"multi_link_speedup": max(best(f) for f in multi) / single[f"steps_per_s_after_{kind}_mlx"],
           "multi_link_over_best_single": max(best(f) for f in multi) / best(single),
           "single_link_comm_fraction_after_mlx": single[f"exposed_comm_ms_after_{kind}_mlx"]
           / single[f"step_ms_after_{kind}_mlx"]}
    control = [f for label, f in by_bed.items() if label.startswith("control")]
    if control:
        out["control_over_best_single"] = best(control[0]) / best(single)
    return out


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.bucket_mb is None:
        from ..config import ParallelConfig

        a.bucket_mb = ParallelConfig().bucket_mb if a.in_process else 0.25
    if a.in_process:
        from .scaling_inproc import main as in_process

        return in_process(a)
    n = a.ranks
    if a.links != [1] and not a.link:
        raise ValueError("--links needs the shaped-link bed: give --link RATE, e.g. --link 600mbit")
    if a.link:
        from .netbed import link_spec

        link = link_spec(a.link)  # before the loopback runs
    print(f"scaling benchmark: {n} ranks vs 1 (ring backend), embedded tiny model, local batch {a.local_batch}, "
          f"{a.iters} steps, buckets {a.bucket_mb} MB")
    print(embedded_line(a.local_batch, 32, Load(full=True, processes=n)))
    print(f"threads: meshtune launch --pin (one core per rank, OPENBLAS_NUM_THREADS=1); {describe_blas()}")
    with tempfile.TemporaryDirectory() as tmp:
        rows, result = _table(a, Path(tmp), "loopback")
        _print("loopback", rows, result, n)
        if a.link:
            from .netbed import shaped_link

            rate, delay = link
            beds = [(k, False) for k in a.links] + ([(max(a.links), True)] if max(a.links) > 1 else [])
            by_bed = {}
            for links, shared in beds:
                with shaped_link(n, rate=rate, delay=delay, links=links, shared=shared) as bed:
                    label = f"control{links}" if shared else f"links{links}"
                    rows, shaped = _table(a, Path(tmp), label, bed)
                    _print(f"shaped link: {bed.shaping}", rows, shaped, n)
                by_bed[label] = shaped
            first = by_bed[f"links{a.links[0]}"]
            result.update({f"shaped_{k}": v for k, v in first.items()})  # the one-bed keys, as before --links
            if len(by_bed) > 1:
                ratios = multi_link_figures(by_bed, a.kinds[-1])
                result.update(ratios)
                print(f"{a.kinds[-1]}, {n} ranks: best of {max(a.links)} links over one link's after_backward "
                      f"on MLX's ring {ratios['multi_link_speedup']:.2f}x (one link spends "
                      f"{100 * ratios['single_link_comm_fraction_after_mlx']:.0f}% of that step communicating), "
                      f"over one link's best {ratios['multi_link_over_best_single']:.2f}x"
                      + (f"; control ({max(a.links)} connections on one link) over one link's best "
                         f"{ratios['control_over_best_single']:.2f}x" if "control_over_best_single" in ratios else ""))
                for label, figures in by_bed.items():
                    result.update({f"shaped_{label}_{k}": v for k, v in figures.items()})
    if a.json:
        print(json.dumps(result))
    return 0
