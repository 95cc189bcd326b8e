"""The fused model for tools outside MLX: a Hugging Face folder (dense weights, config.json without
MLX's quantization, the tokenizer), and GGUF for llama.cpp where mlx-lm converts the family."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

GGUF_FAMILIES = ("llama", "mistral", "mixtral")  # the model types mlx-lm's GGUF converter (mlx_lm/gguf.py) takes
GGUF_FILE = "ggml-model-f16.gguf"  # mlx_lm.fuse's default name


def export_hf(model_path: str, adapter_path: str | Path, save_path: str | Path, *, overwrite: bool = False,
              log: Callable[[str], None] = print) -> Path:
    """The fused, dequantized model as a Hugging Face folder (safetensors with the families' shared names)."""
    from mlx_lm.utils import save

    from ..inference import check_save_path, fused_model

    check_save_path(save_path, overwrite, "the exported model")
    model, tokenizer, config, what = fused_model(model_path, adapter_path, dequantize=True)
    save(Path(save_path), model_path, model, tokenizer, config, donate_model=False)
    log(f"exported the base with {what} fused, dequantized, as a Hugging Face folder into {save_path}")
    return Path(save_path)


def gguf_refusal(model_type: str) -> str | None:
    """The one line for a family mlx-lm cannot write as GGUF, or None."""
    if model_type in GGUF_FAMILIES:
        return None
    return (f"--format gguf: mlx-lm writes GGUF for {', '.join(GGUF_FAMILIES)} models only and this is a "
            f"{model_type} model; export --format hf and convert that folder with llama.cpp's convert_hf_to_gguf.py")


def export_gguf(model_path: str, adapter_path: str | Path, save_path: str | Path, *, overwrite: bool = False,
                log: Callable[[str], None] = print) -> Path:
    """The fused model as a Hugging Face folder with `ggml-model-f16.gguf` in it (mlx_lm.fuse --export-gguf)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.gguf import convert_to_gguf

    from mlx_lm.utils import save

    from ..inference import check_save_path, fused_model

    check_save_path(save_path, overwrite, "the exported model")
    model, tokenizer, config, what = fused_model(model_path, adapter_path, dequantize=True)
    refusal = gguf_refusal(str(config.get("model_type", "unknown")))
    if refusal:  # before anything is written
        raise ValueError(refusal)
    target = Path(save_path)
    save(target, model_path, model, tokenizer, config, donate_model=False)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    convert_to_gguf(target, weights, config, str(target / GGUF_FILE))
    log(f"exported the base with {what} fused as GGUF: {target / GGUF_FILE}")
    return target / GGUF_FILE
