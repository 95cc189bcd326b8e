"""What the planner knows about a model: its config.json and the headers of its safetensors files.

Nothing here loads a weight or imports MLX: a safetensors file opens with an 8-byte
little-endian header length and a JSON header naming every tensor's dtype and shape, so
the exact bytes of every tensor (quantized words, scales and biases included) are known
from a few kilobytes per file. A hub id is found in the Hugging Face cache when it was
downloaded before; otherwise the planner asks for a local folder.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")
# Block index in a tensor name: mlx-lm's `model.layers.3.`, GPT-2's `h.3.`, others' `blocks.3.`.
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
EMBEDDINGS = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
"""Names an input embedding's tensors carry, by model family."""


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class Linear:
    """A layer an adapter can wrap: a Linear, an expert stack (SwitchLinear) or an embedding."""

    name: str
    """Module path, e.g. model.layers.0.self_attn.q_proj."""
    in_dims: int
    out_dims: int
    experts: int = 1
    quantized: bool = False
    embedding: bool = False
    nbytes: int = 0
    """Bytes of its weight (quantized words plus scales and biases) and bias."""


@dataclass
class ModelFacts:
    """A model's shapes and tensors, read without loading it."""

    path: Path
    config: dict[str, Any]
    tensors: list[Tensor]
    layers: list[Linear] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = _linears(self.tensors, self.config)

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` config.json sets (a multimodal model's text_config too)."""
        text = self.config.get("text_config")
        for section in (self.config, text if isinstance(text, dict) else {}):
            for key in keys:
                if section.get(key) is not None:
                    return section[key]
        return default

    @property
    def num_blocks(self) -> int:
        declared = self.get("num_hidden_layers", "n_layer")
        return int(declared) if declared else 1 + max((b for t in self.tensors if (b := block_of(t.name)) is not None),
                                                      default=-1)

    @property
    def hidden(self) -> int:
        return int(self.get("hidden_size", "n_embd", "d_model"))

    @property
    def heads(self) -> int:
        return int(self.get("num_attention_heads", "n_head"))

    @property
    def kv_heads(self) -> int:
        return int(self.get("num_key_value_heads", default=self.heads))

    @property
    def head_dim(self) -> int:
        return int(self.get("head_dim", default=self.hidden // self.heads))

    @property
    def intermediate(self) -> int:
        return int(self.get("intermediate_size", "n_inner", default=4 * self.hidden))

    @property
    def vocab(self) -> int:
        return int(self.get("vocab_size"))

    @property
    def experts(self) -> int:
        """Routed experts per MoE block (0: a dense model)."""
        return int(self.get("num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)

    @property
    def experts_per_token(self) -> int:
        return int(self.get("num_experts_per_tok", "moe_top_k", default=2 if self.experts else 0))

    @property
    def moe_intermediate(self) -> int:
        return int(self.get("moe_intermediate_size", default=self.intermediate))

    @property
    def shared_intermediate(self) -> int:
        """Width of an always-on shared expert (0: none)."""
        size = self.get("shared_expert_intermediate_size", default=0) or 0
        shared = self.get("n_shared_experts", default=0) or 0
        return int(size or shared * self.moe_intermediate)

    @property
    def tied(self) -> bool:
        return bool(self.get("tie_word_embeddings", default=not any(t.name.endswith("lm_head.weight")
                                                                     for t in self.tensors)))

    @property
    def activation_dtype_bytes(self) -> int:
        """Bytes of one activation: the dtype of most float bytes (a quantized model's scales')."""
        weights: dict[str, int] = {}
        for t in self.tensors:
            if t.dtype in FLOAT_DTYPES:
                weights[t.dtype] = weights.get(t.dtype, 0) + t.nbytes
        return DTYPE_BYTES[max(weights, key=weights.__getitem__)] if weights else 4

    def weight_bytes(self) -> dict[str, int]:
        """Bytes by kind: "F32"/"BF16"/... for dense tensors, "q4" etc. for quantized words with scales/biases."""
        quantized = {n.rsplit(".", 1)[0] for n in (t.name for t in self.tensors) if n.endswith(".scales")}
        out: dict[str, int] = {}
        for t in self.tensors:
            owner = t.name.rsplit(".", 1)[0]
            if owner in quantized and t.name.rsplit(".", 1)[1] in ("weight", "scales", "biases"):
                kind = f"q{self._bits(owner)}"
            else:
                kind = t.dtype
            out[kind] = out.get(kind, 0) + t.nbytes
        return out

    def total_bytes(self) -> int:
        """Bytes of every tensor: the whole model's weights."""
        return sum(t.nbytes for t in self.tensors)

    def block_params(self) -> list[int]:
        """Parameters of each block as MLX counts them (quantized words count as stored)."""
        sizes = [0] * self.num_blocks
        for t in self.tensors:
            b = block_of(t.name)
            if b is not None and b < len(sizes):
                sizes[b] += t.nbytes // DTYPE_BYTES.get(t.dtype, 4)
        return sizes

    def _bits(self, owner: str) -> int:
        q = self.get("quantization", "quantization_config", default={}) or {}
        own = q.get(owner) if isinstance(q.get(owner), dict) else q
        return int(own.get("bits", 4))


def block_of(name: str) -> int | None:
    """The block index a tensor name belongs to, None outside the blocks."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def read_header(path: Path) -> list[Tensor]:
    """The tensors a safetensors file declares (reads the header only)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise ValueError(f"{path}: unreadable safetensors header ({err})") from None
    return [Tensor(name, spec["dtype"], tuple(spec["shape"])) for name, spec in header.items()
            if name != "__metadata__"]


def resolve_model_folder(model: str | Path) -> Path:
    """A local model folder: the path itself, or a hub id's snapshot in the Hugging Face cache."""
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    text = str(model)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not path.exists():
        hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface"))
                   / "hub").expanduser()
        snapshots = sorted((hub / f"models--{text.replace('/', '--')}" / "snapshots").glob("*/config.json"),
                           key=lambda p: p.stat().st_mtime)
        if snapshots and list(snapshots[-1].parent.glob("*.safetensors")):
            return snapshots[-1].parent
        raise ValueError(f"--model {text}: meshtune plan reads a local folder (config.json and *.safetensors) "
                         f"and this hub id is not in the Hugging Face cache; download it first "
                         f"(huggingface-cli download {text}) or pass --model /path/to/folder")
    raise ValueError(f"--model {text}: no config.json there; meshtune plan needs a local model folder "
                     "(or a filled Hugging Face cache snapshot path)")


def read_model(model: str | Path) -> ModelFacts:
    """config.json and every *.safetensors header of a local model folder (or cached hub id)."""
    folder = resolve_model_folder(model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as err:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON ({' '.join(str(err).split())})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files; meshtune plan reads their headers for the weights")
    tensors = [t for f in files for t in read_header(f)]
    facts = ModelFacts(folder, config, tensors)
    for key, value in (("hidden_size", facts.get("hidden_size", "n_embd", "d_model")),
                       ("num_attention_heads", facts.get("num_attention_heads", "n_head")),
                       ("vocab_size", facts.get("vocab_size"))):
        if value is None:
            raise ValueError(f"{folder / 'config.json'}: no {key}; meshtune plan needs it for the activations")
    return facts


def _linears(tensors: list[Tensor], config: dict[str, Any]) -> list[Linear]:
    """Every adaptable layer: a 2-D (or 3-D, experts) weight, quantized when it has scales."""
    by_name = {t.name: t for t in tensors}
    q = config.get("quantization") or config.get("quantization_config") or {}
    out = []
    for t in tensors:
        if not t.name.endswith(".weight") or len(t.shape) not in (2, 3):
            continue
        owner = t.name[: -len(".weight")]
        scales = by_name.get(owner + ".scales")
        rows, cols = t.shape[-2], t.shape[-1]
        nbytes = t.nbytes + sum(by_name[owner + s].nbytes for s in (".scales", ".biases", ".bias")
                                if owner + s in by_name)
        if scales is not None:
            own = q.get(owner) if isinstance(q.get(owner), dict) else q
            cols = scales.shape[-1] * int(own.get("group_size", 64))
        embedding = any(e in owner for e in EMBEDDINGS)
        out.append(Linear(owner, in_dims=rows if embedding else cols, out_dims=cols if embedding else rows,
                          experts=t.shape[0] if len(t.shape) == 3 else 1, quantized=scales is not None,
                          embedding=embedding, nbytes=nbytes))
    return out
