"""What a run checks before its model loads, so a bad input costs seconds and writes nothing.

`check_before_load` is api.finetune's one call: the data source, the layout against the
model's declared blocks, full fine-tuning on a dense base, the adapters to start from, the
trackers' libraries, a --resume with checkpoints to resume, and every rank given the same
settings. The output folder's own checks (an earlier run, writable) come first, on the writer.
`check_plan_fits` runs once the data is read, still before anything is written: the run's plan
against the memory a rank may use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

from .config import Config
from .config.resume import settings_digests
from .data import check_source
from .runtime.mesh import Mesh
from .parallel.pipeline.split import declared_layers
from .run_data import split_names
from .run_dir import ADAPTER_FILE, CHECKPOINTS, RunDir
from .training.checkpoint import list_checkpoints
from .training.trackers import check_trackers

T = TypeVar("T")


def check_before_load(cfg: Config, mesh: Mesh, layout: Any, out: Path) -> list[str]:
    """Every check that needs no model loaded; the trackers the writer will open (--report-to)."""
    model_path = str(cfg.resolved_model_path())
    check_source(str(cfg.resolved_data_path()), split_names(cfg))  # a folder or a hub id
    layout.check(cfg, mesh, Path(model_path))
    if cfg.adapter.fine_tune_type == "full":
        check_full_is_dense(cfg, Path(model_path))
    if cfg.adapter.init_from and not cfg.output.resume:
        check_init_from(cfg.adapter, model_path)
    trackers = on_writer(mesh, lambda: check_trackers(cfg.output.report_to)) or []
    if cfg.output.resume and not RunDir(out).checkpoints.is_dir():  # the restore checks the rest
        raise ValueError(no_checkpoint(out, "no checkpoint"))
    check_ranks_agree(cfg, mesh)
    return trackers


def on_writer(mesh: Mesh, check: Callable[[], T]) -> T | None:
    """`check`'s result, run on the writer alone; when it refuses the run, every rank stops (one agree):
    the others would otherwise wait in the next collective until the link was blamed."""
    refused, result = None, None
    if mesh.is_writer:
        try:
            result = check()
        except ValueError as err:
            refused = err
    if mesh.agree(refused is not None):
        raise refused or ValueError(f"rank {mesh.rank}: stopping with rank 0, which refused the run (its line)")
    return result


def check_ranks_agree(cfg: Config, mesh: Mesh) -> None:
    """Every rank given the same run settings (each host's own config file or flags): else one would
    hang at the first step, or train apart."""
    differing = mesh.disagreeing(settings_digests(cfg.to_dict()))
    if differing:
        raise ValueError(f"the ranks were given different settings for {', '.join(differing)}; give every rank "
                         "the same config file and flags")


def check_full_is_dense(cfg: Config, folder: Path) -> None:
    """Refuse full fine-tuning of a targeted quantized layer before the load, from the local folder's
    safetensors headers as `meshtune plan` reads them (a layer with scales); apply_adapters refuses it
    after the load for a hub id, or a folder the headers do not describe."""
    from .plan.memory import trained  # no MLX: the planner's readers
    from .plan.model_facts import read_model

    if not (folder / "config.json").exists():
        return
    try:
        facts = read_model(folder)
    except ValueError:
        return  # load_model names what the folder lacks
    trained(facts, cfg.adapter)  # raises full_needs_dense's line for a targeted quantized layer


def init_file(init_from: str) -> Path:
    """adapter.init_from's weights file: the path, or a run folder's adapters.safetensors."""
    path = Path(init_from).expanduser()
    return RunDir(path).adapters if path.is_dir() else path


def check_init_from(a: Any, model_path: str) -> None:
    """adapter.init_from names trained adapters of this run's kind, rank, blocks and layers (its
    adapter_config.json)."""
    file = init_file(a.init_from)
    if not file.is_file():
        what = (f"no {ADAPTER_FILE} in that folder" if Path(a.init_from).expanduser().is_dir()
                else "no such file or folder")
        raise ValueError(f"adapter.init_from={a.init_from}: {what}; give a trained run's folder or its "
                         f"{ADAPTER_FILE}")
    theirs_file = RunDir(file.parent).config
    try:
        theirs = json.loads(theirs_file.read_text())
    except (OSError, ValueError):
        return  # a bare weights file: load_trainable names any tensor that does not fit
    kind, rank = theirs.get("fine_tune_type", "lora"), (theirs.get("lora_parameters") or {}).get("rank")
    if kind != a.fine_tune_type or (kind != "full" and rank is not None and rank != a.rank):
        flags = f"--fine-tune-type {kind}" + (f" --adapter.rank {rank}" if kind != "full" and rank else "")
        raise ValueError(f"adapter.init_from={a.init_from}: those are {kind} adapters"
                         + (f" of rank {rank}" if kind != "full" and rank else "")
                         + f" ({theirs_file}); give {flags} to start from them")
    blocks = declared_layers(model_path)
    covered = lambda n: blocks if n is None or n < 0 or n > blocks else n  # noqa: E731
    theirs_n = theirs.get("num_layers")
    if blocks and isinstance(theirs_n, int) and covered(theirs_n) != covered(a.num_layers):
        raise ValueError(f"adapter.init_from={a.init_from}: those adapters cover the last {covered(theirs_n)} of "
                         f"{blocks} blocks, this run {covered(a.num_layers)} ({theirs_file} "
                         f"num_layers {theirs_n}); give --num-layers {theirs_n} to start from them")
    their_keys = (theirs.get("lora_parameters") or {}).get("keys")
    if their_keys and a.keys and sorted(their_keys) != sorted(a.keys):
        raise ValueError(f"adapter.init_from={a.init_from}: those adapters train {', '.join(their_keys)}, this run "
                         f"{', '.join(a.keys)} ({theirs_file}); give --adapter.keys "
                         f"'{json.dumps(their_keys)}' to start from them")


def check_output_folder(cfg: Config, out: Path) -> None:
    """Refuse to overwrite an earlier run unless resuming or told to: a folder holding any file a run
    writes (a run that died before its first save leaves only metrics.jsonl and adapter_config.json)."""
    if cfg.output.resume or cfg.output.overwrite:
        return
    found = list_checkpoints(out)
    left = [path.name for path in RunDir(out).marks_a_run() if path.exists()]
    if found or left or RunDir(out).checkpoints.is_dir():
        what = f"checkpoints up to step {int(found[-1].name)}" if found else (left[0] if left else CHECKPOINTS)
        raise ValueError(f"output.adapter_path={out} already holds a run ({what}); pass --resume to "
                         "continue it, --output.overwrite true to replace it, or choose another --adapter-path")


def no_checkpoint(out: Path, what: str) -> str:
    return (f"--resume: {what} in {RunDir(out).checkpoints}; run without --resume to start, "
            "or point --adapter-path at the run")


OVER_PLAN = 1.2
"""How far the plan may exceed the memory before a run is stopped: the planner's estimates run up to
21% over a measured peak (docs/plan.md), and a run that might fit is let run."""


def fitting_advice(cfg: Config, stages: int | None = None) -> str:
    """The flags that make a run smaller, each with its value now; `stages`: the pipeline stages the plan
    found to divide the model enough (meshtune plan's stages_to_fit), said first."""
    t, d, a = cfg.train, cfg.data, cfg.adapter
    ways = [f"{stages} pipeline stages, one a rank (--parallel.pp {stages} under meshtune launch -n {stages})"
            ] if stages and stages > cfg.parallel.pp else []
    ways += [] if t.grad_checkpoint or cfg.parallel.pp > 1 else ["--grad-checkpoint"]
    ways += [f"shorter packed rows --data.pack_length (now {d.pack_length})" if d.pack and d.pack_length
             else f"a shorter --max-seq-length (now {d.max_seq_length})"]
    if t.batch_size > 1:
        ways.append(f"a smaller --batch-size with --grad-accumulation-steps (now {t.batch_size})")
    ways.append(f"fewer adapted blocks --num-layers (now {a.num_layers})")
    if not stages:
        ways.append(f"pipeline stages on more machines --parallel.pp (now {cfg.parallel.pp})")
    return "to fit: " + ", ".join(ways) + "; meshtune plan estimates each"


def check_plan_fits(cfg: Config, mesh: Mesh, longest: int, machine: Any) -> None:
    """Stop (ValueError, every rank) where this run's plan needs more than OVER_PLAN x the memory a rank
    may use (runtime.memory_limit_gb; `machine` is runtime.device_memory.detect() from before the load).

    `longest` is the training split's longest example in tokens; packed rows (data.pack) are
    data.pack_length tokens where the run recorded one, else data.max_seq_length."""
    limit = cfg.runtime.memory_limit_gb
    memory = limit * 1e9 if limit > 0 else machine.memory
    need, stages = _planned_need(cfg, mesh, longest, memory) if limit >= 0 and memory > 0 else (None, None)
    over = need is not None and need > OVER_PLAN * memory
    if not mesh.agree(over):
        return
    where = "--runtime.memory_limit_gb" if limit > 0 else machine.describe()
    mine = (f"this run's plan needs ~{need / 1e9:.3g} GB a rank and {where} gives {memory / 1e9:.3g} GB"
            if over else "another rank's plan does not fit its memory")
    raise ValueError(f"{mine}; {fitting_advice(cfg, stages)} (--runtime.memory_limit_gb -1 runs it anyway)")


def _planned_need(cfg: Config, mesh: Mesh, longest: int, memory: float) -> tuple[float | None, int | None]:
    """meshtune plan's total for this run's layout on its rows (None where it has none), and
    the pipeline stages that would fit `memory` bytes a rank where one process does not."""
    from .plan import plan

    d = cfg.data
    seq = None if d.pack else max(1, min(longest, d.max_seq_length))  # packed: plan's data.pack_length default
    try:
        result = plan(cfg, mesh.world_size, memory / 1e9, "10gbit", seq_len=seq)
    except (ValueError, KeyError, OSError):  # the planner cannot read this model: no check, not a stop
        return None, None
    row = next((r for r in result["layouts"] if r["dp"] == mesh.dp and r["pp"] == mesh.pp and "total" in r), None)
    return (None if row is None else row["total"]), result["stages_to_fit"]
