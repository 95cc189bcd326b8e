"""`meshtune bench adapters --combine RUN.txt ...`: several invocations' ratios judged together.

One invocation times stock mlx-lm and meshtune side by side in one process, but on a GPU its
DoRA / LoRA step ratio moves from one process to the next on the same code and machine by more
than the target's margin. Each file here is the saved output of one `meshtune bench adapters
--json` invocation (its last JSON line is read); every ratio, stock's and meshtune's, is shown per
invocation and as the median over them, and the targets are judged on the medians. The invocations
must share their settings (preset, shape, batch, device, ...): a mix is refused, naming the file.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .adapters_targets import RATIO_ROWS, TARGETS, met_target, target_verdict

# Settings the invocations must share for their ratios to be one measurement's.
SAME_SETTINGS = ("preset", "shape", "device", "dense_dtype", "batch_size", "seq_len", "steps", "rounds",
                 "gen_tokens", "rank", "scale", "num_layers", "overlap_steps", "base_path")
# Every judged ratio's key, meshtune's and stock's.
RATIO_KEYS = [k for key, _ in RATIO_ROWS for k in (key, "stock_" + key)]
_FIX = "pass the saved output of `meshtune bench adapters ... --json`"


def load_run(path: str) -> dict:
    """The JSON object an invocation printed last in the file at `path`."""
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror}); {_FIX}") from None
    for number in range(len(lines), 0, -1):
        line = lines[number - 1].strip()
        if not line.startswith("{"):
            continue
        try:
            run = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: its JSON line does not parse ({err.msg}); {_FIX}") from None
        missing = [key for key in RATIO_KEYS if key not in run]
        if missing:
            raise ValueError(f"{path}:{number}: no {missing[0]!r}: not a `meshtune bench adapters --json` line; {_FIX}")
        return run
    raise ValueError(f"{path}: no JSON line in it; {_FIX}")


def combine(runs: list[dict], names: list[str]) -> dict:
    """Per-invocation ratios, their medians (the bare keys, as one invocation's) and the targets judged on them."""
    if len(runs) < 2:
        raise ValueError("--combine takes two or more saved invocations (one is its own table already)")
    for key in SAME_SETTINGS:
        for run, name in zip(runs[1:], names[1:]):
            if run.get(key) != runs[0].get(key):
                raise ValueError(f"{name}: {key} is {run.get(key)!r} where {names[0]} has {runs[0].get(key)!r}; "
                                 "combine invocations of the same settings")
    medians = {k: statistics.median(run[k] for run in runs) for k in RATIO_KEYS}
    return {**medians, "targets": {key: f"{op} {bound}" for key, bound, op in TARGETS},
            "targets_met": {key: met_target(medians[key], bound, op) for key, bound, op in TARGETS},
            "invocations": len(runs),
            "runs": [{"file": name, **{k: run[k] for k in RATIO_KEYS}} for run, name in zip(runs, names)],
            **{key: runs[0].get(key) for key in SAME_SETTINGS}}


def print_combined(result: dict) -> None:
    dense = result.get("dense_dtype") or "dense"
    on_cpu = str(result.get("device", "")).startswith("cpu")
    runs = result["runs"]
    print(f"adapters benchmark, {result['invocations']} invocations combined: {result.get('device')}, "
          f"preset {result.get('preset')}, batch {result.get('batch_size')} x {result.get('seq_len')}, "
          f"{result.get('steps')} steps in {result.get('rounds')} rounds each")
    for i, run in enumerate(runs, 1):
        print(f"  run {i}: {run['file']}")
    head = "".join(f"{'run ' + str(i):>9}" for i in range(1, len(runs) + 1))
    print(f"\n{'meshtune ratios':<40}{head}{'median':>9}   target (on the median)")
    for key, text in RATIO_ROWS:
        cells = "".join(f"{run[key]:>8.2f}x" for run in runs)
        print(f"  {text.format(dense=dense):<38}{cells}{result[key]:>8.2f}x   {target_verdict(key, result[key], on_cpu)}")
    print(f"\n{'stock mlx-lm ratios':<40}{head}{'median':>9}")
    for key, text in RATIO_ROWS:
        cells = "".join(f"{run['stock_' + key]:>8.2f}x" for run in runs)
        print(f"  {text.format(dense=dense):<38}{cells}{result['stock_' + key]:>8.2f}x")


def main(paths: list[str], as_json: bool) -> int:
    result = combine([load_run(p) for p in paths], list(paths))
    print_combined(result)
    if as_json:
        print(json.dumps(result))
    return 0
