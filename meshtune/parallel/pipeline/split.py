"""Where a pipeline cuts a model: blocks per stage, checked against the model's block count.

Plain Python (no model loaded, no MLX), so the entry points check a layout before any
rank loads the model: `declared_layers` reads the block count a model folder's
config.json declares, `check_stage_layers` says what does not fit. The pipeline
cuts the loaded model with `stage.split_stages`, by these same rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Where config.json files declare their block count: mlx-lm's models, GPT-2's, a
# multimodal model's text tower.
LAYER_KEYS = ("num_hidden_layers", "n_layer")


def declared_layers(model_path: str | Path) -> int | None:
    """The block count a local model folder's config.json declares (None when unknown)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    for section in (config, text if isinstance(text, dict) else {}):
        for key in LAYER_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def balanced_split(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage, contiguous and none empty, that minimise the costliest stage.

    `costs` are the blocks' costs; the first stage also pays `first_extra` (the
    embedding) and the last `last_extra` (final norm and head), so with a large
    embedding or head those stages get fewer blocks. Exact (dynamic programming over
    cut points); ties go to the split with the smaller sum of squared stage costs.
    """
    n = len(costs)
    assert 1 <= stages <= n, (stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holding blocks [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    # best[s][j]: (max stage cost, sum of squares, cut) placing blocks [0, j) on stages 0..s
    best: list[dict[int, tuple[float, float, int]]] = [{j: (cost(0, 0, j), cost(0, 0, j) ** 2, 0)
                                                       for j in range(1, n - stages + 2)}]
    for s in range(1, stages):
        row = {}
        for j in range(s + 1, n - stages + s + 2):
            row[j] = min((max(best[-1][i][0], cost(s, i, j)), best[-1][i][1] + cost(s, i, j) ** 2, i)
                         for i in range(s, j))
        best.append(row)
    counts, j = [], n
    for s in range(stages - 1, -1, -1):
        i = best[s][j][2]
        counts.append(j - i)
        j = i
    return counts[::-1]


def check_stage_layers(stage_layers: list[int] | None, stages: int, num_layers: int) -> None:
    """Raise a ValueError naming the option when `stages` cannot hold `num_layers` blocks as asked."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"parallel.pp={stages} stages for a model of {num_layers} blocks; "
                         f"use between 1 and {num_layers} stages")
    if stage_layers is None:
        return
    if len(stage_layers) != stages or min(stage_layers) < 1:
        raise ValueError(f"parallel.stage_layers={stage_layers}: give {stages} block counts (one per stage), "
                         f"each at least 1")
    if sum(stage_layers) != num_layers:
        raise ValueError(f"parallel.stage_layers={stage_layers} sums to {sum(stage_layers)} but the model has "
                         f"{num_layers} blocks; make the counts add up to {num_layers} or unset it (--parallel.stage_layers null)")


def check_pipeline_layout(cfg: Any, pp: int, world_size: int, model_path: Path) -> None:
    """What a pipeline of `pp` stages over `world_size` ranks cannot run as `cfg` asks, from the config
    and the model folder's declared block count (Pipeline.check; meshtune launch before any rank starts)."""
    if cfg.train.grad_checkpoint:
        raise ValueError(f"parallel.pp={pp}: train.grad_checkpoint with a pipeline is not needed: "
                         "stages recompute their forward; drop --grad-checkpoint (--train.grad_checkpoint false)")
    if cfg.parallel.transport == "sockets" and world_size > 1:
        raise ValueError("parallel.transport=sockets carries data-parallel gradients only; with "
                         f"parallel.pp={pp} set parallel.transport: mlx (--parallel.transport mlx)")
    if (declared := declared_layers(model_path)) is not None:
        try:
            check_stage_layers(cfg.parallel.stage_layers, pp, declared)
        except ValueError as err:
            raise ValueError(f"{err} ({Path(model_path) / 'config.json'})") from None


def stage_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """Block ranges [start, end) from blocks per stage."""
    starts = [sum(counts[:s]) for s in range(len(counts) + 1)]
    return [(starts[s], starts[s + 1]) for s in range(len(counts))]
