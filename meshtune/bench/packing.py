"""`meshtune bench packing`: target tokens/s and padding share of the same steps with and without data.pack.

One process trains the same steps on padded batches and on packed rows of the length `meshtune
train` picks, steps alternated. HELP, the command's --help, says how; docs/performance.md ("Data")
holds the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from ..runtime.blas import describe_blas
from .flags import BenchParser, COUNT, at_least

HELP = """`meshtune bench packing`: target tokens/s and padding share of the same steps with and without data.pack.

One process loads the model and the data once, then trains the same number of optimizer
steps through the real compiled step (parallel/data_parallel_step.build_step): on length-sorted
padded batches of `--batch-size` examples, and on `--batch-size` packed rows (data.pack) of the
length `meshtune train` takes: with no `--max-seq-length`, the one it picks for the data and the
model (plan/row_length.py), else `--max-seq-length`. `--row-lengths` adds packed rows of other
lengths, to see the pick beside them. Each setting first compiles every batch shape it will meet
(one step per shape, untimed); then the timed steps of all settings alternate, one of each in turn,
so all see the same load on a shared machine. Reported per setting: target tokens (tokens in the
loss) per second (mean target tokens of a step over the median step time), the padding share
(padded tokens / all tokens of the timed batches), examples and milliseconds (median) per step,
and target tokens/s over the unpacked steps'; then that speed-up of the rows train takes.

    meshtune bench packing [--model M] [--data D] [--steps 20] [--batch-size 4] [--max-seq-length N]
                           [--row-lengths 64,256] [--json]
"""


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench packing", description=HELP)
    p.add_argument("--model", default="", help="Model (default: the embedded tiny model).")
    p.add_argument("--data", default="", help="Any --data form (default: the embedded arithmetic set).")
    p.add_argument("--steps", type=COUNT, default=20, help="Timed optimizer steps per run.")
    p.add_argument("--batch-size", type=COUNT, default=4, help="Examples (unpacked) or packed rows per step.")
    p.add_argument("--max-seq-length", type=at_least(2), default=None,
                   help="Cap of both settings and the packed row length, as train's flag (default: examples cut at "
                        "data.max_seq_length's default, rows of the length train picks for the data and model).")
    p.add_argument("--row-lengths", type=_lengths, default=[],
                   help="Also packed rows of these lengths (comma-separated), beside the same steps.")
    p.add_argument("--mask-prompt", action="store_true", help="Leave prompts out of the loss (data.mask_prompt).")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def _lengths(text: str) -> list[int]:
    """Comma-separated row lengths of at least 2 tokens."""
    return [at_least(2)(part) for part in text.split(",") if part.strip()]


def _real_tokens(lengths: np.ndarray) -> int:
    """Tokens of a batch that belong to an example (the rest is padding)."""
    if lengths.ndim == 3:
        return int((lengths[..., 2] - lengths[..., 0]).sum())
    return int(lengths[:, 1].sum())


def _prepare(model: Any, data: Any, pack: bool, length: int, a: argparse.Namespace
             ) -> tuple[Callable[[Any], int], list, dict]:
    """(one compiled training step, the timed batches, their token counts) for one setting of data.pack and
    the row length (unpacked: the cap on an example)."""
    from ..data import BatchIterator
    from ..parallel.data_parallel_step import build_step
    from ..runtime.mesh import Mesh

    opt = optim.Adam(learning_rate=1e-4)
    opt.init(model.trainable_parameters())
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=True)

    def one(batch: Any) -> int:
        _, n, _ = step.finish(batch.tokens, batch.lengths, None, None)
        mx.eval(n, model.parameters(), opt.state)
        return int(n.item())

    it = BatchIterator(data, batch_size=a.batch_size, max_seq_length=length, seed=0, pack=pack,
                       warn=lambda _m: None)
    seen: set[tuple] = set()
    for batch in BatchIterator(data, batch_size=a.batch_size, max_seq_length=length, loop=False,
                               fill_last=True, pack=pack, warn=lambda _m: None):  # the batches `it` holds
        shapes = (batch.tokens.shape, batch.lengths.shape)
        if shapes not in seen:  # compile every shape before the clock starts
            seen.add(shapes)
            one(batch)
    batches = [next(it) for _ in range(a.steps)]
    examples = np.mean([np.count_nonzero(np.array(b.lengths)[..., -1]) for b in batches]) if pack else a.batch_size
    all_tokens = sum(b.tokens.size for b in batches)
    real = sum(_real_tokens(np.array(b.lengths)) for b in batches)
    return one, batches, {"pack": pack, "row_length": length, "padding_share": 1 - real / all_tokens,
                          "examples_per_step": float(examples), "all_tokens": all_tokens, "compiled_shapes": len(seen)}


def _measure(model: Any, data: Any, settings: list[tuple[bool, int]], a: argparse.Namespace) -> list[dict]:
    """The settings' (pack, length) steps interleaved (so all see the same load on the machine), median step
    times; the first setting is the baseline of the speed-ups."""
    runs = [_prepare(model, data, pack, length, a) for pack, length in settings]
    times: list[list[float]] = [[] for _ in runs]
    targets = [0 for _ in runs]
    for i in range(a.steps):
        for k, (one, batches, _) in enumerate(runs):
            began = time.perf_counter()
            targets[k] += one(batches[i])
            times[k].append(time.perf_counter() - began)
    out = []
    for k, (_, _, stats) in enumerate(runs):
        median = statistics.median(times[k])
        out.append({**stats, "target_tokens": targets[k], "step_ms": 1000 * median,
                    "target_tokens_per_sec": targets[k] / a.steps / median})
    for r in out:
        r["speedup"] = r["target_tokens_per_sec"] / out[0]["target_tokens_per_sec"]
    return out


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    from ..adapters import apply_adapters
    from ..inference import load_model
    from ..config.load import load_config
    from ..config.sections import DEFAULT_DATA_PATH, DEFAULT_MODEL_PATH
    from ..data import load_datasets
    from ..plan.row_length import packed_row_length

    model_path = a.model or str(DEFAULT_MODEL_PATH)
    data_path = a.data or str(DEFAULT_DATA_PATH)
    # The config `meshtune train --data.pack true` would run with these flags.
    flags = {"model.path": model_path, "train.batch_size": a.batch_size, "data.pack": True}
    cfg = load_config(None, flags | ({"data.max_seq_length": a.max_seq_length} if a.max_seq_length else {}))
    cap = cfg.data.max_seq_length
    model, tokenizer = load_model(model_path)
    mx.random.seed(0)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=8, scale=20.0, dropout=0.0)
    data = load_datasets(data_path, tokenizer, mask_prompt=a.mask_prompt, need_valid=False,
                         max_seq_length=cap).train
    rows = packed_row_length(cfg, data.lengths)  # the rows that run takes (api.finetune)
    if not a.model:  # a model of the caller's is the caller's size
        from .fit import Load, embedded_line

        print(embedded_line(a.batch_size, max([rows.tokens, *a.row_lengths]), Load()), flush=True)
    print(f"packing bench: {Path(model_path).name}, {Path(data_path).name} data ({len(data)} examples, "
          f"mean {data.lengths.mean():.1f} tokens, longest {int(data.lengths.max())}), {a.steps} timed steps of "
          f"{a.batch_size} examples or rows, examples cut at {cap}; {describe_blas()}", flush=True)
    print(rows.line(), flush=True)
    settings = [(False, cap), (True, rows.tokens), *((True, n) for n in a.row_lengths if n != rows.tokens)]
    runs = _measure(model, data, settings, a)
    print("| data.pack | row tokens | target tokens/s | padding share | examples/step | ms/step | vs unpacked |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        length = str(r["row_length"]) if r["pack"] else "-"
        print(f"| {str(r['pack']).lower()} | {length} | {r['target_tokens_per_sec']:.0f} | "
              f"{100 * r['padding_share']:.1f}% | {r['examples_per_step']:.1f} | {r['step_ms']:.1f} | "
              f"{r['speedup']:.2f}x |")
    speedup = runs[1]["speedup"]
    print(f"speed-up with data.pack, rows of {rows.tokens} (target tokens/s): {speedup:.2f}x")
    if a.json:
        print(json.dumps({"model": model_path, "data": data_path, "steps": a.steps, "batch_size": a.batch_size,
                          "max_seq_length": cap, "row_length": rows.tokens, "row_length_why": rows.why,
                          "runs": runs, "speedup": speedup}))
    return 0
