"""Using trained adapters: load a model for inference, generate, fuse, and evaluate adapters on a split.

`load_model` is also the training run's loader (api.finetune): one line names what a model
folder lacks or why the load failed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.nn as nn

from . import adapters as ad
from .config import Config
from .config.schema import is_local_path
from .data import check_source
from .prompt_format import PromptChoice, prompt_tokens
from .runtime.mesh import Mesh
from .run_data import eval_batches, load_splits, split_names, tail_batch
from .run_dir import RunDir
from .training.evaluation import evaluate


def load_model(path: str, trust_remote_code: bool = False, return_config: bool = False,
               lazy: bool = False) -> tuple[Any, ...]:
    """Model and tokenizer (and with `return_config` its config.json) through mlx-lm's loader (local
    folder or hub id); a folder that lacks something, or a load that fails, is one line naming model.path.

    With `lazy` no weight is read yet: each is read from its file when first evaluated, so a
    pipeline stage that drops the others' blocks first reads only its own (parallel/pipeline/stage_cut.py)."""
    from mlx_lm.utils import load

    local = Path(path).expanduser()
    if is_local_path(path):
        _check_model_folder(path, local)
        path = str(local)
    try:
        return load(path, tokenizer_config={"trust_remote_code": trust_remote_code},
                    trust_remote_code=trust_remote_code, return_config=return_config, lazy=lazy)
    except Exception as err:  # hub and loader errors come in many types; the user needs one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model.path={path} could not be loaded ({first}); give a local mlx-lm model "
                         "folder, or a hub id with network access or a filled hub cache") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _check_model_folder(path: str, local: Path) -> None:
    """Name what a local model folder lacks before mlx-lm fails on it less clearly."""
    if not (local / "config.json").exists():
        raise ValueError(f"model.path={path}: no mlx-lm model folder there (config.json, *.safetensors, "
                         "tokenizer files); give such a folder or a hub id like mlx-community/Qwen3-0.6B-4bit")
    if not any(local.glob("*.safetensors")):
        raise ValueError(f"model.path={path}: no weights (*.safetensors) in the folder; convert the model "
                         "with mlx_lm.convert or point at a complete mlx-lm model folder")
    if not any((local / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"model.path={path}: no tokenizer ({', '.join(TOKENIZER_FILES)}) in the folder; "
                         "copy the tokenizer files of the base model there")


def check_save_path(save_path: str | Path, overwrite: bool, written: str = "the fused model") -> None:
    """A `save_path` that already holds files is refused unless `overwrite`; nothing in it is touched then."""
    target = Path(save_path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        what = "a file" if not target.is_dir() else "a folder that already holds files"
        raise ValueError(f"--save-path {save_path} is {what}; pass --overwrite to write {written} over it, "
                         "or choose another --save-path")


def fused_model(model_path: str, adapter_path: str | Path, *, dequantize: bool = False) -> tuple[Any, Any, dict, str]:
    """(model, tokenizer, config, what was fused in words): the base with the adapters merged in,
    requantized like the base unless `dequantize` (then config.json's quantization goes too)."""
    from mlx_lm.utils import dequantize_model

    model, tokenizer, config = load_model(model_path, return_config=True)
    ad.load_adapters(model, adapter_path, model_path)
    n = ad.fuse_adapters(model, dequantize=dequantize)
    kind = json.loads(RunDir(adapter_path).config.read_text()).get("fine_tune_type", "lora")
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    return model, tokenizer, config, "the fully fine-tuned weights" if kind == "full" else f"{n} adapter layers"


def fuse(model_path: str, adapter_path: str | Path, save_path: str | Path, *,
         dequantize: bool = False, overwrite: bool = False, log: Callable[[str], None] = print) -> Path:
    """Merge adapters into the base and save a model mlx-lm loads (requantized unless asked not to).

    A `save_path` that already holds files is refused unless `overwrite`; nothing in it is touched then.
    """
    from mlx_lm.utils import save

    check_save_path(save_path, overwrite)
    model, tokenizer, config, what = fused_model(model_path, adapter_path, dequantize=dequantize)
    save(Path(save_path), model_path, model, tokenizer, config, donate_model=False)
    log(f"fused {what} into {save_path}")
    return Path(save_path)


def load_for_inference(model_path: str, adapter_path: str | Path | None = None) -> tuple[nn.Module, Any]:
    """Base model (and adapters, if given) ready for generation."""
    model, tokenizer = load_model(model_path)
    if adapter_path:
        ad.load_adapters(model, adapter_path, model_path)
    model.eval()
    return model, tokenizer


def generate(model_path: str, prompt: str, *, adapter_path: str | Path | None = None,
             max_tokens: int = 64, chat: bool = True) -> str:
    """Greedy completion of `prompt` (through the chat template when the tokenizer has one)."""
    model, tokenizer = load_for_inference(model_path, adapter_path)
    return complete(model, tokenizer, prompt, max_tokens=max_tokens, chat=chat)


def complete(model: nn.Module, tokenizer: Any, prompt: str, *, max_tokens: int = 64, chat: bool = True) -> str:
    """Greedy completion with an already loaded model (through the chat template when `chat` and the
    tokenizer has one, with no system prompt)."""
    from mlx_lm.generate import generate as mlx_generate

    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    choice = PromptChoice(templated, None, "complete's chat flag")
    tokens = prompt_tokens(tokenizer, prompt, choice)
    return mlx_generate(model, tokenizer, prompt=tokens, max_tokens=max_tokens, verbose=False)


@dataclass(frozen=True)
class Sampling:
    """How each next token is picked, with mlx_lm.generate's flags and meanings (temp 0: greedy)."""

    temp: float = 0.0
    top_p: float = 1.0  # 1 keeps every token
    min_p: float = 0.0  # 0 keeps every token
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None

    def check(self) -> None:
        """One line naming the first flag out of its range."""
        if not self.temp >= 0:
            raise ValueError(f"--temp {self.temp}: give 0 (greedy) or more, e.g. --temp 0.7")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: give a value in (0, 1], e.g. --top-p 0.9 (1 keeps every token)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"--min-p {self.min_p}: give a value in [0, 1], e.g. --min-p 0.05 (0 keeps every token)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: give 0 (every token) or more, e.g. --top-k 40")

    def sampler(self, tokenizer: Any) -> Callable[[Any], Any]:
        """mlx-lm's sampler for these settings; seeds MLX's generator when a seed is given."""
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if self.seed is not None:
            mx.random.seed(self.seed)
        return make_sampler(self.temp, self.top_p, self.min_p, top_k=self.top_k)


def stream_completion(model: nn.Module, tokenizer: Any, prompt_tokens: list[int], *, max_tokens: int,
                      sampling: Sampling = Sampling(), write: Callable[[str], None] = lambda text: None) -> Any:
    """Generate from `prompt_tokens` through mlx-lm's stream_generate, handing each piece of text to `write`
    as it comes; the last GenerationResponse (its prompt and generation tokens/s, peak memory), or None
    when nothing was generated."""
    from mlx_lm.generate import stream_generate

    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}: give 1 or more")
    last = None
    for last in stream_generate(model, tokenizer, prompt_tokens, max_tokens=max_tokens,
                                sampler=sampling.sampler(tokenizer)):
        write(last.text)
    return last


def evaluate_adapters(cfg: Config, adapter_path: str | Path, *, split: str = "test", batches: int = -1,
                      log: Callable[[str], None] = print) -> tuple[float, int]:
    """(token-weighted loss, target tokens) of the adapters in `adapter_path` on cfg's data split `split`
    ("test" or "valid"), over `batches` batches (-1: all): mlx_lm.lora --test without --train."""
    data_path = str(cfg.resolved_data_path())
    check_source(data_path, split_names(cfg))  # before the model load
    model_path = str(cfg.resolved_model_path())
    model, tokenizer = load_for_inference(model_path, adapter_path)
    # No ways out: the split asked for is the whole job (--split and --batch-size are in the errors). Only that
    # split is read: the train split's tokenizing time and warnings are no part of scoring.
    data = load_splits(cfg, tokenizer, Mesh.single(), need_train=False, need_valid=split == "valid",
                       need_test=split == "test", ways_out={})
    scored = data.test if split == "test" else data.valid
    chosen = eval_batches(scored, cfg, Mesh.single(), batches, ways_out={})
    size = cfg.train.batch_size
    # Every example with --batches -1: the ones no full batch holds are scored as one smaller batch.
    tail = tail_batch(scored, cfg, len(chosen)) if batches < 0 else []
    loss, tokens = evaluate(model, chosen + tail, Mesh.single())
    examples = len(chosen) * size + sum(int(b.tokens.shape[0]) for b in tail)
    held = f"{examples} examples" if examples == len(scored) else f"{examples} of the split's {len(scored)} examples"
    where = (f"{len(chosen)} batch{'es' if len(chosen) != 1 else ''} of {size}"
             + (f" and 1 of {examples - len(chosen) * size}" if tail else ""))
    log(f"{split} loss {loss:.3f}, {split} ppl {math.exp(min(loss, 700.0)):.3f} ({tokens} tokens of {held} in "
        f"{where}; {data_path})")
    return loss, tokens
