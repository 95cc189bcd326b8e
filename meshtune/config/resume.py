"""Resuming from a run's own settings: the config a checkpoint saved, and flags checked against it.

`meshtune train --adapter-path runs/x --resume` needs no other flag: the run's
settings come from its newest checkpoint (`checkpoints/<step>/config.yaml`, or a
pipeline's `state.stage0.json`; the adapter folder's `adapter_config.json` holds the
same under "meshtune"). Every section starts from the checkpoint. A run setting given
again must equal the checkpoint's, except ``train.iters``, which may extend the run; an
output, parallel or runtime setting given now wins (a run saved with ``parallel.pp 2``
resumes in one process with ``--parallel.pp 1``), and only ``output.adapter_path``,
``output.resume`` and ``output.overwrite`` describe this launch alone. File names
come from meshtune.run_dir (no MLX: the CLI reads configs before choosing the BLAS).
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path
from typing import Any

import yaml

from ..run_dir import RunDir
from .build import build
from .fields import field_types
from .schema import Config
from .sections import SECTIONS, ConfigError

#: Sections the checkpoint decides: what is trained, on what, and how.
RUN_SECTIONS = ("model", "data", "adapter", "optimizer", "schedule", "train")
#: Keys this launch alone decides: where it writes, and that it resumes.
LAUNCH_KEYS = ("output.adapter_path", "output.resume", "output.overwrite")
#: Run keys a resumed run may change: more steps extend it.
EXTENDABLE = ("train.iters",)
# Settings a resumed run does not use, so they may differ: the checkpoint holds the weights since.
UNUSED_ON_RESUME = ("adapter.init_from",)
# How a run answers trouble, not what it trains: a resumed run may answer differently.
ANSWERS_TO_TROUBLE = ("train.divergence_reports", "data.changed_ok")
RESUMABLE_CHANGES = EXTENDABLE + UNUSED_ON_RESUME + ANSWERS_TO_TROUBLE


def saved_run_config(adapter_path: str | Path) -> tuple[dict[str, Any], str] | None:
    """(the resolved config a run saved, the file it came from), newest checkpoint first; None if none."""
    run = RunDir(adapter_path)
    for checkpoint in reversed(run.numbered()):
        first_stage = checkpoint.stage(0)[2]
        try:
            if checkpoint.saved_config.is_file():
                saved = yaml.safe_load(checkpoint.saved_config.read_text(encoding="utf-8"))
                source = checkpoint.saved_config
            elif first_stage.is_file():
                saved = json.loads(first_stage.read_text(encoding="utf-8")).get("config")
                source = first_stage
            else:
                continue
        except (OSError, ValueError, yaml.YAMLError):
            continue  # a damaged checkpoint; the resume itself says so and takes the one before
        if isinstance(saved, dict):
            return saved, str(source)
    try:
        saved = json.loads(run.config.read_text(encoding="utf-8")).get("meshtune")
    except (OSError, ValueError):
        return None
    return (saved, str(run.config)) if isinstance(saved, dict) else None


PATH_KEYS = ("model.path", "data.path")


def _same_folder(new: Any, old: Any) -> bool:
    return Path(new).expanduser().resolve() == Path(old).expanduser().resolve()


def _moved(dotted: str, new: Any, old: Any) -> bool:
    """A saved absolute folder that no longer exists (the project moved), given anew as `new`."""
    return (dotted in PATH_KEYS and bool(new and old) and Path(old).is_absolute() and not Path(old).exists()
            and not _same_folder(new, old))


def same_source(dotted: str, new: Any, old: Any) -> bool:
    """Whether model.path / data.path `new` stands for the checkpoint's `old`: one folder spelled two
    ways ("./data", "data", absolute; a relative `old` is read from here, as the run that saved it
    read it), or a moved one given anew (_moved)."""
    return dotted in PATH_KEYS and bool(new and old) and (_same_folder(new, old) or _moved(dotted, new, old))


def run_mismatches(resolved: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """The run keys (RUN_SECTIONS) whose value in `resolved` differs from the checkpoint's `saved`,
    less those a resumed run may change (RESUMABLE_CHANGES): the rule resume_config
    applies to what a command gives, for a config built any other way (meshtune.api.finetune).

    A key the checkpoint lacks was written by a meshtune without it: that run had its default. The
    model and data paths compare as folders (same_source)."""
    defaults = Config().to_dict()
    changed = []
    for section in RUN_SECTIONS:
        old = {**defaults[section], **saved.get(section, {})}
        changed += [f"{section}.{k}" for k in sorted(set(resolved[section]) | set(old))
                    if resolved[section].get(k) != old.get(k) and f"{section}.{k}" not in RESUMABLE_CHANGES
                    and not same_source(f"{section}.{k}", resolved[section].get(k), old.get(k))]
    return changed


# Compared across ranks at start (settings_digests): what every rank must run alike. The folders are left
# out: hosts may keep the model, the data and adapters to start from in different places.
SAME_ON_EVERY_RANK = RUN_SECTIONS + ("parallel",)
HOST_KEYS = ("model.path", "data.path", "adapter.init_from")


def settings_digests(resolved: dict[str, Any]) -> dict[str, int]:
    """A 31-bit digest of each setting every rank must share, by dotted key (runtime/mesh.Mesh.disagreeing)."""
    return {f"{section}.{key}": zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode()) & 0x7FFFFFFF
            for section in SAME_ON_EVERY_RANK for key, value in resolved[section].items()
            if f"{section}.{key}" not in HOST_KEYS}


def _shown(value: Any) -> str:
    """A value as a flag takes it: 1, 1f1b, [2, 2], null, true."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def _drop_hint(dotted: str, where: str, spelled: dict[str, str]) -> str:
    """How to take back a setting the user gave: the flag as typed, or the file line that set it."""
    if dotted in spelled:
        return f"drop {spelled[dotted]}"
    if where == "command line":
        return f"drop --{dotted}"
    return f"remove {dotted} from {where.rpartition(':')[0] or where}"


def resume_config(given: Config, saved: dict[str, Any], source: str,
                  spelled: dict[str, str] | None = None) -> Config:
    """The config of a resumed run: the checkpoint's, with what this command gave on top.

    Every section starts from the checkpoint; ``output.adapter_path``, ``output.resume``
    and ``output.overwrite`` are this launch's. A setting the user gave (in a file or
    as a flag; ``given.origins``) overrides the checkpoint's in the output, parallel and
    runtime sections (a changed parallel layout is one note); in the run sections it must
    equal the checkpoint's, except ``train.iters``, and each one that differs is a line of
    the ConfigError naming the key, both values and the fix (the flag as ``spelled``
    maps it: dotted key -> flag as typed). A key the checkpoint lacks (written by a
    meshtune without it) takes its default, as that run did.
    """
    spelled = spelled or {}
    ours = given.to_dict()
    defaults = Config().to_dict()
    had: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        old = saved.get(section) if isinstance(saved.get(section), dict) else {}
        had[section] = {k: old.get(k, defaults[section][k]) for k in field_types(section)}
    merged = copy.deepcopy(had)
    for dotted in LAUNCH_KEYS:
        section, _, key = dotted.partition(".")
        merged[section][key] = ours[section][key]
    problems, moved = [], []
    for dotted, where in given.origins.items():
        section, _, key = dotted.partition(".")
        new, old = ours[section][key], had[section][key]
        if section not in RUN_SECTIONS or dotted in RESUMABLE_CHANGES:
            merged[section][key] = new
        elif _moved(dotted, new, old):
            merged[section][key] = new
            moved.append(f"{dotted}: the checkpoint's {old} no longer exists; using {new}")
        elif new != old and not same_source(dotted, new, old):
            problems.append(f"{where}: --resume: {dotted} = {new!r} differs from the checkpoint's {old!r} "
                            f"({source}); {_drop_hint(dotted, where, spelled)} to resume with the run's own "
                            "settings, or start a new run in another --adapter-path")
    if problems:
        raise ConfigError(problems)
    parallel = merged["parallel"]
    if {"parallel.pp", "parallel.pipeline_stages"} & set(given.origins):
        # Two names for one number, consistent in what was given (ParallelConfig.__post_init__).
        parallel["pp"], parallel["pipeline_stages"] = ours["parallel"]["pp"], ours["parallel"]["pipeline_stages"]
    if parallel["pp"] != had["parallel"]["pp"] and "parallel.stage_layers" not in given.origins:
        parallel["stage_layers"] = None  # one count per stage of the run's pp: split the new stages evenly
    changed = [f"parallel.{k} {_shown(v)} (the run had {_shown(had['parallel'][k])})"
               for k, v in parallel.items() if v != had["parallel"][k]]
    cfg = Config.from_built(build(merged, source))
    cfg.mapped, cfg.notes = list(given.mapped), list(given.notes)
    if changed:
        cfg.notes.append(f"resuming with {', '.join(changed)}")
    cfg.notes += moved
    cfg.origins = {**{f"{s}.{k}": source for s in SECTIONS for k in field_types(s)
                      if f"{s}.{k}" not in LAUNCH_KEYS}, **given.origins}
    return cfg
