"""A pipeline's checkpoints, written and resumed per stage, and its assembled adapters.

Each stage trains and keeps optimizer state only for its own blocks, and that is all it writes: at a
save, the writer of stage k (dp_rank 0, pp_rank k) puts its trained weights (global names; a tied
table only from the first stage) and its optimizer slots into the step's folder, with a manifest of
its own (checksums, step, data cursor, trained tokens, resolved config, stage layout): `save_stages`.
No rank ever holds another stage's optimizer state. On resume the ranks agree on the newest step that
verifies on all of them and each stage loads its own shard (`resumable_step`); another layout's
checkpoint is loaded whole where all its files are visible. The final adapters stay one file in one
process's layout, so stock mlx-lm loads it (`write_gathered`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ...run_dir import RunDir, stage_names
from ...training.checkpoint import (CheckpointWriteError, LoadedCheckpoint, TrainingState, leftover_temps,
                                   load_checkpoint, load_stage, prune_checkpoints, publish_stage, verify_checkpoint,
                                   verify_stage, write_error, write_stage, NonFiniteValues)
from ...training.streamed_safetensors import StreamedSafetensors
from .stage import PipelineStage


def _owned(stage: PipelineStage) -> set[str]:
    """Trained parameter names this rank contributes when gathering."""
    if stage.mesh.dp_rank != 0:
        return set()
    own = set(dict(tree_flatten(stage.model.trainable_parameters())))
    return own if stage.first else own - set(stage.tied_keys)


def write_gathered(path: Path, stage: PipelineStage, keys: list[str]) -> None:
    """Write `keys`' current values into the one safetensors file `path`, in one process's layout, a
    tensor at a time (a collective; the writer writes, and holds one other stage's tensor at a time).

    Each tensor travels in one world all_sum to which only its owner contributes (replica 0's copy,
    the first stage's for a tied table), so values arrive bit for bit on any backend.
    """
    values = dict(tree_flatten(stage.model.parameters()))
    own = _owned(stage)
    spec = {k: (shape, dtype) for k, shape, dtype in stage.all_params}
    stream, error = None, None
    if stage.mesh.is_writer:
        try:
            stream = StreamedSafetensors(path, [(k, *spec[k]) for k in keys])
        except OSError as err:
            error = err
    # A write that fails keeps the writer in every sum, so no rank waits for it; it raises at the end.
    for k in keys:
        value = stage.mesh.all_sum(values[k] if k in own else mx.zeros(*spec[k]))
        mx.eval(value)
        if stream is not None and error is None:
            try:
                stream.write(k, value)
            except OSError as err:
                error = err
    if stream is not None:
        try:
            stream.close(commit=error is None)
        except OSError as err:
            error = err
    if error is not None:
        raise error


def stage_optimizer_state(stage: PipelineStage, flat: dict[str, mx.array]) -> Any:
    """From a whole model's flat optimizer state, the tree this stage's optimizer keeps."""
    params = {k for k, _, _ in stage.all_params}
    own = set(dict(tree_flatten(stage.model.trainable_parameters())))
    keep = [(k, v) for k, v in flat.items() if k.rsplit(".", 1)[0] in own or k.rsplit(".", 1)[0] not in params]
    return tree_unflatten(keep)


def _shard(stage: PipelineStage, optimizer: Any) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(weights, flat optimizer slots) this stage writes: what it trains, a tied table only on the first."""
    tied = set() if stage.first else set(stage.tied_keys)
    weights = {k: v for k, v in tree_flatten(stage.model.trainable_parameters()) if k not in tied}
    params = {k for k, _, _ in stage.all_params}
    slots = {k: v for k, v in tree_flatten(optimizer.state)
             if k.rsplit(".", 1)[0] in weights or k.rsplit(".", 1)[0] not in params}  # step, learning_rate: shared
    return weights, slots


def _layout(stage: PipelineStage) -> dict[str, Any]:
    return {"stages": stage.stages, "bounds": [list(b) for b in stage.bounds]}


def save_stages(out: Path, stage: PipelineStage, optimizer: Any, *, state: TrainingState,
                config: dict[str, Any], keep: int = 0) -> Path:
    """Write this step's checkpoint, each stage's writer its own shard (a collective).

    Atomic on a shared filesystem and on hosts with their own disks alike: every writer writes into
    the temp folder `.<step>.tmp-stages` beside the checkpoint (on a shared filesystem all stages
    share it), fsynced, then a barrier; the first stage's writer publishes (renames the temp folder
    into place where the step's folder does not exist yet, else moves its files in), a second
    barrier, then the others publish: on a shared filesystem they find their files already in
    place, on another host they rename or move their own. A third barrier ends the save, so no rank
    resumes past a half-written step.
    """
    mesh, k = stage.mesh, stage.stage
    writer = mesh.dp_rank == 0
    final = RunDir(out).checkpoint(state.step).path
    tmp = RunDir(out).checkpoint_temp(state.step, "stages")
    error: OSError | NonFiniteValues | None = None

    def attempt(do: Callable[[], None]) -> None:
        nonlocal error
        if writer and error is None:
            try:
                do()
            except (OSError, NonFiniteValues) as err:
                error = err

    def write() -> None:
        weights, slots = _shard(stage, optimizer)
        write_stage(tmp, k, state=state, trainable=weights, optimizer_state=slots, config=config,
                    layout=_layout(stage))

    attempt(write)
    if not mesh.agree(error is not None):  # every stage's files are in a temp folder
        attempt(lambda: publish_stage(tmp, final, k) if k == 0 else None)
        mesh.agree(False)  # the first stage's files are in place before the others move theirs
        attempt(lambda: publish_stage(tmp, final, k) if k != 0 else None)
    if mesh.agree(error is not None):
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if mesh.agree(isinstance(error, NonFiniteValues)):  # every rank stops as at a non-finite step
            raise error if isinstance(error, NonFiniteValues) else NonFiniteValues(
                state.step, "another stage's weights hold nan or inf (its line), so nothing was saved for this step")
        if error is not None:
            raise CheckpointWriteError(write_error(final.parent, error))
        raise CheckpointWriteError(f"another stage's writer could not save checkpoint {final} (see its message); "
                                   "earlier checkpoints are intact")
    if writer:
        prune_checkpoints(out, keep=keep, just_written=final)
    return final


def _check(path: Path, stage: PipelineStage) -> tuple[str | None, bool]:
    """(why `path` cannot resume this rank or None, whether it is read as this stage's own shard)."""
    name = stage_names(stage.stage)[2]
    written = None
    try:
        manifest = json.loads((path / name).read_text())
        written = manifest["stages"]
        own = {"stages": written, "bounds": manifest["bounds"]} == _layout(stage)
    except (OSError, ValueError, KeyError, TypeError):
        own = False
    if not own:  # another layout, or a damaged manifest: read (and so verify) the whole model
        why = verify_checkpoint(path)
        if why is not None and isinstance(written, int) and written != stage.stages:
            why += (f" (written with parallel.pp={written}: resume with --parallel.pp {written}, "
                    "or make every stage's files visible here)")
        return why, False
    needed = [stage.stage] + ([0] if stage.tied_keys and stage.last else [])
    return next((why for j in needed if (why := verify_stage(path, j)) is not None), None), True


def resumable_step(out: Path, stage: PipelineStage, say: Callable[[str], None]) -> tuple[Path, bool] | None:
    """The newest checkpoint every rank can resume from, and whether it is read per stage (a collective).

    Each rank checks, for its own stage, the candidate steps newest first; the ranks agree on the
    newest that verifies on all of them (two world all_sums per candidate), and a skipped one is said
    once, by the first rank that found it damaged. With separate disks every replica's host must see
    its stage's shard (a shared filesystem, or a copy).
    """
    mesh, run = stage.mesh, RunDir(out)
    for leftover in leftover_temps(out):
        say(f"warning: skipping checkpoint {leftover}: temp folder of an interrupted save")
    local = [c.step for c in reversed(run.numbered())]
    tried: set[int] = set()
    while True:
        step = max(mesh.all_ints(next((s for s in local if s not in tried), -1)))
        if step < 0:
            return None
        tried.add(step)
        path = run.checkpoint(step).path
        why, own = _check(path, stage) if path.is_dir() else ("no such folder on this host", False)
        bad = mesh.all_ints(int(why is not None))
        if not any(bad):
            return path, own
        if bad.index(1) == mesh.rank:  # said once, by the first rank that cannot use it
            print(f"warning: skipping checkpoint {path}: {why}; trying the one before", flush=True)


def load_stage_checkpoint(path: Path, own: bool, stage: PipelineStage) -> LoadedCheckpoint:
    """What this stage resumes from `path`: its trained weights and the tree of its optimizer slots."""
    if not own:
        ckpt = load_checkpoint(path)
        expected = {k for k, _, _ in stage.all_params}
        if set(ckpt.trainable) != expected:
            raise ValueError(f"--resume: {path} does not hold this model's trained parameters; "
                             "resume with the run's own model and adapter settings")
        ckpt.optimizer_state = stage_optimizer_state(stage, dict(tree_flatten(ckpt.optimizer_state)))
        return ckpt
    manifest, weights, slots = load_stage(path, stage.stage)
    if stage.tied_keys and stage.last:  # the tied table (and its slots) is written by the first stage only
        _, first_weights, first_slots = load_stage(path, 0)
        tied = set(stage.tied_keys)
        weights.update({k: v for k, v in first_weights.items() if k in tied})
        slots.update({k: v for k, v in first_slots.items() if k.rsplit(".", 1)[0] in tied})
    expected = set(dict(tree_flatten(stage.model.trainable_parameters())))
    if set(weights) != expected:
        raise ValueError(f"--resume: {path / stage_names(stage.stage)[0]} does not hold this stage's trained "
                         "parameters; resume with the run's own model and adapter settings")
    return LoadedCheckpoint(path=path, state=TrainingState(step=manifest["step"], data_cursor=manifest["data_cursor"],
                                                           trained_tokens=manifest.get("trained_tokens", 0)),
                            trainable=weights, optimizer_state=tree_unflatten(list(slots.items())),
                            config=manifest["config"])
