"""`meshtune bench torch`'s accounting without PyTorch: useful FLOPs per kind, the parameters N they
are counted on, and which preset a machine gets."""

from __future__ import annotations

import argparse

import pytest

from meshtune.bench.fit import Machine
from meshtune.bench.torch_peer import PRESETS, SHAPE_KEYS, choose_preset, mlx_model, useful_flops
from mlx.utils import tree_flatten


def test_useful_flops_are_six_n_t_for_full_and_four_n_t_for_adapters():
    n, t = 1_720_000_000, 4 * 1024
    assert useful_flops("full", n, t) == 6 * n * t
    for kind in ("lora", "dora", "qlora"):
        assert useful_flops(kind, n, t) == 4 * n * t
    with pytest.raises(KeyError):
        useful_flops("prefix", n, t)


def _qwen3_params(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> int:
    """Qwen3 with a tied embedding: embedding once, per block 7 linears, 2 norms and q/k norms, a final norm."""
    head = hidden // heads
    attn = 2 * hidden * heads * head + 2 * hidden * kv_heads * head
    return vocab * hidden + layers * (attn + 3 * hidden * intermediate + 2 * hidden + 2 * head) + hidden


def test_the_1_7b_preset_is_qwen3_1_7b():
    shape = {k: PRESETS["1.7b"][k] for k in SHAPE_KEYS}
    # Qwen3-1.7B's model card: 1.7B parameters, 1.4B of them outside the embedding.
    assert _qwen3_params(**shape) == 1_720_574_976
    assert _qwen3_params(**shape) - shape["vocab"] * shape["hidden"] == pytest.approx(1.41e9, rel=0.01)
    assert (PRESETS["1.7b"]["batch_size"], PRESETS["1.7b"]["seq_len"]) == (4, 1024)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_n_is_the_tied_models_parameter_count(kind):
    a = argparse.Namespace(**PRESETS["tiny"], rank=8, scale=20.0, seed=0, dtype="float32")
    model = mlx_model(a, kind)
    base = sum(v.size for k, v in tree_flatten(model.parameters()) if "lora_" not in k)
    assert base == _qwen3_params(**{k: PRESETS["tiny"][k] for k in SHAPE_KEYS})
    assert "lm_head" not in model and model.args.tie_word_embeddings
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    assert (trainable == base) if kind == "full" else (0 < trainable < base)


def test_the_preset_is_1_7b_on_a_gpu_that_holds_it_and_tiny_otherwise(capsys):
    assert choose_preset(None, None, None, 2, Machine("GPU", "H200", 140 * 10**9))[0] == "1.7b"
    preset, line = choose_preset(None, None, None, 2, Machine("GPU", "small", 8 * 10**9))
    assert preset == "tiny" and "pass --preset 1.7b to force" in line
    preset, line = choose_preset(None, None, None, 4, Machine("CPU", "EPYC", 64 * 10**9))
    assert preset == "tiny" and "and a GPU" in line
    preset, line = choose_preset("1.7b", None, None, 4, Machine("CPU", "EPYC", 8 * 10**9))
    assert preset == "1.7b" and "--preset" in line and "may run out of memory" in capsys.readouterr().err
