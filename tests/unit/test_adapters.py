"""Adapter lifecycle properties on every layer type we support today."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from meshtune.adapters import (LoRAEmbedding, LoRALinear, apply_adapters, fuse_adapters, load_adapters,
                               mlx_lm_adapter_config, trainable_parameters)
from meshtune.training.checkpoint import atomic_save_safetensors


def _bases():
    mx.random.seed(1)
    lin = nn.Linear(64, 48, bias=True)
    emb = nn.Embedding(40, 64)
    mx.eval(lin.parameters(), emb.parameters())
    return {
        "linear": lin,
        "qlinear": nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4),
        "embedding": emb,
        "qembedding": nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4),
    }


def _wrap(kind, base, r=4):
    cls = LoRALinear if "linear" in kind else LoRAEmbedding
    return cls.from_base(base, r=r, scale=2.0)


def _input(kind):
    if "linear" in kind:
        return mx.random.normal((3, 5, 64))
    return mx.array([[1, 5, 39, 0], [2, 2, 7, 11]])


def _randomize_b(layer):
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1


@pytest.mark.parametrize("kind", ["linear", "qlinear", "embedding", "qembedding"])
def test_output_unchanged_at_step0(kind):
    base = _bases()[kind]
    x = _input(kind)
    assert mx.array_equal(_wrap(kind, base)(x), base(x))


@pytest.mark.parametrize("kind", ["linear", "qlinear", "embedding", "qembedding"])
def test_fused_equals_unfused(kind):
    base = _bases()[kind]
    layer = _wrap(kind, base)
    _randomize_b(layer)
    x = _input(kind)
    fused = layer.fuse(dequantize=True)
    assert mx.allclose(fused(x), layer(x), atol=1e-4)
    if kind.startswith("q"):
        requant = layer.fuse()
        assert type(requant) is type(base)
        assert (requant.bits, requant.group_size) == (base.bits, base.group_size)
        # Requantizing to 4 bits costs precision; the error stays at the quantization step scale.
        assert mx.abs(requant(x) - layer(x)).max().item() < 0.25


@pytest.mark.parametrize("kind", ["embedding", "qembedding"])
def test_tied_head_consistent_with_adapted_table(kind):
    layer = _wrap(kind, _bases()[kind])
    _randomize_b(layer)
    h = mx.random.normal((2, 64))
    table = layer.fuse(dequantize=True).weight
    assert mx.allclose(layer.as_linear(h), h @ table.T, atol=1e-4)


@pytest.mark.parametrize("kind", ["linear", "qlinear", "embedding", "qembedding"])
def test_trainable_count_formula(kind):
    base = _bases()[kind]
    layer = _wrap(kind, base, r=4)
    layer.freeze()
    layer.unfreeze(keys=["lora_a", "lora_b"])
    rows, cols = (48, 64) if "linear" in kind else (40, 64)
    n = sum(v.size for _, v in tree_flatten(layer.trainable_parameters()))
    assert n == 4 * (rows + cols)


def test_apply_targets_last_blocks_and_keys(model_factory):
    model = model_factory(layers=3)
    n = apply_adapters(model, fine_tune_type="lora", num_layers=2, keys=None, rank=4, scale=10.0, dropout=0.0)
    assert n == 2 * 7  # q, k, v, o, gate, up, down in each of the last 2 blocks
    names = set(trainable_parameters(model))
    assert not any(k.startswith("model.layers.0.") for k in names)
    assert "model.layers.2.self_attn.q_proj.lora_a" in names

    model = model_factory(layers=3)
    n = apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=["self_attn.q_proj", "model.embed_tokens"],
                       rank=4, scale=10.0, dropout=0.0)
    assert n == 4
    assert isinstance(model.model.embed_tokens, LoRAEmbedding)


def test_bad_key_names_nearest(model_factory):
    with pytest.raises(ValueError, match=r"did you mean 'self_attn.q_proj'"):
        apply_adapters(model_factory(), fine_tune_type="lora", num_layers=-1, keys=["self_attn.q_prj"],
                       rank=4, scale=1.0, dropout=0.0)
    with pytest.raises(ValueError, match=r"'lm_head' names no module of the model; this model ties its head to "
                                         r"'model.embed_tokens'"):
        apply_adapters(model_factory(tied=True), fine_tune_type="lora", num_layers=-1, keys=["lm_head"],
                       rank=4, scale=1.0, dropout=0.0)
    with pytest.raises(ValueError, match=r"'q_proj' names no module of the model; did you mean 'self_attn.q_proj'"):
        apply_adapters(model_factory(), fine_tune_type="lora", num_layers=-1, keys=["q_proj"],  # PEFT's spelling
                       rank=4, scale=1.0, dropout=0.0)


def test_more_layers_than_blocks_adapts_all(model_factory):
    kw = dict(fine_tune_type="lora", keys=None, rank=4, scale=1.0, dropout=0.0)
    assert apply_adapters(model_factory(), num_layers=5, **kw) == apply_adapters(model_factory(), num_layers=-1, **kw)


def test_full_on_a_quantized_base_is_refused_naming_the_layer_and_the_fix(model_factory):
    model = model_factory()
    nn.quantize(model, group_size=32, bits=4)
    with pytest.raises(ValueError, match=r"adapter.fine_tune_type=full: layer [\w.]+_proj \(QuantizedLinear\) "
                                         r"is quantized.*--fine-tune-type lora"):
        apply_adapters(model, fine_tune_type="full", num_layers=2, keys=None, rank=4, scale=1.0, dropout=0.0)


def test_full_refuses_any_packed_module_of_a_chosen_block(model_factory):
    """A block's quantized module of a type adapters do not take (an MLA's MultiLinear) would be unfrozen whole."""

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.scales = mx.zeros((4, 1), dtype=mx.uint32), mx.zeros((4, 1))

    model = model_factory(layers=2)
    model.model.layers[1].self_attn.embed_q = Packed()
    with pytest.raises(ValueError, match=r"layer self_attn.embed_q \(Packed\) is quantized"):
        apply_adapters(model, fine_tune_type="full", num_layers=1, keys=None, rank=4, scale=1.0, dropout=0.0)


def test_full_unfreezes_chosen_blocks(model_factory):
    model = model_factory(layers=3)
    apply_adapters(model, fine_tune_type="full", num_layers=1, keys=None, rank=4, scale=1.0, dropout=0.0)
    names = set(trainable_parameters(model))
    assert names and all(k.startswith("model.layers.2.") for k in names)
    # What mlx_lm.lora trains with --fine-tune-type full: the last blocks whole, their norms included.
    stock = model_factory(layers=3)
    stock.freeze()
    stock.model.layers[-1].unfreeze()
    assert names == set(trainable_parameters(stock)) and "model.layers.2.input_layernorm.weight" in names


class _A:
    fine_tune_type, num_layers, keys, rank, scale, dropout = "lora", 2, None, 4, 10.0, 0.0


def _trained(model_factory, tmp_path, quantize=False):
    model = model_factory(layers=2)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    apply_adapters(model, fine_tune_type="lora", num_layers=2, keys=None, rank=4, scale=10.0, dropout=0.0)
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            _randomize_b(module)
    atomic_save_safetensors(tmp_path / "adapters.safetensors", trainable_parameters(model))
    (tmp_path / "adapter_config.json").write_text(json.dumps(mlx_lm_adapter_config(_A(), model_path="x",
                                                                                    data_path="y")))
    return model


def test_stock_adapters_whose_keys_name_modules_the_model_lacks_load_as_stock_loads_them(model_factory, tmp_path):
    """mlx_lm.lora trains with such keys (they match nothing) and loads the result; so does meshtune."""
    trained = model_factory(layers=2)
    apply_adapters(trained, fine_tune_type="lora", num_layers=2, keys=["self_attn.q_proj"], rank=4, scale=10.0,
                   dropout=0.0)
    for module in trained.modules():
        if isinstance(module, LoRALinear):
            _randomize_b(module)
    atomic_save_safetensors(tmp_path / "adapters.safetensors", trainable_parameters(trained))
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {
        "rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "block_sparse_moe.switch_mlp.up_proj"]}}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    fresh = model_factory(layers=2)
    load_adapters(fresh, tmp_path)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    assert mx.array_equal(fresh(tokens), trained(tokens))


@pytest.mark.parametrize("quantize", [False, True])
def test_save_load_identity_and_fuse(model_factory, tmp_path, quantize):
    trained = _trained(model_factory, tmp_path, quantize)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    fresh = model_factory(layers=2)
    if quantize:
        nn.quantize(fresh, group_size=32, bits=4)
    load_adapters(fresh, tmp_path)
    assert mx.array_equal(fresh(tokens), trained(tokens))
    want = trained(tokens)
    assert fuse_adapters(fresh, dequantize=True) == 14
    assert mx.allclose(fresh(tokens), want, atol=1e-3)


def test_stock_mlx_lm_loads_our_adapters(model_factory, tmp_path):
    from mlx_lm.tuner.utils import load_adapters as stock_load

    trained = _trained(model_factory, tmp_path)
    stock = stock_load(model_factory(layers=2), str(tmp_path))
    tokens = mx.array([[3, 1, 4, 1, 5, 9]])
    assert mx.array_equal(stock(tokens), trained(tokens))


def test_load_rejects_mismatched_file(model_factory, tmp_path):
    _trained(model_factory, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 8
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match the model") as err:
        load_adapters(model_factory(layers=2), tmp_path, model_path="x")  # the base they name: no hint
    assert "trained on" not in str(err.value)
    with pytest.raises(ValueError, match="does not match the model.*; these adapters were trained on x: give "
                                         "--model x or drop --model"):  # _trained's adapter_config names model x
        load_adapters(model_factory(layers=2), tmp_path, model_path="/another/model")


def test_a_full_fine_tuning_file_without_the_norms_loads_as_stock_loads_it(model_factory, tmp_path):
    """A full run's file holding only the linear layers' weights (as one that trained no norms): the norms keep
    the base's values; an adapter file still must hold every tensor."""
    trained = model_factory(layers=2)
    apply_adapters(trained, fine_tune_type="full", num_layers=2, keys=None, rank=4, scale=1.0, dropout=0.0)
    weights = {k: v + 0.01 for k, v in trainable_parameters(trained).items() if "norm" not in k}
    atomic_save_safetensors(tmp_path / "adapters.safetensors", weights)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2,
                                                              "lora_parameters": None}))
    fresh = model_factory(layers=2)
    load_adapters(fresh, tmp_path)
    got = trainable_parameters(fresh)
    assert all(mx.array_equal(got[k], w).item() for k, w in weights.items())
    assert any("norm" in k for k in got) and all(mx.array_equal(got[k], v).item() for k, v in
                                                 trainable_parameters(trained).items() if "norm" in k)


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_inference_cache_follows_weight_changes(variant):
    from meshtune.adapters import DoRALinear

    cls = DoRALinear if variant == "dora" else LoRALinear
    layer = cls.from_base(_bases()["qlinear"], r=4, scale=2.0)
    _randomize_b(layer)
    x = _input("linear")
    layer.eval()
    first = layer(x)
    assert mx.array_equal(layer(x), first)
    _randomize_b(layer)  # a new lora_b array, as an optimizer update makes
    cached = layer(x)
    layer.train()
    assert mx.allclose(cached, layer(x), atol=1e-5)
    assert not mx.allclose(cached, first, atol=1e-3)


def test_dora_inference_on_4bit_base_folds_the_row_scale_into_the_quantized_base():
    from meshtune.adapters import BasePath, DoRALinear

    base = _bases()["qlinear"]
    layer = DoRALinear.from_base(base, r=4, scale=2.0)
    _randomize_b(layer)
    layer.m = layer.m * (1 + 0.1 * mx.random.normal(layer.m.shape))
    x = _input("linear")
    for path in ("quantized", "dequantized"):
        layer.base_path = BasePath(path)
        layer.train()
        want = layer(x)
        layer.eval()
        got = layer(x)
        folded = layer.__dict__["_scaled_base"][2]
        assert folded is not None and folded["weight"] is base["weight"]  # packed weight shared
        assert not mx.array_equal(folded["scales"], base["scales"])
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-3), path


def test_dora_base_row_norms_are_computed_when_the_base_is_set(tmp_path):
    """A lazy ||w_i||^2 closed over by the compiled step would be recomputed on every step: once the layer is
    built it is evaluated (its graph holds no operation), and left lazy only where asked (settle=False)."""
    from meshtune.adapters.dora import DoRALinear

    def operations(array) -> int:
        mx.export_to_dot(str(tmp_path / "graph.dot"), array)
        return (tmp_path / "graph.dot").read_text().count("->")

    assert operations(DoRALinear.from_base(nn.Linear(32, 16), r=4)._w_sq) == 0
    assert operations(DoRALinear.from_base(nn.Linear(32, 16), r=4, settle=False)._w_sq) > 0


def test_a_pipeline_checkpoint_given_as_adapters_points_at_its_run(tmp_path):
    from support import tiny_llama

    step = tmp_path / "run" / "checkpoints" / "0000004"
    step.mkdir(parents=True)
    (step / "state.stage0.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a pipeline checkpoint .* point --adapter-path at the run \(.*/run\)"):
        load_adapters(tiny_llama(), step)
