"""The plan as a table a person reads (120 columns) or one JSON object a program reads.

A pipeline row shows its fullest stage (the one that must fit), and a line under the table each
stage's own weights and total; the JSON has every stage.
Each size carries the unit of its magnitude (M or G bytes): a 3 MB weight beside 10 GB of activations.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

COLUMNS = ("layout", "ranks", "blocks", "weights", "adapters", "grads", "optim", "activ.", "ckpt", "total/rank",
           "fits", "bubble", "comm MB", "comm ms")


def table(result: dict[str, Any]) -> str:
    """The lines `meshtune plan` prints."""
    rows = result["layouts"]
    weights = ", ".join(f"{kind} {size_text(size)}" for kind, size in sorted(result["weights_by_kind"].items()))
    lines = [
        f"model {result['model']}: {result['blocks']} blocks, weights {weights}",
        f"{result['fine_tune_type']}: {result['trainable_params'] / 1e6:.3f}M trainable parameters, "
        f"optimizer {result['optimizer']}, grad_checkpoint {str(result['grad_checkpoint']).lower()}, "
        f"schedule {result['schedule']}",
        f"batch {result['batch_size']} x {result['seq_len']} tokens ({result['seq_len_from']})",
        f"{result['ranks']} rank{'s' if result['ranks'] != 1 else ''} x {result['memory_gb']:g} GB; "
        f"link {result['link']}" + (f" x {result['links']} links" if result.get("links", 1) > 1 else "")
        + f" ({result['link_bytes_per_s'] / 1e6:.0f} MB/s); sizes per rank, M = 1e6 and G = 1e9 bytes",
        "",
    ]
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for k, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    if result["grad_checkpoint"]:
        lines.append("note: with train.grad_checkpoint activ. is ckpt: each block's input and one block recomputed "
                     "(docs/plan.md)")
    for r in rows:
        if r["problem"]:
            lines.append(f"{r['layout']}: {r['problem']}")
    for r in rows:
        if r["pp"] > 1 and "stages" in r:
            lines += textwrap.wrap(f"{r['layout']} per stage (weights / total): " + "; ".join(
                _stage_text(st, r["pp"]) for st in r["stages"][:8]) + ("; ..." if r["pp"] > 8 else ""),
                width=120, subsequent_indent="  ")
    choice = f"recommended: {result['recommended'] or 'none'} ({result['reason']})"
    lines += textwrap.wrap(choice, width=120, subsequent_indent="  ")
    return "\n".join(lines)


def size_text(v: float | None) -> str:
    """Bytes in the unit of their magnitude: 12.34G, 3.20M, 0."""
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v / 1e9:.2f}G" if v >= 1e9 else f"{v / 1e6:.2f}M"


def _cells(r: dict[str, Any]) -> list[str]:
    counts = r["stage_layers"]
    blocks = "+".join(str(n) for n in counts) or "-"
    if len(blocks) > 12:  # many stages: the range and the count
        blocks = f"{min(counts)}..{max(counts)} x{len(counts)}"
    head = [r["layout"], str(r["ranks"]), blocks]
    if "total" not in r:
        return head + ["-"] * 7 + ["no", "-", "-", "-"]
    stage = max(r["stages"], key=lambda s: s["total"])
    size = size_text
    return head + [size(stage["weights"]), size(stage["adapters"]), size(stage["grads"]), size(stage["optimizer"]),
                   size(stage["activations"]), size(stage["activations_ckpt"]), size(r["total"]),
                   "yes" if r["fits"] and not r["problem"] else "no", f"{r['bubble']:.0%}",
                   f"{r['comm_bytes'] / 1e6:.2f}", f"{r['comm_ms']:.2f}"]


def _stage_text(stage: dict[str, Any], stages: int) -> str:
    ends = (["embedding"] if stage["stage"] == 0 else []) + (["norm, head"] if stage["stage"] == stages - 1 else [])
    start, end = stage["blocks"]
    return (f"{stage['stage']} [{start}, {end})" + "".join(f" + {e}" for e in ends)
            + f" {size_text(stage['weights'])} / {size_text(stage['total'])}")


def as_json(result: dict[str, Any]) -> str:
    """The plan as one line of JSON (sizes in bytes)."""
    return json.dumps(result, sort_keys=True)
