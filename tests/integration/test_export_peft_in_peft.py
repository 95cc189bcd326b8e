"""`meshtune export --format peft` read by PEFT itself: transformers + PEFT give meshtune's logits.

Runs where torch, transformers and peft are installed (a GPU machine: torch on CUDA, MLX on its
CUDA build; skipped elsewhere). Each case trains a few steps at a large learning rate so the
adapters move the logits well past the tolerance, exports them, loads the base in transformers
with PeftModel.from_pretrained, and compares float32 logits with meshtune's own model on the same
tokens. tests/unit/test_export_peft.py checks the tensor mapping on any machine.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support import ARITH_DATA, TINY_MODEL, run_cli

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

TOKENS = [[1, 12, 40, 7, 88, 23, 5, 61, 19, 2, 33, 70, 14, 9, 50, 3]]
# (model, fine-tune type, extra train flags): the embedded Llama (tied head) and a random
# untied Qwen3 whose embedding and head are adapted too.
CASES = {
    "llama-lora": ("tiny-llama", "lora", []),
    "llama-dora": ("tiny-llama", "dora", []),
    "qwen3-lora-embedding": ("qwen3", "lora", ["--adapter.keys", "[self_attn.q_proj, self_attn.v_proj, "
                                                "mlp.down_proj, model.embed_tokens, lm_head]"]),
    "qwen3-dora": ("qwen3", "dora", []),
}


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    import mlx.core as mx

    from meshtune.bench.models import Shape, write_model_folder

    shape = Shape(arch="qwen3", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)
    return write_model_folder(shape, mx.float32, tmp_path_factory.mktemp("qwen3") / "model")


def _meshtune_logits(model_path, run) -> np.ndarray:
    import mlx.core as mx

    from meshtune.inference import load_for_inference

    model, _ = load_for_inference(str(model_path), run)
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


def _peft_logits(model_path, peft_folder) -> tuple[np.ndarray, np.ndarray]:
    """(PEFT's logits, the base model's logits) on the GPU when torch has one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(device).eval()
    ids = torch.tensor(TOKENS, device=device)
    with torch.no_grad():
        plain = base(ids).logits.float().cpu().numpy()
        adapted = PeftModel.from_pretrained(base, str(peft_folder)).to(device).eval()
        return adapted(ids).logits.float().cpu().numpy(), plain


@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_the_exported_adapters_and_gives_meshtune_s_logits(case, qwen3_model, tmp_path):
    name, kind, flags = CASES[case]
    model_path = TINY_MODEL if name == "tiny-llama" else qwen3_model
    run, out = tmp_path / "run", tmp_path / "peft"
    proc = run_cli("train", "--model", str(model_path), "--data", str(ARITH_DATA), "--iters", "6",
                   "--fine-tune-type", kind, "--learning-rate", "3e-3", "--train.val_batches", "1",
                   "--adapter-path", str(run), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("export", "--format", "peft", "--model", str(model_path), "--adapter-path", str(run),
                   "--save-path", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "adapter_config.json").read_text())["use_dora"] == (kind == "dora")

    ours = _meshtune_logits(model_path, run)
    theirs, base = _peft_logits(model_path, out)
    error = np.abs(ours - theirs).max()
    moved = np.abs(ours - base).max()
    # The adapters move the logits far more than the two frameworks differ.
    assert moved > 100 * error, (moved, error)
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
