"""Splits read through the datasets library: a save_to_disk folder, parquet files or a hub dataset id.

Each source becomes a mapping of split name -> ``datasets.Dataset``: ``load_from_disk`` of a
folder (a DatasetDict, or one Dataset, which is the train split); the parquet files of a folder,
their split named by the file (``train.parquet``, the hub's ``data/train-00000-of-00001.parquet``)
or its folder (``train/0000.parquet``); or ``datasets.load_dataset(id)`` for a hub id (as
``mlx_lm.lora --data org/name`` does; offline it reads the HF cache). Which split plays train,
valid and test is data.train_split / valid_split / test_split, in the library's slicing syntax
(``train[:80%]``); unset, train, valid (else validation) and test. Rows are checked and
tokenized exactly as jsonl lines (formats.py), an error naming ``<path or id>[split] row N``
(row N is ``dataset[split][N]``), and cached under a digest of the rows' Arrow buffers.
The library is an optional extra: without it, one line says ``pip install 'meshtune[datasets]'``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .dataset import TokenizedDataset
from .formats import Features, Source, options_key, tokenize_rows, warn_rows
from .token_cache import cached_split

INSTALL = "pip install 'meshtune[datasets]'"
DEFAULTS = {"train": ("train",), "valid": ("valid", "validation"), "test": ("test",)}
FLAGS = {"train": "--data.train_split", "valid": "--data.valid_split", "test": "--data.test_split"}


def library(source: str) -> Any:
    """The datasets module, or a one-line error saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.path={source}: reading a Hugging Face dataset or parquet files needs the "
                         f"datasets library; {INSTALL}") from None
    return datasets


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` holds a dataset written by ``save_to_disk``."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _split_of(path: Path, folder: Path) -> Optional[str]:
    """The split a parquet file belongs to: its name before any ``-`` shard suffix, else its folder's name."""
    names = {n for ns in DEFAULTS.values() for n in ns}
    stem = path.name[: -len(".parquet")].split("-")[0]
    if stem in names:
        return stem
    parent = path.parent.name
    return parent if parent in names and path.parent != folder else None


def parquet_splits(folder: Path) -> Dict[str, List[str]]:
    """Split name -> its parquet files (sorted) under `folder`."""
    found: Dict[str, List[str]] = {}
    for path in sorted(folder.rglob("*.parquet")):
        split = _split_of(path, folder)
        if split is not None:
            found.setdefault(split, []).append(str(path))
    return found


def open_source(source: str) -> Dict[str, Any]:
    """Split name -> ``datasets.Dataset`` of a saved folder, a parquet folder or a hub id."""
    datasets = library(source)
    folder = Path(source).expanduser()
    if folder.is_dir() and is_saved_dataset(folder):
        loaded = datasets.load_from_disk(str(folder))
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if folder.is_file() and folder.suffix == ".parquet":  # one file: the train split (sources.is_parquet_file)
        import pyarrow.parquet as pq

        return {"train": datasets.Dataset(pq.read_table(str(folder)))}
    if folder.is_dir():
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Read straight into memory: load_dataset("parquet") would copy every file into the HF cache first.
        return {split: datasets.Dataset(pa.concat_tables([pq.read_table(f) for f in files]))
                for split, files in parquet_splits(folder).items()}
    try:
        loaded = datasets.load_dataset(source)
    except Exception as err:  # hub, network and cache errors come in many types; the user needs one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"data.path={source}: no such folder, and no hub dataset of that id could be loaded "
                         f"({type(err).__name__}: {first[:200]}); point --data at a folder of train.jsonl and "
                         "valid.jsonl or parquet files, a save_to_disk folder, or a hub id with network access "
                         "or a filled HF cache") from None
    return dict(loaded)


def pick(source: str, splits: Dict[str, Any], role: str, spec: str, way_out: str = "") -> tuple[str, Any]:
    """(spec, dataset) of the split playing `role`, sliced as data.<role>_split says; `way_out`:
    how the caller does without the split, offered when there is none."""
    datasets = library(source)
    if not spec:
        spec = next((n for n in DEFAULTS[role] if n in splits), "")
        if not spec:
            raise ValueError(f"data.path={source}: no {' or '.join(DEFAULTS[role])} split (it has "
                             f"{', '.join(sorted(splits)) or 'none'}); choose one with {FLAGS[role]} NAME "
                             f"(slices like train[-10%:] work){f' or {way_out}' if way_out else ''}")
    try:
        parts = datasets.ReadInstruction.from_spec(spec).to_absolute({k: len(v) for k, v in splits.items()})
    except (ValueError, KeyError, AssertionError) as err:
        raise ValueError(f"data.{role}_split={spec!r}: {' '.join(str(err).split())[:160]}; give a split of "
                         f"{', '.join(sorted(splits))}, optionally sliced like train[:80%] ({FLAGS[role]})") from None
    chosen = [splits[p.splitname].select(range(p.from_, p.to)) if (p.from_, p.to) != (0, len(splits[p.splitname]))
              else splits[p.splitname] for p in parts]
    return spec, chosen[0] if len(chosen) == 1 else datasets.concatenate_datasets(chosen)


def _digest(ds: Any) -> Callable[[Any], None]:
    """Feeds a hash everything the split's rows are made of: schema, Arrow buffers, selected indices."""
    def feed(h: Any) -> None:
        h.update(str(ds.features).encode())
        for table in (ds.data, getattr(ds, "_indices", None)):
            if table is None:
                h.update(b"\0no-indices")
                continue
            for column in table.table.columns:
                for chunk in column.chunks:
                    h.update(f"{chunk.offset},{len(chunk)};".encode())
                    for buf in chunk.buffers():
                        h.update(b"-" if buf is None else hashlib.sha256(buf).digest())
    return feed


def _as_written(row: dict) -> dict:
    """A row as its jsonl line would read: Arrow gives every message of a list each key any of them has,
    None where it had none; a chat template must not see those keys."""
    return {k: [{mk: mv for mk, mv in m.items() if mv is not None} if isinstance(m, dict) else m for m in v]
            if isinstance(v, list) else v for k, v in row.items()}


def load_split(source: str, role: str, spec: str, ds: Any, tokenizer: Any, *, mask_prompt: bool,
               features: Features, max_length: Optional[int], max_seq_length: Optional[int], skip_empty: bool,
               warn: Optional[Callable[[str], None]]) -> TokenizedDataset:
    """One split checked and tokenized (or read back from the token cache), named after its role."""
    label = f"{source}[{spec}]"
    where = Source(label, "row", "split", lambda n: f"{label} row {n}")
    cut, options = options_key(mask_prompt, features, max_length, max_seq_length, skip_empty)
    rows = ((n, _as_written(row)) for n, row in enumerate(ds))
    data = cached_split(None, tokenizer, options, lambda: tokenize_rows(
        rows, tokenizer, name=role, path=None, source=where, mask_prompt=mask_prompt, features=features,
        max_length=max_length, max_seq_length=cut, skip_empty=skip_empty), content=_digest(ds), name=role)
    warn_rows(data, where, warn)
    return data


def load_roles(source: str, tokenizer: Any, needed: Dict[str, bool], specs: Dict[str, str],
               ways_out: Dict[str, str], **options: Any) -> Dict[str, TokenizedDataset]:
    """The needed roles' splits of `source`; every split is found before any is tokenized.
    `ways_out`: how the caller does without a role's split (sources.load_datasets)."""
    splits = open_source(source)
    chosen = {role: pick(source, splits, role, specs.get(role, ""), ways_out.get(role, ""))
              for role, need in needed.items() if need}
    return {role: load_split(source, role, spec, ds, tokenizer, **options) for role, (spec, ds) in chosen.items()}
