"""Resuming from a run's own settings: the config a checkpoint saved, and flags checked against it.

`meshtune train --adapter-path runs/x --resume` needs no other flag: the run's
settings come from its newest checkpoint (`checkpoints/<step>/config.yaml`, or a
pipeline's `state.stage0.json`; the adapter folder's `adapter_config.json` holds the
same under "meshtune"). A setting given again must equal the checkpoint's, except
``train.iters``, which may extend the run; the output, parallel and runtime sections
describe this launch (where it writes, on how many ranks), so they are this
command's. File names follow meshtune.training.checkpoint, which this package cannot
import (it loads MLX; the CLI reads configs before choosing the BLAS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .build import build
from .fields import _field_types
from .schema import Config
from .sections import SECTIONS, ConfigError

#: Sections the checkpoint decides: what is trained, on what, and how.
RUN_SECTIONS = ("model", "data", "adapter", "optimizer", "schedule", "train")
#: Keys a resumed run may change: more steps extend it.
EXTENDABLE = ("train.iters",)


def saved_run_config(adapter_path: str | Path) -> tuple[dict[str, Any], str] | None:
    """(the resolved config a run saved, the file it came from), newest checkpoint first; None if none."""
    folder = Path(adapter_path)
    root = folder / "checkpoints"
    numbered = sorted((p for p in root.iterdir() if p.name.isdigit() and p.is_dir()),
                      key=lambda p: int(p.name), reverse=True) if root.is_dir() else []
    for path in numbered:
        try:
            if (path / "config.yaml").is_file():
                saved = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
                source = path / "config.yaml"
            elif (path / "state.stage0.json").is_file():
                saved = json.loads((path / "state.stage0.json").read_text(encoding="utf-8")).get("config")
                source = path / "state.stage0.json"
            else:
                continue
        except (OSError, ValueError, yaml.YAMLError):
            continue  # a damaged checkpoint; the resume itself says so and takes the one before
        if isinstance(saved, dict):
            return saved, str(source)
    try:
        saved = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("meshtune")
    except (OSError, ValueError):
        return None
    return (saved, str(folder / "adapter_config.json")) if isinstance(saved, dict) else None


def _same_folder(dotted: str, new: Any, old: Any) -> bool:
    """model.path / data.path spelled two ways for one folder ("./data" and "data")."""
    if dotted not in ("model.path", "data.path") or not (new and old):
        return False
    return Path(new).expanduser().resolve() == Path(old).expanduser().resolve()


def resume_config(given: Config, saved: dict[str, Any], source: str) -> Config:
    """The config of a resumed run: the checkpoint's run settings, this command's output/parallel/runtime.

    Every setting the user gave (in a file or as a flag; ``given.origins``) that differs
    from the checkpoint's is one line of the ConfigError, naming the key, both values and
    the fix; ``train.iters`` may differ. A key the checkpoint lacks (written by a meshtune
    without it) takes its default, as that run did.
    """
    ours = given.to_dict()
    defaults = Config().to_dict()
    merged: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        if section in RUN_SECTIONS:
            old = saved.get(section) if isinstance(saved.get(section), dict) else {}
            merged[section] = {k: old.get(k, defaults[section][k]) for k in _field_types(section)}
        else:
            merged[section] = dict(ours[section])
    problems = []
    for dotted, where in given.origins.items():
        section, _, key = dotted.partition(".")
        if section not in RUN_SECTIONS:
            continue
        new, old = ours[section][key], merged[section][key]
        if dotted in EXTENDABLE:
            merged[section][key] = new
        elif new != old and not _same_folder(dotted, new, old):
            problems.append(f"{where}: --resume: {dotted} = {new!r} differs from the checkpoint's {old!r} "
                            f"({source}); drop --{dotted} to resume with the run's own settings, "
                            "or start a new run in another --adapter-path")
    if problems:
        raise ConfigError(problems)
    cfg = Config.from_built(build(merged, source))
    cfg.mapped, cfg.notes = list(given.mapped), list(given.notes)
    cfg.origins = {**{f"{s}.{k}": source for s in RUN_SECTIONS for k in _field_types(s)}, **given.origins}
    return cfg
