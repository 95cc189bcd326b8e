"""On an NVIDIA GPU a run's training batches give the model a multiple of 128 inputs (runtime/cuda.py:
MLX differentiates its fused attention only at such lengths), evaluation batches keep mlx-lm's widths,
and the run learns exactly as it would without the padding columns."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import meshtune.api as api
import meshtune.run_data as run_data
from meshtune.adapters import apply_adapters
from meshtune.config import Config
from meshtune.runtime import cuda
from support import tiny_llama

BatchIterator = api.BatchIterator


def _run(tmp_path, monkeypatch, multiple, name):
    monkeypatch.setattr(api, "attention_inputs_multiple", lambda model: multiple)
    widths: dict[bool, list[int]] = {True: [], False: []}  # training (loop) and evaluation batches

    class Recorded(BatchIterator):
        def __next__(self):
            batch = super().__next__()
            widths[self.loop].append(batch.tokens.shape[1])
            return batch

    monkeypatch.setattr(api, "BatchIterator", Recorded)  # training batches
    monkeypatch.setattr(run_data, "BatchIterator", Recorded)  # evaluation batches
    # Rows cut to 24 tokens: every batch is 24 columns, 23 inputs, which 8 widens to 24.
    cfg = Config.from_dict({"train": {"iters": 3, "batch_size": 4, "val_batches": 1, "steps_per_report": 1,
                                      "steps_per_eval": 3}, "data": {"max_seq_length": 24},
                            "output": {"adapter_path": str(tmp_path / name)}})
    result = api.finetune(cfg, log=lambda _line: None, show_progress=False)
    return result, widths


def test_a_run_s_training_inputs_are_padded_to_the_multiple_and_its_losses_unchanged(tmp_path, monkeypatch):
    plain, plain_widths = _run(tmp_path, monkeypatch, None, "plain")
    padded, padded_widths = _run(tmp_path, monkeypatch, 8, "padded")
    assert len(padded_widths[True]) == len(plain_widths[True]) == 3
    assert set(plain_widths[True]) == {24} and set(padded_widths[True]) == {25}
    assert set(plain_widths[False]) == set(padded_widths[False]) == {24}  # evaluation: no backward to speed up
    assert padded.trained_tokens == plain.trained_tokens
    assert padded.train_loss == pytest.approx(plain.train_loss, rel=1e-5)
    assert padded.val_loss == pytest.approx(plain.val_loss, rel=1e-5)


def test_only_cuda_with_attention_cudnn_takes_asks_for_the_multiple():
    model = tiny_llama()  # head dim 8
    assert cuda.attention_inputs_multiple(model, nvidia=False) is None  # the CPU or Metal
    assert cuda.attention_inputs_multiple(model, nvidia=True) is None  # float32: cuDNN takes half precision only
    model.set_dtype(mx.bfloat16)
    assert cuda.attention_inputs_multiple(model, nvidia=False) is None
    assert cuda.attention_inputs_multiple(model, nvidia=True) == cuda.FUSED_ATTENTION_MULTIPLE == 128
    model.args.head_dim = 256  # as Gemma's: beyond cuDNN's 128
    assert cuda.attention_inputs_multiple(model, nvidia=True) is None


def test_float32_adapters_on_every_block_leave_a_bfloat16_model_s_attention_fused():
    """LoRA's float32 matrices on every block are more arrays than the bfloat16 weights they adapt (two
    per layer against one), not more elements: the activations stay bfloat16 and the inputs are still
    widened for cuDNN's attention backward. Counted by arrays, every block adapted gave None, and on an
    H100 16,384-token rows took the unfused backward: 3,935 tok/s and 62.2 GB against 20,088 and 18.9."""
    model = tiny_llama()
    model.set_dtype(mx.bfloat16)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=8, scale=20.0, dropout=0.0)
    dtypes = [v.dtype for _, v in tree_flatten(model.parameters())]
    assert dtypes.count(mx.float32) > dtypes.count(mx.bfloat16)  # the case: more float32 arrays
    assert cuda.activation_dtype(model) == mx.bfloat16
    assert cuda.attention_inputs_multiple(model, nvidia=True) == cuda.FUSED_ATTENTION_MULTIPLE
