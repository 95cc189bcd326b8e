"""Full training state on disk: atomic, checksummed checkpoints and exact resume.

A checkpoint (RunDir.checkpoint(step)) holds the trainable weights, the optimizer state, the data
cursor, the loop counters and the resolved config; the RNG needs none, as the loop reseeds it from
(seed, step). It is written into a temp sibling, every file fsynced, then renamed into place; its
manifest, written last, records each file's size and sha256, so a resume tells a damaged checkpoint
from a good one (`resumable_checkpoint`). MLX's safetensors writer does not report a full disk, so
each file is checked against its own header; a failed write is one `CheckpointWriteError`. A
pipeline writes one shard per stage (parallel/pipeline/state.py), which one process loads whole.
docs/reliability.md, "Checkpoints and resume", says what a resume promises.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import yaml
from mlx.utils import tree_flatten, tree_unflatten

from ..run_dir import MANIFEST, REQUIRED, CheckpointDir, RunDir, stage_names, temp_path


class CheckpointWriteError(ValueError):
    """A save failed (disk full, folder not writable); the last good checkpoint is untouched."""


class NonFiniteValues(Exception):
    """A save found a value that is not finite and wrote nothing: the run stops as a non-finite step does."""

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"step {step}: {what}")
        self.step, self.what = step, what


def require_finite(step: int, arrays: dict[str, mx.array], what: str) -> None:
    """Raise NonFiniteValues naming the first tensor of `arrays` (flat) holding nan or inf; nothing is written.

    The update never applies a non-finite value (training/update.py); this is the save's own check, one
    reduction per tensor at save time only."""
    floating = [(k, v) for k, v in arrays.items() if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)]
    if not floating:
        return
    flags = mx.stack([mx.isfinite(v).all() for _, v in floating])
    if flags.all().item():
        return
    bad = next(k for (k, _), ok in zip(floating, flags.tolist()) if not ok)
    raise NonFiniteValues(step, f"{what} {bad} holds nan or inf, so nothing was saved for this step")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_error(folder: Path, err: BaseException) -> str:
    """The one line a failed write gets: which folder, why, and what to do."""
    why = getattr(err, "strerror", None) or str(err) or type(err).__name__
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    fix = "free disk space there" if full else "make it writable"
    return (f"cannot write to {folder} ({why}); {fix} or point --adapter-path elsewhere; "
            "earlier checkpoints are intact")


def save_safetensors_checked(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    """mx.save_safetensors, raising OSError on any failure, a truncated file included."""
    try:
        mx.save_safetensors(str(path), arrays, metadata=metadata or {})
    except RuntimeError as err:  # MLX reports an unopenable file, and a write that failed, as RuntimeError
        room = shutil.disk_usage(path.parent).free
        full = room < sum(v.nbytes for v in arrays.values()) + (1 << 16)  # MLX does not say why: the disk does
        raise OSError(errno.ENOSPC if full else errno.EIO,
                      f"No space left on device ({err})" if full else str(err)) from None
    _check_complete(path)


def _check_complete(path: Path) -> None:
    # A safetensors file is an 8-byte header length, a JSON header, then the data up to
    # the largest end offset: anything shorter was cut off (MLX ignores write errors).
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        header = f.read(n) if n is not None and n <= size else b""
    try:
        ends = [v["data_offsets"][1] for k, v in json.loads(header).items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError):
        raise OSError(errno.ENOSPC, f"{path.name} was written incomplete (disk full?)") from None
    if size < 8 + n + max(ends, default=0):
        raise OSError(errno.ENOSPC, f"{path.name} was written incomplete (disk full?)")


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a fsynced temp file and a rename."""
    tmp = temp_path(path, str(os.getpid()))
    try:
        tmp.write_text(text)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_save_safetensors(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str] | None = None) -> None:
    """Save arrays through a fsynced, completeness-checked temp file and a rename."""
    tmp = temp_path(path, str(os.getpid()), ".safetensors")
    try:
        save_safetensors_checked(tmp, arrays, metadata)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(kw_only=True)
class TrainingState:
    """What a resumed run needs beyond the model: loop position and counters."""

    step: int
    data_cursor: dict[str, Any]
    trained_tokens: int = 0


def file_record(path: Path) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex} of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def save_checkpoint(adapter_path: Path, *, state: TrainingState, trainable: dict[str, mx.array],
                    optimizer_state: Any, config: dict[str, Any], keep: int = 0,
                    alongside: tuple[Path, ...] = ()) -> Path:
    """Write one complete, checksummed checkpoint atomically; then keep the newest `keep` (0: all).

    The files `alongside` that exist are copied in as they are (the run's adapter_config.json, so
    the checkpoint's adapters.safetensors loads in meshtune generate and fuse, and in mlx-lm, as
    mlx-lm users load its step files). Any OSError becomes a CheckpointWriteError; the temp folder
    goes, older checkpoints stay.
    """
    run = RunDir(adapter_path)
    final = run.checkpoint(state.step).path
    opt = dict(tree_flatten(optimizer_state))
    require_finite(state.step, trainable, "the trained weight")
    require_finite(state.step, opt, "the optimizer state")
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # Not mkdtemp: its folder is mode 0700, which the rename would keep; mkdir follows the umask.
        tmp = run.checkpoint_temp(state.step, os.urandom(6).hex())
        tmp.mkdir()
        written = CheckpointDir(tmp)
        save_safetensors_checked(written.adapters, trainable)
        save_safetensors_checked(written.optimizer, opt)
        written.saved_config.write_text(yaml.safe_dump(config, sort_keys=False))
        for extra in alongside:
            if extra.is_file():
                shutil.copyfile(extra, tmp / extra.name)
        files = {f.name: file_record(f) for f in sorted(tmp.iterdir())}
        manifest = {"step": state.step, "data_cursor": state.data_cursor,
                    "trained_tokens": state.trained_tokens, "optimizer_keys": sorted(opt), "files": files}
        written.manifest.write_text(json.dumps(manifest, indent=2))
        for f in tmp.iterdir():
            _fsync_file(f)
        if final.exists():  # a re-run of the same step replaces the old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(write_error(final.parent, err)) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(adapter_path, keep=keep, just_written=final)
    return final


def write_stage(folder: Path, k: int, *, state: TrainingState, trainable: dict[str, mx.array],
                optimizer_state: dict[str, mx.array], config: dict[str, Any], layout: dict[str, Any]) -> None:
    """Write stage k's shard and its manifest (last) into `folder`, every file fsynced.

    `layout` (stage count and block ranges) tells a resumed run whether the shard fits its own stages.
    """
    weights, optimizer, name = stage_names(k)
    require_finite(state.step, trainable, "the trained weight")
    require_finite(state.step, optimizer_state, "the optimizer state")
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors_checked(folder / weights, trainable)
    save_safetensors_checked(folder / optimizer, optimizer_state)
    manifest = {"step": state.step, "data_cursor": state.data_cursor, "trained_tokens": state.trained_tokens,
                **layout, "stage": k, "optimizer_keys": sorted(optimizer_state), "config": config,
                "files": {f: file_record(folder / f) for f in (weights, optimizer)}}
    (folder / name).write_text(json.dumps(manifest, indent=2))
    for f in (weights, optimizer, name):
        _fsync_file(folder / f)


def publish_stage(tmp: Path, final: Path, k: int) -> None:
    """Put stage k's files from the temp folder into the checkpoint folder.

    The first writer to get here renames the whole temp folder (with whatever stages
    share its filesystem); a later one finds the temp folder gone (its files went
    along) or, on another host or over an older copy of the step, moves its own files
    in. A manifest is removed first and moved last, so a half-moved stage reads as damaged.
    """
    if not tmp.exists():
        return
    if not final.exists():
        try:
            os.rename(tmp, final)
            _fsync_dir(final.parent)
            return
        except OSError:
            if not tmp.exists():
                return
    names, published = stage_names(k), CheckpointDir(final)
    stale = [published.manifest, *published.stage_manifests()] if k == 0 else [published.stage(k)[2]]
    for old in stale:  # the first stage clears an older copy's manifests, so stages never mix copies
        old.unlink(missing_ok=True)
    for f in names:
        os.replace(tmp / f, final / f)
    _fsync_dir(final)
    try:
        tmp.rmdir()
    except OSError:  # other stages' files are still in it; their writers move them next
        pass


def prune_checkpoints(adapter_path: Path, *, keep: int, just_written: Path) -> None:
    """Delete leftover temp folders and all but the newest `keep` checkpoints (0: keep all).

    `just_written` always stays; so do numbered folders past it (damaged ones a resumed
    run skipped), which the run replaces when it reaches their step.
    """
    for leftover in leftover_temps(adapter_path):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0:
        return
    older = [p for p in list_checkpoints(adapter_path) if int(p.name) < int(just_written.name)]
    for old in older[:max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def leftover_temps(adapter_path: Path) -> list[Path]:
    """Temp folders of saves that never finished (a crash between mkdtemp and rename)."""
    return RunDir(adapter_path).leftover_temps()


def list_checkpoints(adapter_path: Path) -> list[Path]:
    """Checkpoint folders with a manifest (not yet verified), oldest first."""
    return [c.path for c in RunDir(adapter_path).numbered() if c.has_manifest]


def _read_manifest(path: Path, name: str) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), or (None, why it cannot be used)."""
    try:
        manifest = json.loads((path / name).read_text())
    except FileNotFoundError:
        return None, f"no {name} (the save never finished)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{name} is unreadable ({' '.join(str(err).split())})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int) \
            or not isinstance(manifest.get("data_cursor"), dict):
        return None, f"{name} lacks step or data_cursor"
    return manifest, None


def _verify_files(path: Path, name: str, files: Any, required: tuple[str, ...]) -> str | None:
    """None if every file the manifest `name` lists (`required` among them) matches its record."""
    if not isinstance(files, dict) or any(f not in files for f in required):
        return f"{name} does not list every file ({', '.join(required)})"
    for fname, record in sorted(files.items()):
        f = path / fname
        if not f.is_file():
            return f"{fname} is missing"
        try:
            size = f.stat().st_size
            if size != record.get("size"):
                return f"{fname} is {size} bytes, the manifest says {record.get('size')}"
            if file_record(f)["sha256"] != record.get("sha256"):
                return f"{fname} does not match its sha256 in the manifest"
        except (OSError, AttributeError) as err:
            return f"{fname} cannot be checked ({err})"
    return None


def verify_stage(path: Path, k: int) -> str | None:
    """None if stage k's shard in a pipeline's checkpoint folder matches its manifest, else why not."""
    weights, optimizer, name = stage_names(k)
    manifest, why = _read_manifest(path, name)
    return why if manifest is None else _verify_files(path, name, manifest.get("files"), (weights, optimizer))


def verify_checkpoint(path: Path) -> str | None:
    """None if the folder is a complete checkpoint whose files match the manifest, else why not.

    A pipeline's folder (stage manifests, no state.json) is complete when every stage's shard verifies.
    """
    if CheckpointDir(path).is_pipeline:
        first, why = _read_manifest(path, stage_names(0)[2])
        stages = first.get("stages") if first is not None else None
        if first is not None and not isinstance(stages, int):
            why = f"{stage_names(0)[2]} lacks the stage count"
        return why or next((w for k in range(stages) if (w := verify_stage(path, k)) is not None), None)
    manifest, why = _read_manifest(path, MANIFEST)
    if manifest is None:
        return why
    files = manifest.get("files")
    if files is None:  # written before checksums existed: presence is all we can check
        missing = [name for name in REQUIRED if not (path / name).is_file()]
        return f"{missing[0]} is missing" if missing else None
    return _verify_files(path, MANIFEST, files, REQUIRED)


def resumable_checkpoint(adapter_path: Path, say: Callable[[str], None] = print,
                         before: int | None = None) -> Path | None:
    """The newest checkpoint (of a step before `before`, where given) that verifies; each one skipped on the
    way is said in one line."""
    for leftover in leftover_temps(adapter_path):
        say(f"warning: skipping checkpoint {leftover}: temp folder of an interrupted save")
    for path in reversed([c.path for c in RunDir(adapter_path).numbered()]):
        if before is not None and int(path.name) >= before:
            continue
        why = verify_checkpoint(path)
        if why is None:
            return path
        say(f"warning: skipping checkpoint {path}: {why}; trying the one before")
    return None


@dataclass(kw_only=True)
class LoadedCheckpoint:
    path: Path
    state: TrainingState
    trainable: dict[str, mx.array]
    optimizer_state: Any
    config: dict[str, Any]


def load_stage(path: Path, k: int) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, mx.array]]:
    """Stage k's (manifest, weights, flat optimizer slots) from a pipeline's folder (verify it first)."""
    weights, optimizer, name = stage_names(k)
    return json.loads((path / name).read_text()), mx.load(str(path / weights)), mx.load(str(path / optimizer))


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """Read a checkpoint folder written by `save_checkpoint` or by a pipeline's stages (verify it first).

    A pipeline's shards are merged into one process's layout (the shared step and
    learning rate come from the first stage).
    """
    files = CheckpointDir(path)
    if not files.manifest.exists():
        manifest, trainable, opt = load_stage(path, 0)
        for k in range(1, manifest["stages"]):
            _, weights, slots = load_stage(path, k)
            trainable.update(weights)
            opt = {**slots, **opt}
        config = manifest["config"]
    else:
        manifest = json.loads(files.manifest.read_text())
        opt = mx.load(str(files.optimizer))
        trainable = mx.load(str(files.adapters))
        config = yaml.safe_load(files.saved_config.read_text())
    return LoadedCheckpoint(
        path=path,
        state=TrainingState(step=manifest["step"], data_cursor=manifest["data_cursor"],
                            trained_tokens=manifest.get("trained_tokens", 0)),
        trainable=trainable,
        optimizer_state=tree_unflatten(list(opt.items())),
        config=config,
    )
