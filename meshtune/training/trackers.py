"""Optional report outputs beside metrics.jsonl: TensorBoard (tensorboardX) and Weights & Biases.

`output.report_to` (`--report-to tensorboard,wandb`) names them; `check_trackers` runs at
startup, before the model loads, so a missing library is one line naming the extra to
install or the flag that drops it. Only the writer rank opens them (`open_trackers`). Each
gets every train, val and test record the Reporter writes to metrics.jsonl, as scalars
at the record's step: `train/loss`, `train/learning_rate`, `train/tokens_per_sec`,
`train/peak_memory_gb`, `train/comm_share` or `train/bubble_share` where measured,
`val/loss`, `test/loss`. TensorBoard's event files go in `<adapter_path>/tensorboard`;
W&B keeps its run folder in `<adapter_path>/wandb` (WANDB_MODE=offline works as W&B says).
"""

from __future__ import annotations

import configparser
import importlib
import netrc
import os
from pathlib import Path
from typing import Any, Mapping, Protocol
from urllib.parse import urlparse

TRACKERS = {"tensorboard": "tensorboardX", "wandb": "wandb"}  # name -> the module it needs
TENSORBOARD_DIR = "tensorboard"
TRAIN_SCALARS = ("loss", "learning_rate", "tokens_per_sec", "peak_memory_gb", "comm_share", "bubble_share")


def tracker_names(report_to: list[str] | str | None) -> list[str]:
    """output.report_to as a list of known names; ValueError naming the flag for an unknown one."""
    items = report_to.split(",") if isinstance(report_to, str) else list(report_to or [])
    names = [n.strip().lower() for n in items if n.strip() and n.strip().lower() != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"output.report_to: {name!r} is not one of {', '.join(TRACKERS)}; "
                             "e.g. --report-to tensorboard,wandb")
    return list(dict.fromkeys(names))


def check_trackers(report_to: list[str] | str | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The trackers asked for, each one's library importable and W&B able to log in `environ` (this
    process's by default); else a one-line ValueError saying what to do."""
    names = tracker_names(report_to)
    for name in names:
        try:
            importlib.import_module(TRACKERS[name])
        except ImportError:
            rest = [n for n in names if n != name]
            drop = f"--report-to {','.join(rest)}" if rest else "leave out --report-to"
            raise ValueError(f"output.report_to={name} needs {TRACKERS[name]}: pip install 'meshtune[{name}]', "
                             f"or {drop}") from None
    if "wandb" in names and not wandb_can_log(environ):
        rest = [n for n in names if n != "wandb"]
        drop = f"--report-to {','.join(rest)}" if rest else "leave out --report-to"
        raise ValueError("output.report_to=wandb: no W&B API key (WANDB_API_KEY, or a `wandb login` in ~/.netrc); "
                         f"run `wandb login`, set WANDB_MODE=offline to keep the run on disk, or {drop}")
    return names


KEYLESS_MODES = ("offline", "dryrun", "disabled")


def wandb_can_log(environ: Any) -> bool:
    """Whether wandb.init will find what it needs without asking: a key, or a mode that needs none
    (WANDB_MODE, or `wandb offline`'s settings file: the workspace's ./wandb/settings, the user's
    WANDB_CONFIG_DIR or ~/.config/wandb/settings)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_MODE", "").lower() in KEYLESS_MODES:
        return True
    config_dir = Path(environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    for settings in (Path(environ.get("WANDB_DIR") or ".") / "wandb" / "settings", config_dir / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(settings)
        except configparser.Error:
            continue
        if parser.get("default", "mode", fallback="").lower() in KEYLESS_MODES:
            return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as the trackers' scalars (tag -> value); {} for other kinds."""
    kind = record.get("type")
    if kind == "train":
        return {f"train/{k}": float(record[k]) for k in TRAIN_SCALARS if record.get(k) is not None}
    if kind in ("val", "test"):
        return {f"{kind}/loss": float(record[f"{kind}_loss"])}
    return {}


class Tracker(Protocol):
    def log(self, record: dict[str, Any]) -> None:
        """Write one metrics.jsonl record's scalars."""

    def close(self) -> None:
        """Flush and close."""


class TensorBoard:
    """tensorboardX event files in `<out>/tensorboard`."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(out / TENSORBOARD_DIR))
        self.writer.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run whose folder is `<out>/wandb`."""

    def __init__(self, out: Path, config: dict[str, Any], project: str) -> None:
        import wandb

        self.run = wandb.init(project=project or "meshtune", name=out.resolve().name, dir=str(out),
                              config=config)

    def log(self, record: dict[str, Any]) -> None:
        if values := scalars(record):
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_trackers(names: list[str], out: Path, *, config: dict[str, Any], project: str = "") -> list[Tracker]:
    """The named trackers, opened for a run writing to `out` (writer rank only)."""
    out.mkdir(parents=True, exist_ok=True)
    return [TensorBoard(out, config) if n == "tensorboard" else WandB(out, config, project) for n in names]


def _yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
