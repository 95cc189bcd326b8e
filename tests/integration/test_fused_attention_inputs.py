"""On an NVIDIA GPU a run's batches give the model a multiple of 128 inputs (runtime/cuda.py: MLX
differentiates its fused attention only at such lengths), and the run learns exactly as it would
without the padding columns."""

from __future__ import annotations

import pytest

import meshtune.api as api
from meshtune.config import Config
from meshtune.runtime import cuda

BatchIterator = api.BatchIterator


def _run(tmp_path, monkeypatch, multiple, name):
    monkeypatch.setattr(api, "attention_inputs_multiple", lambda: multiple)
    widths: list[int] = []

    class Recorded(BatchIterator):
        def __next__(self):
            batch = super().__next__()
            widths.append(batch.tokens.shape[1])
            return batch

    monkeypatch.setattr(api, "BatchIterator", Recorded)
    # Rows cut to 24 tokens: every batch is 24 columns, 23 inputs, which 8 widens to 24.
    cfg = Config.from_dict({"train": {"iters": 3, "batch_size": 4, "val_batches": 1, "steps_per_report": 1,
                                      "steps_per_eval": 3}, "data": {"max_seq_length": 24},
                            "output": {"adapter_path": str(tmp_path / name)}})
    result = api.finetune(cfg, log=lambda _line: None, show_progress=False)
    return result, widths


def test_a_run_s_inputs_are_padded_to_the_multiple_and_its_losses_unchanged(tmp_path, monkeypatch):
    plain, plain_widths = _run(tmp_path, monkeypatch, None, "plain")
    padded, padded_widths = _run(tmp_path, monkeypatch, 8, "padded")
    assert len(padded_widths) == len(plain_widths) >= 4  # the validation split's batches and three training ones
    assert set(plain_widths) == {24} and set(padded_widths) == {25}
    assert padded.trained_tokens == plain.trained_tokens
    assert padded.train_loss == pytest.approx(plain.train_loss, rel=1e-5)
    assert padded.val_loss == pytest.approx(plain.val_loss, rel=1e-5)


def test_only_cuda_asks_for_the_multiple(monkeypatch):
    assert cuda.attention_inputs_multiple() is None  # the CPU this suite runs on
    monkeypatch.setattr(cuda, "on_cuda", lambda: True)
    assert cuda.attention_inputs_multiple() == cuda.FUSED_ATTENTION_MULTIPLE == 128
