"""`make demo`: LoRA on the embedded tiny model, with before/after figures.

Fine-tunes the bundled model on the bundled arithmetic set (configs/demo.yaml) and
prints validation loss and held-out exact-match accuracy before and after, so the
effect of fine-tuning is visible in one screen.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import mlx.nn as nn

from .run_dir import RunDir

DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"


def exact_match(model: nn.Module, tokenizer: Any, rows: list[dict[str, str]], *, prompt_key: str = "prompt",
                completion_key: str = "completion") -> int:
    """How many rows the model completes exactly (greedy, through the chat template)."""
    from .inference import complete

    hits = 0
    for row in rows:
        want = row[completion_key].strip()
        n = len(tokenizer.encode(want)) + 2
        got = complete(model, tokenizer, row[prompt_key], max_tokens=n).strip()
        hits += got == want
    return hits


def run_demo(adapter_path: str = "runs/demo", overrides: list[str] | None = None) -> int:
    """Train the demo config and print the before/after table; returns an exit code."""
    from .api import finetune
    from .inference import load_for_inference
    from .config import load_config, parse_override_args
    from .training.metrics import read_metrics

    items = parse_override_args(overrides or [])
    items += [("output.adapter_path", adapter_path), ("output.overwrite", "true")]
    cfg = load_config(DEMO_CONFIG, items)
    model_path = str(cfg.resolved_model_path())
    test_file = Path(cfg.resolved_data_path()) / "test.jsonl"
    rows = [json.loads(l) for l in test_file.read_text().splitlines() if l.strip()]

    base, tokenizer = load_for_inference(model_path)
    before_acc = exact_match(base, tokenizer, rows)
    tic = time.perf_counter()
    result = finetune(cfg)
    seconds = time.perf_counter() - tic
    tuned, tokenizer = load_for_inference(model_path, result.adapter_path)
    after_acc = exact_match(tuned, tokenizer, rows)
    vals = [r["val_loss"] for r in read_metrics(result.adapter_path) if r["type"] == "val"]

    print(f"\nmeshtune demo: LoRA on {Path(model_path).name}, {result.step} steps in {seconds:.0f}s")
    print(f"{'':<26}{'before':>10}{'after':>10}")
    print(f"{'validation loss':<26}{vals[0]:>10.3f}{vals[-1]:>10.3f}")
    print(f"{'test exact match':<26}{before_acc:>6}/{len(rows):<3}{after_acc:>6}/{len(rows):<3}")
    print(f"adapters: {RunDir(result.adapter_path).adapters} (load with mlx_lm.load(..., adapter_path=...))")
    return 0
