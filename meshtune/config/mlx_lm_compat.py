"""Read mlx-lm's flat ``lora_config.yaml`` keys as meshtune config settings.

mlx-lm keeps its options in one flat namespace (``learning_rate``, ``iters``,
``lora_parameters: {rank: ...}``); meshtune groups them into sections.  This
module holds the key-by-key correspondence, the keys that are accepted and
ignored or refused with a fix, and the ``mlx_lm.lora`` command-line flags, so
that ``meshtune.config`` can load an mlx-lm config file unchanged and say
which keys it mapped.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

#: Flat mlx-lm key -> meshtune dotted key, where both mean the same thing.
FLAT_KEYS: dict[str, str] = {
    "model": "model.path",
    "trust_remote_code": "model.trust_remote_code",
    "data": "data.path",
    "max_seq_length": "data.max_seq_length",
    "mask_prompt": "data.mask_prompt",
    "prompt_feature": "data.prompt_feature",
    "completion_feature": "data.completion_feature",
    "text_feature": "data.text_feature",
    "chat_feature": "data.chat_feature",
    "fine_tune_type": "adapter.fine_tune_type",
    "num_layers": "adapter.num_layers",
    "lora_layers": "adapter.num_layers",  # mlx-lm's older name of num_layers
    "optimizer": "optimizer.name",
    "learning_rate": "optimizer.learning_rate",
    "seed": "train.seed",
    "iters": "train.iters",
    "batch_size": "train.batch_size",
    "val_batches": "train.val_batches",
    "steps_per_report": "train.steps_per_report",
    "steps_per_eval": "train.steps_per_eval",
    "save_every": "train.save_every",
    "test": "train.test",
    "test_batches": "train.test_batches",
    "grad_checkpoint": "train.grad_checkpoint",
    "grad_accumulation_steps": "train.grad_accumulation_steps",
    "adapter_path": "output.adapter_path",
    "report_to": "output.report_to",
    "project_name": "output.project_name",
    "resume_adapter_file": "adapter.init_from",
}

#: mlx-lm keys holding a mapping whose entries map one by one.
NESTED_KEYS: dict[str, dict[str, str]] = {
    "lora_parameters": {
        "rank": "adapter.rank",
        "scale": "adapter.scale",
        "dropout": "adapter.dropout",
        "keys": "adapter.keys",
    },
    "lr_schedule": {
        "name": "schedule.name",
        "arguments": "schedule.arguments",
        "warmup": "schedule.warmup",
        "warmup_init": "schedule.warmup_init",
    },
}

#: mlx-lm keys with no meaning in meshtune: accepted, ignored, and noted.
IGNORED: dict[str, str] = {
    "clear_cache_threshold": "mlx-lm's allocator-cache threshold has no meshtune equivalent",
    "config": "it records which config file mlx-lm was started with",
}

#: mlx-lm's ``hf_dataset: {path, ...}`` entry -> meshtune dotted key (``name`` is its older spelling of path).
HF_DATASET_KEYS: dict[str, str] = {
    "path": "data.path",
    "name": "data.path",
    "train_split": "data.train_split",
    "valid_split": "data.valid_split",
    "test_split": "data.test_split",
    "prompt_feature": "data.prompt_feature",
    "completion_feature": "data.completion_feature",
    "text_feature": "data.text_feature",
    "chat_feature": "data.chat_feature",
}
#: The splits mlx-lm takes from an hf_dataset entry that names none.
HF_DATASET_SPLITS = {"train_split": "train[:80%]", "valid_split": "train[-10%:]"}

# Handled by hand below: their meaning depends on the value.
_SPECIAL = ("train", "training_mode", "optimizer_config", "hf_dataset", "use_dora", "wandb")

#: mlx_lm.lora command-line flag -> meshtune dotted key.
MLX_LM_FLAGS: dict[str, str] = {
    "--model": "model.path",
    "--data": "data.path",
    "--adapter-path": "output.adapter_path",
    "--iters": "train.iters",
    "--batch-size": "train.batch_size",
    "--fine-tune-type": "adapter.fine_tune_type",
    "--num-layers": "adapter.num_layers",
    "--lora-layers": "adapter.num_layers",  # mlx-lm's older name of --num-layers
    "--learning-rate": "optimizer.learning_rate",
    "--max-seq-length": "data.max_seq_length",
    "--steps-per-eval": "train.steps_per_eval",
    "--steps-per-report": "train.steps_per_report",
    "--save-every": "train.save_every",
    "--seed": "train.seed",
    "--val-batches": "train.val_batches",
    "--grad-accumulation-steps": "train.grad_accumulation_steps",
    "--grad-checkpoint": "train.grad_checkpoint",
    "--mask-prompt": "data.mask_prompt",
    "--optimizer": "optimizer.name",
    "--test": "train.test",
    "--test-batches": "train.test_batches",
    "--trust-remote-code": "model.trust_remote_code",
    "--report-to": "output.report_to",
    "--project-name": "output.project_name",
    "--resume-adapter-file": "adapter.init_from",
}

#: The flags of MLX_LM_FLAGS that take no value: present means true.
MLX_LM_SWITCHES: frozenset[str] = frozenset(
    {"--grad-checkpoint", "--mask-prompt", "--test", "--trust-remote-code"}
)


@dataclass
class FlatResult:
    """What reading mlx-lm keys produced: settings to make and lines to show."""

    assignments: list[tuple[str, Any, str]] = field(default_factory=list)
    """(dotted target, value, the key as the user spelled it)."""
    mapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def is_flat(key: str) -> bool:
    """Whether ``key`` is an mlx-lm top-level key this module handles."""
    return (
        key in FLAT_KEYS
        or key in NESTED_KEYS
        or key in IGNORED
        or key in _SPECIAL
    )


def flat_names() -> list[str]:
    """Every mlx-lm top-level key this module knows, for suggestions."""
    return [*FLAT_KEYS, *NESTED_KEYS, *IGNORED, *_SPECIAL]


def aliases_of(target: str) -> list[tuple[str, str | None]]:
    """The mlx-lm spellings of ``target``: (key, sub-key or None)."""
    found: list[tuple[str, str | None]] = [(k, None) for k, t in FLAT_KEYS.items() if t == target]
    for key, subs in NESTED_KEYS.items():
        found += [(key, sub) for sub, t in subs.items() if t == target]
    return found


def _kind(value: Any) -> str:
    return "a mapping" if isinstance(value, dict) else type(value).__name__


def map_flat(key: str, value: Any, loc: Callable[[str], str]) -> FlatResult:
    """Map one mlx-lm top-level key (not ``optimizer_config``).

    ``loc(path)`` gives the location prefix ("file.yaml:7") for a dotted
    path.  A ``null`` value means "mlx-lm default" there, so it sets nothing.
    """
    out = FlatResult()
    if value is None:
        return out
    if key in FLAT_KEYS:
        if key == "optimizer" and isinstance(value, str):
            value = value.lower()  # mlx-lm lower-cases the optimizer name
        out.assignments.append((FLAT_KEYS[key], value, key))
        out.mapped.append(f"{key} -> {FLAT_KEYS[key]}")
    elif key in NESTED_KEYS:
        subs = NESTED_KEYS[key]
        if not isinstance(value, dict):
            out.problems.append(
                f"{loc(key)}: {key} must be a mapping with keys {', '.join(subs)}, "
                f"got {_kind(value)}"
            )
            return out
        for sub, v in value.items():
            path = f"{key}.{sub}"
            if sub in subs:
                out.assignments.append((subs[sub], v, path))
                out.mapped.append(f"{path} -> {subs[sub]}")
            elif key == "lora_parameters" and sub == "alpha":
                out.problems.append(
                    f"{loc(path)}: {path} is not used: mlx-lm's LoRA config uses "
                    "'scale', not 'alpha'; set lora_parameters.scale (adapter.scale)"
                )
            else:
                close = difflib.get_close_matches(str(sub), list(subs), n=1)
                hint = f"; did you mean '{key}.{close[0]}'?" if close else f"; valid: {', '.join(subs)}"
                out.problems.append(f"{loc(path)}: unknown key '{path}'{hint}")
    elif key in IGNORED:
        out.notes.append(f"{key} ignored: {IGNORED[key]}")
    elif key == "train":
        if value is True:
            out.notes.append("train: true ignored: meshtune train always trains")
        elif value is False:
            out.problems.append(
                f"{loc(key)}: train: false (mlx-lm's test-only mode): meshtune train always trains; "
                "score trained adapters with meshtune eval --adapter-path RUN (--split test)"
            )
        else:
            out.problems.append(
                f"{loc(key)}: train must be true (mlx-lm style) or a mapping of train.* "
                f"keys, got {_kind(value)}"
            )
    elif key == "use_dora":  # older mlx-lm's switch, before fine_tune_type
        if value is True:
            out.assignments.append(("adapter.fine_tune_type", "dora", key))
            out.mapped.append("use_dora: true -> adapter.fine_tune_type dora")
        elif value is False:
            out.notes.append("use_dora: false ignored: LoRA is the default (adapter.fine_tune_type lora)")
        else:
            out.problems.append(f"{loc(key)}: use_dora must be true or false, got {_kind(value)}; "
                                "or give fine_tune_type: dora")
    elif key == "wandb":  # older mlx-lm's W&B project key, before report_to
        if not isinstance(value, str) or not value:
            out.problems.append(f"{loc(key)}: wandb names a W&B project, got {_kind(value)}; "
                                "or give report_to: wandb and project_name: NAME")
            return out
        out.assignments += [("output.report_to", "wandb", key), ("output.project_name", value, key)]
        out.mapped.append(f"wandb: {value} -> output.report_to wandb, output.project_name {value}")
    elif key == "hf_dataset":
        _map_hf_dataset(value, loc, out)
    elif key == "training_mode":
        if value == "normal":
            out.notes.append("training_mode: normal ignored: it is the only mode")
        else:
            out.problems.append(
                f"{loc(key)}: training_mode {value!r} is not supported: meshtune trains "
                "with the supervised (normal) objective only; remove the key"
            )
    return out


def _map_hf_dataset(value: Any, loc: Callable[[str], str], out: FlatResult) -> None:
    """mlx-lm's hub dataset entry: its path and splits (mlx-lm's default slices when it names none)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list):
        out.problems.append(f"{loc('hf_dataset')}: hf_dataset lists {len(value)} datasets; meshtune trains on "
                            "one: concatenate them into one dataset (save_to_disk) and give it as data")
        return
    if not isinstance(value, dict) or not ("path" in value or "name" in value):
        out.problems.append(f"{loc('hf_dataset')}: hf_dataset must be a mapping with a path "
                            f"(and optional {', '.join(k for k in HF_DATASET_KEYS if k not in ('path', 'name'))})")
        return
    source = Path(str(value.get("path") or value.get("name"))).expanduser()
    # mlx-lm's default slices are for a datasets-library source; a jsonl folder has its own splits.
    defaults = {} if source.is_dir() and any(source.glob("*.jsonl")) else HF_DATASET_SPLITS
    for sub, v in {**defaults, **value}.items():
        path = f"hf_dataset.{sub}"
        if sub == "config" and v:
            out.problems.append(f"{loc(path)}: {path} (load_dataset arguments) is not supported; save the "
                                "dataset with save_to_disk and give that folder as data")
        elif sub in HF_DATASET_KEYS:
            out.assignments.append((HF_DATASET_KEYS[sub], v, path))
            out.mapped.append(f"{path} -> {HF_DATASET_KEYS[sub]}")
        elif sub not in ("config", "mask_prompt"):
            close = difflib.get_close_matches(str(sub), list(HF_DATASET_KEYS), n=1)
            hint = f"; did you mean 'hf_dataset.{close[0]}'?" if close else f"; valid: {', '.join(HF_DATASET_KEYS)}"
            out.problems.append(f"{loc(path)}: unknown key '{path}'{hint}")


def map_optimizer_config(
    value: Any, optimizer: str, known: list[str], loc: Callable[[str], str]
) -> FlatResult:
    """Map mlx-lm's ``optimizer_config: {name: {...}}`` for the chosen optimizer.

    Like mlx-lm, only the entry of the optimizer in use counts; its
    ``weight_decay`` goes to optimizer.weight_decay and the rest to
    optimizer.options.
    """
    out = FlatResult()
    if value is None:
        return out
    if not isinstance(value, dict):
        out.problems.append(
            f"{loc('optimizer_config')}: optimizer_config must be a mapping of "
            f"optimizer name -> options, got {_kind(value)}"
        )
        return out
    for name, entry in value.items():
        path = f"optimizer_config.{name}"
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(known)}"
            out.problems.append(f"{loc(path)}: unknown optimizer '{path}'{hint}")
            continue
        if entry is None or entry == {}:
            continue
        if not isinstance(entry, dict):
            out.problems.append(f"{loc(path)}: {path} must be a mapping of options, got {_kind(entry)}")
            continue
        if name != optimizer:
            out.notes.append(f"{path} ignored: the optimizer is {optimizer}")
            continue
        options = dict(entry)
        if "weight_decay" in options:
            out.assignments.append(
                ("optimizer.weight_decay", options.pop("weight_decay"), f"{path}.weight_decay")
            )
            out.mapped.append(f"{path}.weight_decay -> optimizer.weight_decay")
        if options:
            out.assignments.append(("optimizer.options", options, path))
            out.mapped.append(f"{path} -> optimizer.options")
    return out
