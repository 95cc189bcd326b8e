"""The PyTorch side of `meshtune bench torch`: what a PEFT user runs, built and stepped.

A transformers `Qwen3ForCausalLM` from a config of the bench's shape (random init, tied
embedding, SDPA attention, no KV cache in training), PEFT `LoraConfig` on the seven linear
layers of every block (`use_dora` for DoRA) or every parameter trainable for full
fine-tuning, `torch.optim.AdamW` (fused on CUDA), eager: no `torch.compile`. The step is
the plain loop: forward with `labels=input_ids` (transformers shifts them), backward,
optimizer step, gradients set to None. On CUDA each step waits for the one before it,
not for itself, as meshtune's overlapped loop does, so neither side waits on an idle queue.

Imported only after torch, transformers and peft were found importable (torch_peer.py).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch

# transformers' deprecation notes (PEFT calls an old name) are not the bench's output.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

# The linear layers of a Qwen3 block: what meshtune adapts with no adapter.keys.
BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TorchSide:
    """The torch side of a bench, on the device torch runs on: where MLX runs (CUDA when MLX is on a GPU,
    else the CPU, even where CUDA is present)."""

    def __init__(self, cuda: bool) -> None:
        if cuda and not torch.cuda.is_available():
            raise ValueError("MLX runs on a GPU but this torch has no CUDA; install a CUDA build of torch "
                             "(pip install torch) or run on the CPU with MLX's CPU build")
        self.device = torch.device("cuda" if cuda else "cpu")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        """Versions and the device torch runs on."""
        import peft
        import transformers

        where = f"cuda, {torch.cuda.get_device_name()}" if self.cuda else \
            f"cpu, {torch.get_num_threads()} threads"
        return f"torch {torch.__version__} ({where}), transformers {transformers.__version__}, peft {peft.__version__}"

    @staticmethod
    def versions() -> dict[str, str]:
        import peft
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}

    def build_model(self, shape: dict[str, int], dtype: str, seed: int) -> torch.nn.Module:
        """A random Qwen3ForCausalLM of `shape` (layers, hidden, intermediate, heads, kv_heads, vocab) in `dtype`."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                             intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
                             num_key_value_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
                             vocab_size=shape["vocab"], tie_word_embeddings=True, rms_norm_eps=1e-6,
                             rope_theta=1e6, max_position_embeddings=32768, use_cache=False,
                             attn_implementation="sdpa")
        torch.manual_seed(seed)
        with torch.device(self.device):  # initialised where it trains: no host copy of a 1.7B model
            model = Qwen3ForCausalLM._from_config(config, dtype=getattr(torch, dtype))
        return model

    @staticmethod
    def count(model: torch.nn.Module, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

    @staticmethod
    def adapt(model: torch.nn.Module, kind: str, rank: int, alpha: float) -> torch.nn.Module:
        """PEFT LoRA or DoRA on every block's linear layers, or (full) every parameter trainable."""
        if kind == "full":
            model.requires_grad_(True)
            return model
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=BLOCK_LINEARS,
                            use_dora=kind == "dora", bias="none")
        return get_peft_model(model, config)

    def step_runner(self, model: torch.nn.Module, lr: float, vocab: int, batch: int, seq: int,
                    seed: int) -> Callable[[], torch.Tensor]:
        """One training step on one fixed random batch per call; `run.finish()` waits for the last."""
        dev, cuda = self.device, self.cuda
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, **({"fused": True} if cuda else {}))
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(dev)
        model.train()
        previous: list[Any] = []

        def run() -> torch.Tensor:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:  # wait for the step before this one: the host queues this one meanwhile
                done = torch.cuda.Event()
                done.record()
                if previous:
                    previous.pop().synchronize()
                previous.append(done)
            return loss.detach()

        def finish() -> None:
            if cuda:
                torch.cuda.synchronize()
            previous.clear()

        run.finish = finish
        return run

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        """Peak bytes torch's CUDA allocator handed out since reset_peak; None on the CPU (not tracked)."""
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def release(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def matmul_tflops(self, n: int, dtype: str, seconds: float, trials: int = 3) -> float:
        """The best TFLOP/s of `trials` windows of back-to-back n x n @ n x n matmuls, each about `seconds` long."""
        dev = self.device
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dev, getattr(torch, dtype))
        b = torch.randn(n, n, generator=g).to(dev, getattr(torch, dtype))

        def window(k: int) -> float:
            if self.cuda:
                torch.cuda.synchronize()
            tic = time.perf_counter()
            for _ in range(k):
                torch.matmul(a, b)
            if self.cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - tic

        window(2)  # kernel choice and the first allocations
        k = max(1, int(seconds / max(window(1), 1e-6)))
        return max(2 * n ** 3 * k / window(k) / 1e12 for _ in range(trials))
