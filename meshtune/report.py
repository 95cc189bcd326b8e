"""The end-of-run report: `report.md` and `loss.png` in the adapter folder, and the one summary line.

Built only from the run's metrics.jsonl and its adapter_config.json (the resolved
config under "meshtune"), so a finished run's report can be made again:

    python -m meshtune.report ADAPTER_PATH

Times and throughput count the training steps only (each train record's tokens over
its tokens/s); evaluations and saves are left out. `loss.png` draws the train and
validation losses against the step (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .run_dir import METRICS_FILE, PLOT_FILE, RunDir, temp_path
from .runtime.relaunch import resume_on_ranks
from .training.checkpoint import atomic_write_text
from .training.metrics import read_metrics


@dataclass(kw_only=True)
class RunSummary:
    """What report.md says, taken from metrics.jsonl and the saved config."""

    model: str = ""
    data: str = ""
    ranks: int = 1
    dp: int = 1
    pp: int = 1
    schedule: str = ""
    micro_batches: int = 0
    adapter: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    trained_tokens: int = 0
    step_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    val: list[tuple[int, float]] = field(default_factory=list)
    test_loss: float | None = None
    shares: dict[str, float] = field(default_factory=dict)  # mean comm_share / bubble_share over the reports
    iters: int = 0  # the steps asked for (train.iters; 0: not known)
    stopped: bool = False  # a stop on request was recorded
    checkpoint: int | None = None  # the step of the newest checkpoint folder
    resume: str = ""  # the command that resumes the run on its ranks (its last start record's)
    earlier_ranks: tuple[int, int] | None = None  # (last step, rank count) of reports on another rank count

    @property
    def status(self) -> str:
        """done (every step asked for), stopped (on request) or incomplete (cut off: no end was recorded)."""
        if not self.iters or self.steps >= self.iters:
            return "done"
        return "stopped" if self.stopped else "incomplete"

    @property
    def tokens_per_sec(self) -> float:
        return self.trained_tokens / self.step_seconds if self.step_seconds > 0 else 0.0


def summarize(out: Path, config: dict[str, Any] | None = None) -> RunSummary:
    """The run in `out` as a RunSummary; `config` is the resolved config (default: the saved one)."""
    run = RunDir(out)
    saved = json.loads(run.config.read_text()) if run.config.exists() else {}
    cfg = config if config is not None else saved.get("meshtune", {})
    records = read_metrics(out)
    train = [r for r in records if r.get("type") == "train"]
    val = [r for r in records if r.get("type") == "val"]
    test = [r for r in records if r.get("type") == "test"]
    parallel, adapter = cfg.get("parallel", {}), cfg.get("adapter", {})
    # The layout the run ended on (a run resumed on fewer ranks has reports of both).
    counts = [(r["step"], len(r["peak_memory_gb_per_rank"])) for r in train if r.get("peak_memory_gb_per_rank")]
    ranks = counts[-1][1] if counts else 1
    before = next(((step, n) for step, n in reversed(counts) if n != ranks), None)
    pp = max(int(parallel.get("pp", 1) or 1), int(parallel.get("pipeline_stages", 0) or 0))
    s = RunSummary(
        model=saved.get("model") or cfg.get("model", {}).get("path", ""),
        data=saved.get("data") or cfg.get("data", {}).get("path", ""),
        ranks=ranks, pp=pp, dp=max(ranks // pp, 1), schedule=parallel.get("schedule", "") if pp > 1 else "",
        micro_batches=int(parallel.get("micro_batches", 0) or 0) or pp,
        # num_layers as applied (adapter_config.json's: 16 on a 4-block model is 4), else as asked.
        adapter={**{k: adapter.get(k) for k in ("fine_tune_type", "rank", "scale")},
                 "num_layers": saved.get("num_layers", adapter.get("num_layers"))},
        steps=max((r["step"] for r in records if r.get("type") in ("train", "val", "skip", "stop")), default=0),
        trained_tokens=train[-1]["trained_tokens"] if train else 0,
        step_seconds=sum(r["tokens"] / r["tokens_per_sec"] for r in train if r["tokens_per_sec"] > 0),
        peak_memory_gb=max((r["peak_memory_gb"] for r in train), default=0.0),
        train=[(r["step"], r["loss"]) for r in train], val=[(r["step"], r["val_loss"]) for r in val],
        test_loss=test[-1]["test_loss"] if test else None,
    )
    for key in ("comm_share", "bubble_share"):
        values = [r[key] for r in train if r.get(key) is not None]
        if values:
            s.shares[key] = sum(values) / len(values)
    s.iters = int(cfg.get("train", {}).get("iters", 0) or 0)
    s.earlier_ranks = before
    s.stopped = any(r.get("type") == "stop" for r in records)
    s.checkpoint = max((c.step for c in run.numbered()), default=None)
    starts = [r for r in records if r.get("type") == "start" and r.get("resume")]
    # A run whose metrics.jsonl has no start record: resumed on as many ranks as its reports show.
    s.resume = starts[-1]["resume"] if starts else resume_on_ranks(run.path, s.ranks)
    return s


def _first_last(points: list[tuple[int, float]]) -> str:
    if not points:
        return "none"
    (s0, l0), (s1, l1) = points[0], points[-1]
    return f"{l0:.4f} (step {s0}) -> {l1:.4f} (step {s1})"


def markdown(s: RunSummary) -> str:
    """report.md's text."""
    a = s.adapter
    layers = "all" if a.get("num_layers") == -1 else a.get("num_layers")
    layout = f"{s.ranks} rank{'s' if s.ranks != 1 else ''}: dp {s.dp}, pp {s.pp}"
    if s.pp > 1:
        layout += f", schedule {s.schedule}, {s.micro_batches} micro-batches"
    if s.earlier_ranks is not None:  # resumed on another rank count
        step, count = s.earlier_ranks
        layout += f" (resumed; {count} rank{'s' if count != 1 else ''} up to step {step})"
    rows = [
        ("model", s.model), ("data", s.data), ("layout", layout),
        ("adapter", f"{a.get('fine_tune_type')}, rank {a.get('rank')}, scale {a.get('scale')}, layers {layers}"),
        ("steps", str(s.steps) if s.status == "done" else f"{s.steps} of {s.iters} ({s.status})"),
        ("tokens trained", str(s.trained_tokens)),
        ("time in steps", f"{s.step_seconds:.1f} s"),
        ("tokens/s", f"{s.tokens_per_sec:.1f}"), ("peak memory", f"{s.peak_memory_gb:.3f} GB (the largest rank)"),
        ("train loss", _first_last(s.train)), ("validation loss", _first_last(s.val)),
    ]
    if s.test_loss is not None:
        rows.append(("test loss", f"{s.test_loss:.4f}"))
    if s.pp > 1 and s.schedule:
        from .parallel.pipeline.schedules import build, idle_fraction

        idle = idle_fraction(build(s.schedule, s.pp, s.micro_batches))
        rows.append(("pipeline idle share, analytic from the schedule", f"{100 * idle:.1f}%"))
    for key, value in s.shares.items():
        rows.append((key.replace("_", " ") + ", measured (mean of the reports)", f"{100 * value:.1f}%"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# Training report\n\n| | |\n|---|---|\n{table}\n\n![train and validation loss]({PLOT_FILE})\n\n"
            f"Every report is in `{METRICS_FILE}`; docs/watching.md says what each key means.\n")


def plot(s: RunSummary, path: Path) -> Path:
    """loss.png: train and validation loss against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for points, label, style in ((s.train, "train", "-"), (s.val, "validation", "o--")):
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per target token)")
    ax.set_title(Path(s.model).name or "loss")
    ax.grid(alpha=0.3)
    if s.train or s.val:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(out: Path, config: dict[str, Any] | None = None) -> RunSummary:
    """Write report.md and loss.png into the run folder `out`; returns what they say."""
    run = RunDir(out)
    s = summarize(run.path, config)
    atomic_write_text(run.report, markdown(s))  # whole or not at all, on a full disk too
    tmp = temp_path(run.plot, str(os.getpid()), ".png")
    try:
        os.replace(plot(s, tmp), run.plot)
    finally:
        tmp.unlink(missing_ok=True)
    return s


def summary_line(s: RunSummary, out: Path, adapters: Path) -> str:
    """The run's last line: how it ended, steps, tokens, time, tokens/s, final losses, where things are.

    A run cut off (no end recorded) names the step its adapters and newest checkpoint hold, and the
    command that resumes it."""
    last = lambda points: f"{points[-1][1]:.4f}" if points else "none"  # noqa: E731
    val = last(s.val)
    if s.val and s.val[-1][0] != s.steps:  # e.g. a run stopped before its next eval: the step-0 loss is no result
        at = s.val[-1][0]
        val = f"{val} (at step {at}{', before training' if at == 0 else ''})"
    steps = f"{s.steps} steps" if s.status == "done" else f"step {s.steps} of {s.iters}"
    held = "" if s.status == "done" or s.checkpoint is None else f" (step {s.checkpoint})"
    written = f"adapters {adapters}{held}" if Path(adapters).exists() else "no adapters written yet"
    resume = f"; resume with {s.resume}" if s.status != "done" and s.checkpoint is not None else ""
    return (f"{s.status}: {steps}, {s.trained_tokens} tokens in {s.step_seconds:.1f} s "
            f"({s.tokens_per_sec:.0f} tok/s); final train loss {last(s.train)}, val loss {val}; "
            f"{written}, report {RunDir(out).report}, plot {RunDir(out).plot}{resume}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m meshtune.report ADAPTER_PATH (a run folder holding {METRICS_FILE})",
              file=sys.stderr)
        return 2
    run = RunDir(argv[0])
    if not run.metrics.exists():
        what = f"no {METRICS_FILE} in that folder" if run.path.is_dir() else "no such folder"
        print(f"meshtune report: {argv[0]}: {what}; give the --adapter-path of a run", file=sys.stderr)
        return 2
    try:
        s = write_report(run.path)
    except ValueError as err:
        print(f"meshtune report: {err}", file=sys.stderr)
        return 2
    print(summary_line(s, run.path, run.adapters))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
