"""What ``--data`` (data.path) may name, and loading its train/valid/test splits from it.

A folder of ``train.jsonl``/``valid.jsonl``/``test.jsonl`` (formats.py); a folder written by
``datasets``' ``save_to_disk``, or a folder of parquet files, or a hub dataset id ``org/name``
(hf.py). A folder is read as jsonl unless it is a saved dataset or holds split-named parquet
files; a path that does not exist is a hub id only when it looks like one (one ``/``, not
starting with ``/``, ``.`` or ``~``), so a mistyped local path is reported as a missing folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from . import hf
from .dataset import Datasets
from .formats import EmptySplit, Features, load_split

FORMS = ("a folder holding train.jsonl and valid.jsonl (or train/valid .parquet files, or a dataset saved with "
         "save_to_disk), a .parquet file, or a hub dataset id like org/name")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(source: str) -> bool:
    """Whether `source`, not a local path, reads as a hub dataset id."""
    return bool(_HUB_ID.match(source)) and not Path(source).expanduser().exists()


def check_source(source: str, splits: dict[str, str] | None = None) -> None:
    """Raise a one-line error when `source` is neither a local folder nor a hub id, or is a jsonl
    folder given split slices (data.*_split), before the model loads."""
    path = Path(source).expanduser()
    if path.is_dir() and not (hf.is_saved_dataset(path) or hf.parquet_splits(path)):
        _no_split_specs(path, {k: v for k, v in (splits or {}).items() if v})
        _no_unnamed_parquet(path)
    if path.is_dir() or is_hub_id(source) or is_parquet_file(path):
        return
    what = "is a file, not a folder" if path.exists() else "no such folder"
    raise ValueError(f"data.path={source}: {what}; point --data at {FORMS}")


def is_parquet_file(path: Path) -> bool:
    """A single parquet file: read as the train split (valid and test sliced from it with data.*_split)."""
    return path.is_file() and path.suffix == ".parquet"


def _no_unnamed_parquet(folder: Path) -> None:
    """A folder read as jsonl that holds parquet files named for no split: say so before the model loads."""
    if (folder / "train.jsonl").exists():
        return
    files = sorted(p.name for p in folder.glob("*.parquet"))
    if files:
        raise ValueError(f"data.path={folder}: {', '.join(files[:3])} names no split and there is no train.jsonl; "
                         "name the files train.parquet and valid.parquet (or put them in train/ and valid/), or "
                         f"give one file as --data {folder / files[0]} and slice its splits with "
                         "--data.valid_split 'train[-10%:]'")


def _no_split_specs(folder: Path, specs: dict[str, str]) -> None:
    if specs:
        role = next(iter(specs))
        raise ValueError(f"data.{role}_split={specs[role]!r} applies to Hugging Face datasets and parquet files; "
                         f"{folder} is read as jsonl ({role}.jsonl), so unset --data.{role}_split")


def load_datasets(
    source: Any,
    tokenizer: Any,
    *,
    mask_prompt: bool = False,
    features: Features = Features(),
    need_train: bool = True,
    need_valid: bool = True,
    need_test: bool = False,
    max_length: Optional[int] = None,
    max_seq_length: Optional[int] = None,
    skip_empty: bool = False,
    warn: Optional[Callable[[str], None]] = None,
    splits: Optional[Dict[str, str]] = None,
    ways_out: Optional[Dict[str, str]] = None,
) -> Datasets:
    """The splits of any accepted source; splits not needed are None.

    `splits` maps train/valid/test to a split spec (data.*_split) for datasets-library sources.
    `ways_out` maps valid/test to how the caller does without that split (training:
    "turn off validation with --val-batches 0"), offered in the errors about it.
    The other options are formats.load_split's, for every split.
    """
    options = dict(mask_prompt=mask_prompt, features=features, max_length=max_length,
                   max_seq_length=max_seq_length, skip_empty=skip_empty, warn=warn)
    needed = {"train": need_train, "valid": need_valid, "test": need_test}
    specs = {k: v for k, v in (splits or {}).items() if v}
    text = str(source)
    folder = Path(text).expanduser()
    if (folder.is_dir() and (hf.is_saved_dataset(folder) or hf.parquet_splits(folder)) or is_hub_id(text)
            or is_parquet_file(folder)):
        loaded = hf.load_roles(text, tokenizer, needed, specs, ways_out or {}, **options)
        return Datasets(loaded.get("train"), loaded.get("valid"), loaded.get("test"))
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "folder not found"
        raise ValueError(f"{folder}: data {what}; point --data at {FORMS}")
    _no_split_specs(folder, specs)
    return load_jsonl_folder(folder, tokenizer, needed, ways_out or {}, **options)


def _required(folder: Path, name: str, hint: str) -> Path:
    path = folder / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(
            f"{path}: not found; create {name}.jsonl in {folder} with one JSON object "
            f"per line{hint}"
        )
    return path


def load_jsonl_folder(folder: Path, tokenizer: Any, needed: Dict[str, bool], ways_out: Dict[str, str],
                      **options: Any) -> Datasets:
    """Load ``train/valid/test.jsonl`` from a folder; splits not `needed` are left as None.

    `ways_out` and `options` (load_split's: mask_prompt, features, max_length, max_seq_length,
    skip_empty, warn) are load_datasets'; the same shape as hf.load_roles.
    """
    folder = Path(folder)
    hints = {n: f" (or {way})" for n, way in ways_out.items()}
    hints["train"] = " (or put train/valid .parquet files or a save_to_disk dataset there)"
    # Check every needed file before tokenizing anything, so a missing valid.jsonl
    # is reported before minutes are spent on train.jsonl.
    paths = {n: _required(folder, n, hints.get(n, "")) for n, need in needed.items() if need}
    loaded = {}
    for n, p in paths.items():
        try:
            loaded[n] = load_split(p, tokenizer, **options)
        except EmptySplit as err:
            if n == "train":
                raise
            way = f", or {ways_out[n]}" if n in ways_out else ""
            raise ValueError(f"{err.what}; add one JSON object per line{way}") from None
    return Datasets(loaded.get("train"), loaded.get("valid"), loaded.get("test"))
