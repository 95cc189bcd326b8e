"""A fully fine-tuned pipeline's model, written by its stages as a sharded mlx-lm model folder.

Beside the adapters file, full fine-tuning on a pipeline writes `<adapter_path>/model/`, the
trained model in mlx-lm's (and Hugging Face's) sharded layout: stage k's writer puts every
weight its stage holds into `model-<k+1>-of-<S>.safetensors` (a tied table only from the first
stage), and rank 0 writes `model.safetensors.index.json` and the base's config and tokenizer
files. No rank gathers another stage's weights; `mlx_lm.load`, `meshtune generate --model` and
`meshtune eval` read the folder as any model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from mlx.utils import tree_flatten

from ...training.checkpoint import atomic_save_safetensors, atomic_write_text
from .stage import PipelineStage

INDEX_FILE = "model.safetensors.index.json"
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def owner(name: str, stage: PipelineStage) -> int:
    """The stage that writes weight `name`: its block's, the first for the embedding, else the last."""
    found = _BLOCK.match(name)
    if found:
        block = int(found.group(1))
        return next(k for k, (start, end) in enumerate(stage.bounds) if start <= block < end)
    return 0 if name.startswith("model.embed_tokens.") else stage.stages - 1


def _local_folder(base: Path | str) -> Path:
    """The base model's folder: the path itself, or a hub id's snapshot in the cache (the run loaded it)."""
    if (Path(base) / "config.json").exists():
        return Path(base)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(base), local_files_only=True))


def write_stage_model(folder: Path, stage: PipelineStage, base: Path | str) -> None:
    """Write this stage's shard of the trained model into `folder` (each stage's writer), and the index
    and the base model's (a folder or a hub id) other files (rank 0)."""
    mesh = stage.mesh
    if mesh.dp_rank != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in tree_flatten(stage.model.parameters()) if owner(k, stage) == stage.stage}
    atomic_save_safetensors(folder / shard_name(stage.stage, stage.stages), own, metadata={"format": "mlx"})
    if not mesh.is_writer:
        return
    for stale in folder.glob("model-*-of-*.safetensors"):  # an earlier save's, with another stage count
        if not stale.name.endswith(f"-of-{stage.stages:05d}.safetensors"):
            stale.unlink()
    for f in _local_folder(base).iterdir():  # config.json, the tokenizer's files, generation settings
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copyfile(f, folder / f.name)
    weight_map = {k: shard_name(owner(k, stage), stage.stages) for k, _ in stage.all_weights}
    index = {"metadata": {"total_size": sum(n for _, n in stage.all_weights)},
             "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(folder / INDEX_FILE, json.dumps(index, indent=2))
