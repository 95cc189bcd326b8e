"""Models and adapters for `meshtune bench adapters`, built in code (no download).

A random Qwen3- or Llama-shaped model from mlx-lm's own model code stands in for a
real checkpoint: step time and decode speed depend on the shapes, not on the weights.
The 4-bit variant is the same seed's model through `nn.quantize` (what mlx-lm's
converter does), so the dense and 4-bit rows differ only in the base's storage.
Adapters go on either through stock mlx-lm (`linear_to_lora_layers`, as `mlx_lm.lora`
calls it) or through meshtune (`apply_adapters`), on the same layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from ..adapters import BasePath

GROUP_SIZE = 64
BITS = 4


@dataclass(frozen=True)
class Shape:
    """The transformer's dimensions."""

    arch: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """Parameter count of the dense model (untied head; norms left out, they are tiny)."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden

    def describe(self) -> str:
        return (f"{self.arch}-shaped random model: {self.layers} layers x {self.hidden} hidden, "
                f"intermediate {self.intermediate}, {self.heads} heads / {self.kv_heads} kv heads, "
                f"vocab {self.vocab}, {_count(self.params())} params")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# Shapes and run sizes per preset. tiny: seconds on a CPU (the test); small: a couple of
# minutes on two CPU cores; 1b: about 1B parameters, for a GPU.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256,
                 batch_size=2, seq_len=32, warmup=2, steps=5, gen_tokens=32),
    "small": dict(layers=4, hidden=512, intermediate=1536, heads=8, kv_heads=4, vocab=8192,
                  batch_size=2, seq_len=128, warmup=2, steps=5, gen_tokens=32),
    "1b": dict(layers=16, hidden=2048, intermediate=6144, heads=16, kv_heads=8, vocab=32000,
               batch_size=4, seq_len=1024, warmup=3, steps=10, gen_tokens=64),
}


def build_model(shape: Shape, dtype: mx.Dtype, *, quantized: bool, seed: int = 0) -> nn.Module:
    """A random model of `shape` in `dtype`; 4-bit (group 64, affine) when `quantized`."""
    mx.random.seed(seed)
    common = dict(hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, rms_norm_eps=1e-6, vocab_size=shape.vocab,
                  tie_word_embeddings=False)
    if shape.arch == "qwen3":
        from mlx_lm.models import qwen3

        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", max_position_embeddings=32768,
                                            head_dim=shape.head_dim, rope_theta=1e6, **common))
    elif shape.arch == "llama":
        from mlx_lm.models import llama

        model = llama.Model(llama.ModelArgs(model_type="llama", **common))
    else:
        raise ValueError(f"--arch {shape.arch!r} is not one of qwen3, llama")
    model.set_dtype(dtype)
    if quantized:
        nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(model.parameters())
    return model


def add_adapters(model: nn.Module, *, impl: str, kind: str, num_layers: int, rank: int,
                 scale: float, base_path: BasePath | None = None) -> None:
    """LoRA or DoRA on every linear layer of the last `num_layers` blocks, by stock or meshtune (its
    quantized bases multiplying through `base_path`; None: the model's own)."""
    if impl == "stock":
        from mlx_lm.tuner.utils import linear_to_lora_layers

        # mlx_lm.lora's order: freeze the whole model, then swap in adapter layers.
        model.freeze()
        linear_to_lora_layers(model, num_layers, {"rank": rank, "scale": scale, "dropout": 0.0},
                              use_dora=kind == "dora")
    else:
        from ..adapters import apply_adapters

        apply_adapters(model, fine_tune_type=kind, num_layers=num_layers, keys=None, rank=rank,
                       scale=scale, dropout=0.0, base_path=base_path)


def perturb_adapters(model: nn.Module, seed: int = 1) -> None:
    """Random lora_b and a perturbed m, so an adapter is not an identity at generation time.

    Modules are visited by name with one key each, so stock's and meshtune's layers
    (same names, same shapes) get the same values.
    """
    adapters = sorted(((n, m) for n, m in model.named_modules() if "lora_b" in m), key=lambda nm: nm[0])
    keys = mx.random.split(mx.random.key(seed), 2 * max(len(adapters), 1))
    for i, (_, module) in enumerate(adapters):
        kb, km = keys[2 * i], keys[2 * i + 1]
        b = module["lora_b"]
        module["lora_b"] = (1e-3 * mx.random.normal(b.shape, key=kb)).astype(b.dtype)
        if "m" in module:
            m = module["m"]
            module["m"] = m * (1 + 1e-2 * mx.random.normal(m.shape, key=km)).astype(m.dtype)
    mx.eval(model.parameters())


def write_model_folder(shape: Shape, dtype: mx.Dtype, folder: Path, quantized: bool = False) -> Path:
    """A random model of `shape` saved as an mlx-lm model folder (`meshtune train --model` loads it), with
    `quantized` its base in 4 bits (group 64) as mlx-lm's config records them.

    The tokenizer is the embedded tiny model's: its ids fit any preset's vocabulary.
    """
    import dataclasses
    import json
    import shutil

    from mlx.utils import tree_flatten

    model = build_model(shape, dtype, quantized=quantized)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    if quantized:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": BITS}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tiny = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder
