"""Full training state on disk: atomic writes, a manifest per checkpoint, exact resume.

A checkpoint is `checkpoints/<7-digit step>/` holding the trainable weights, the
optimizer state, the data cursor, the loop counters and the resolved config. The RNG
state is (seed, step): the loop reseeds MLX's generator every step, since MLX offers
no way to set its key back to a saved value. It is written into a temporary sibling folder, every file fsynced, then
renamed into place, so a crash leaves either a complete checkpoint or none; the
manifest (`state.json`) is written last and marks a folder as complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import yaml
from mlx.utils import tree_flatten, tree_unflatten

CHECKPOINTS = "checkpoints"
MANIFEST = "state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a fsynced temp file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)


def atomic_save_safetensors(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    """mx.save_safetensors through a fsynced temp file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata=metadata or {})
    _fsync_file(tmp)
    os.replace(tmp, path)


@dataclass(kw_only=True)
class TrainingState:
    """What a resumed run needs beyond the model: loop position and counters."""

    step: int
    data_cursor: dict[str, Any]
    trained_tokens: int = 0


def checkpoint_dir(adapter_path: Path, step: int) -> Path:
    return Path(adapter_path) / CHECKPOINTS / f"{step:07d}"


def save_checkpoint(adapter_path: Path, *, state: TrainingState, trainable: dict[str, mx.array],
                    optimizer_state: Any, config: dict[str, Any], keep: int = 0) -> Path:
    """Write one complete checkpoint atomically; prune to the newest `keep` (0 keeps all)."""
    final = checkpoint_dir(adapter_path, state.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        mx.save_safetensors(str(tmp / "adapters.safetensors"), trainable)
        opt = dict(tree_flatten(optimizer_state))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        manifest = {"step": state.step, "data_cursor": state.data_cursor,
                    "trained_tokens": state.trained_tokens, "optimizer_keys": sorted(opt)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        for f in tmp.iterdir():
            _fsync_file(f)
        if final.exists():  # a re-run of the same step replaces the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(adapter_path)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(adapter_path: Path) -> list[Path]:
    """Complete checkpoints (manifest present), oldest first."""
    root = Path(adapter_path) / CHECKPOINTS
    if not root.exists():
        return []
    done = [p for p in root.iterdir() if p.name.isdigit() and (p / MANIFEST).exists()]
    return sorted(done, key=lambda p: int(p.name))


def latest_checkpoint(adapter_path: Path) -> Path | None:
    found = list_checkpoints(adapter_path)
    return found[-1] if found else None


@dataclass(kw_only=True)
class LoadedCheckpoint:
    path: Path
    state: TrainingState
    trainable: dict[str, mx.array]
    optimizer_state: Any
    config: dict[str, Any]


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read a checkpoint folder written by `save_checkpoint`."""
    manifest = json.loads((path / MANIFEST).read_text())
    opt = mx.load(str(path / "optimizer.safetensors"))
    return LoadedCheckpoint(
        path=path,
        state=TrainingState(step=manifest["step"], data_cursor=manifest["data_cursor"],
                            trained_tokens=manifest.get("trained_tokens", 0)),
        trainable=mx.load(str(path / "adapters.safetensors")),
        optimizer_state=tree_unflatten(list(opt.items())),
        config=yaml.safe_load((path / "config.yaml").read_text()),
    )
