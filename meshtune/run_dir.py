"""The run folder: every file name and folder rule of a run, its checkpoints and a pipeline's stages.

A run writes into one folder (`output.adapter_path`): `RunDir(path)` names each thing in it, and
`CheckpointDir` each file of one `checkpoints/<7-digit step>/` folder, a pipeline stage's shard
included. Every other module asks these two; none spells a name (tests/unit/test_run_dir.py greps
the package for them). The lowest layer: no MLX, nothing of meshtune imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# mlx-lm's names: stock `mlx_lm.load(model, adapter_path=...)` reads these two.
ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.md"
PLOT_FILE = "loss.png"
LOCK_FILE = ".meshtune.lock"
HEARTBEATS = ".heartbeats"
CHECKPOINTS = "checkpoints"
MODEL_FOLDER = "model"  # a pipeline's fully fine-tuned model, in mlx-lm's sharded layout
EARLIER_RUN = ".earlier-run-"  # + pid: where output.overwrite moves the earlier run before removing it

# One checkpoint folder: the manifest is written last and lists every other file with its checksum.
MANIFEST = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
SAVED_CONFIG = "config.yaml"
REQUIRED = (ADAPTER_FILE, OPTIMIZER_FILE, SAVED_CONFIG)
STAGE_MANIFESTS = "state.stage*.json"

TEMP_MARK = ".tmp-"


def stage_names(k: int) -> tuple[str, str, str]:
    """Stage k's weights, optimizer slots and manifest, in a pipeline's checkpoint folder."""
    return f"stage{k}.safetensors", f"stage{k}.optimizer.safetensors", f"state.stage{k}.json"


def temp_path(path: Path, tag: str, suffix: str = "") -> Path:
    """The hidden sibling `.NAME.tmp-TAG[SUFFIX]` a write goes to before its rename into `path`."""
    return path.with_name(f".{path.name}{TEMP_MARK}{tag}{suffix}")


def is_temp(path: Path) -> bool:
    """Whether `path` is a write that was never renamed into place (temp_path's name)."""
    return path.name.startswith(".") and TEMP_MARK in path.name


def is_earlier_run(path: Path) -> bool:
    """Whether `path` is an earlier run that output.overwrite set aside (RunDir.earlier_run)."""
    return path.name.startswith(EARLIER_RUN)


def heartbeat_file(folder: Path, rank: int) -> Path:
    """Rank `rank`'s heartbeat in a heartbeat folder (a run's `heartbeats`, or the launcher's)."""
    return Path(folder) / f"rank{rank}.json"


def heartbeat_temp(folder: Path, rank: int) -> Path:
    """Where rank `rank`'s next heartbeat is written before it replaces the last."""
    return Path(folder) / f".rank{rank}.json.tmp"


@dataclass(frozen=True)
class CheckpointDir:
    """One checkpoint folder (or its temp folder while it is written): one process's files, or a
    pipeline's per-stage shards."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def step(self) -> int:
        return int(self.path.name)

    @property
    def adapters(self) -> Path:
        return self.path / ADAPTER_FILE

    @property
    def optimizer(self) -> Path:
        return self.path / OPTIMIZER_FILE

    @property
    def saved_config(self) -> Path:
        """The resolved config as YAML (one process's checkpoint; a pipeline's is in each stage manifest)."""
        return self.path / SAVED_CONFIG

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST

    @property
    def adapter_config(self) -> Path:
        """The run's adapter_config.json, copied in so the checkpoint loads as adapters."""
        return self.path / CONFIG_FILE

    def stage(self, k: int) -> tuple[Path, Path, Path]:
        """Stage k's weights, optimizer slots and manifest."""
        return tuple(self.path / name for name in stage_names(k))  # type: ignore[return-value]

    def stage_manifests(self) -> list[Path]:
        """Every stage manifest in the folder (none for one process's checkpoint)."""
        return list(self.path.glob(STAGE_MANIFESTS))

    @property
    def is_pipeline(self) -> bool:
        """Written by a pipeline's stages: no one manifest, a first stage's."""
        return not self.manifest.exists() and self.stage(0)[2].exists()

    @property
    def has_manifest(self) -> bool:
        """A save finished here (not yet verified): its manifest, or a stage's."""
        return self.manifest.exists() or bool(self.stage_manifests())


@dataclass(frozen=True)
class RunDir:
    """A run's folder: what it writes, and where."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def adapters(self) -> Path:
        """The trained weights, one file in one process's layout."""
        return self.path / ADAPTER_FILE

    @property
    def config(self) -> Path:
        """adapter_config.json: mlx-lm's keys, plus the resolved config under "meshtune"."""
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def report(self) -> Path:
        return self.path / REPORT_FILE

    @property
    def plot(self) -> Path:
        return self.path / PLOT_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def heartbeats(self) -> Path:
        """Where the ranks exchange heartbeats when no launcher gave them a folder."""
        return self.path / HEARTBEATS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def model(self) -> Path:
        """The fully fine-tuned model a pipeline's stages write beside the adapters (stage_model.py)."""
        return self.path / MODEL_FOLDER

    def base_path_record(self, rank: int | str) -> Path:
        """The crossovers rank `rank` measured for quantized bases, which --resume multiplies by."""
        return self.path / f"base_path.rank{rank}.json"

    def earlier_run(self, pid: int) -> Path:
        """Where output.overwrite sets the earlier run aside before removing it."""
        return self.path / f"{EARLIER_RUN}{pid}"

    def marks_a_run(self) -> list[Path]:
        """The files besides checkpoints whose presence says an earlier run wrote here."""
        return [self.adapters, self.config, self.metrics, self.report]

    def checkpoint(self, step: int) -> CheckpointDir:
        return CheckpointDir(self.checkpoints / f"{step:07d}")

    def checkpoint_temp(self, step: int, tag: str) -> Path:
        """The temp folder step `step`'s checkpoint is written into before its rename."""
        return temp_path(self.checkpoint(step).path, tag)

    def numbered(self) -> list[CheckpointDir]:
        """Every numbered checkpoint folder, finished or not, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        return sorted((CheckpointDir(p) for p in self.checkpoints.iterdir() if p.name.isdigit() and p.is_dir()),
                      key=lambda c: c.step)

    def leftover_temps(self) -> list[Path]:
        """Temp folders of saves that never finished (a crash between the write and the rename)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if is_temp(p))
