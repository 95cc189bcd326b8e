"""What the commands that use a finished run share: the run's base model, its adapter folder, no stray flags."""

from __future__ import annotations

from pathlib import Path

from ..run_dir import CONFIG_FILE, CheckpointDir, RunDir


def default_model() -> str:
    from ..config import Config

    return str(Config().resolved_model_path())


def check_adapter_folder(adapter_path: str) -> None:
    """A pipeline checkpoint given as adapters: one line pointing at its run."""
    if CheckpointDir(adapter_path).stage_manifests():
        raise ValueError(f"--adapter-path {adapter_path} is a pipeline checkpoint (one weights file per stage), "
                         f"which resumes but does not load as adapters; point it at the run "
                         f"({Path(adapter_path).parent.parent})")


def check_run_config(adapter_path: str, also: str = "") -> None:
    """A folder without the run's config given as a run: one line saying what to point at (`also`: what
    else the command takes)."""
    if not adapter_path or not RunDir(adapter_path).config.is_file():
        raise ValueError(f"--adapter-path {adapter_path}: no {CONFIG_FILE} there; point it at a run of "
                         f"meshtune train or mlx_lm.lora{also}")


def model_from_adapters(adapter_path: str, hint: str) -> str:
    """The base model recorded in adapter_config.json (as mlx-lm records it); `hint`: the command's other way.
    The caller has ruled out a pipeline checkpoint (check_adapter_folder)."""
    import json

    config = RunDir(adapter_path).config
    if not config.exists():
        raise ValueError(f"{config} not found; pass the --adapter-path of a trained run{hint}")
    model = json.loads(config.read_text()).get("model")
    if not model:
        raise ValueError(f"{config} records no base model; pass --model")
    return model


def no_extra(rest: list[str]) -> None:
    if rest:
        raise ValueError(f"unexpected arguments {' '.join(rest)}; see --help")
