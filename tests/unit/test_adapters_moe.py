"""Adapters on whole models: a tiny mixture-of-experts (qwen3_moe) and Llama, LoRA and DoRA.

Covers all six base types in place (Linear, Embedding and SwitchLinear, float and
4-bit): save -> load identity through apply.py's layout, fuse, what stock mlx-lm
loads, and DoRA training through the experts' gather kernels. Tolerances: whole-model
logits (O(1) to O(10)) agree to 1e-3 after a dense fuse and to 1e-4 against stock.
"""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from meshtune.adapters import (DoRAEmbedding, DoRALinear, DoRASwitchLinear, LoRASwitchLinear, apply_adapters,
                               fuse_adapters, load_adapters, mlx_lm_adapter_config, trainable_parameters)
from meshtune.training.checkpoint import atomic_save_safetensors
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.data_parallel_step import build_step
from meshtune.training.model_loss import loss_terms

EXPERT_KEYS = ["mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj"]
ALL_KEYS = ["self_attn.q_proj", "mlp.gate", *EXPERT_KEYS, "model.embed_tokens"]
TOKENS = mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]])


def tiny_moe(layers: int = 2, experts: int = 4, quantize: bool = False, seed: int = 0) -> nn.Module:
    """A small random Qwen3-MoE from mlx-lm's own model code (tied embeddings)."""
    from mlx_lm.models import qwen3_moe

    mx.random.seed(seed)
    args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=layers,
                               intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1,
                               mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-5,
                               vocab_size=64, head_dim=8, rope_theta=10000.0, tie_word_embeddings=True,
                               max_position_embeddings=128, norm_topk_prob=True)
    model = qwen3_moe.Model(args)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


class _Adapter:
    def __init__(self, fine_tune_type, keys, num_layers=-1):
        self.fine_tune_type, self.keys, self.num_layers = fine_tune_type, keys, num_layers
        self.rank, self.scale, self.dropout = 4, 10.0, 0.0


def _randomize(model):
    mx.random.seed(7)
    for _, m in model.named_modules():
        if "lora_b" in m:
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
        if "m" in m:
            m.m = m.m * (1 + 0.1 * mx.random.uniform(shape=m.m.shape))


def _train_and_save(model, tmp_path, fine_tune_type, keys):
    apply_adapters(model, fine_tune_type=fine_tune_type, num_layers=-1, keys=keys, rank=4, scale=10.0, dropout=0.0)
    _randomize(model)
    atomic_save_safetensors(tmp_path / "adapters.safetensors", trainable_parameters(model))
    config = mlx_lm_adapter_config(_Adapter(fine_tune_type, keys), model_path="x", data_path="y", model=model)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    return model


def test_keys_none_adapts_every_layer_type_in_the_blocks():
    model = tiny_moe()
    n = apply_adapters(model, fine_tune_type="dora", num_layers=1, keys=None, rank=4, scale=10.0, dropout=0.0)
    assert n == 8  # q, k, v, o, router gate, and the experts' gate, up, down in the last block
    block = model.layers[1]
    assert isinstance(block.mlp.switch_mlp.up_proj, DoRASwitchLinear)
    assert isinstance(block.mlp.gate, DoRALinear)
    assert block.mlp.switch_mlp.up_proj.m.shape == (4, 32)  # one magnitude per expert and output row
    assert not any(k.startswith("model.layers.0.") for k in trainable_parameters(model))


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("fine_tune_type", ["lora", "dora"])
def test_save_load_identity_and_fuse(tmp_path, fine_tune_type, quantize):
    trained = _train_and_save(tiny_moe(quantize=quantize), tmp_path, fine_tune_type, ALL_KEYS)
    want = trained(TOKENS)
    fresh = load_adapters(tiny_moe(quantize=quantize), tmp_path)
    assert mx.array_equal(fresh(TOKENS), want)
    assert fuse_adapters(fresh, dequantize=True) == 2 * 5 + 1
    assert type(fresh.layers[0].mlp.switch_mlp.gate_proj) is SwitchLinear
    assert mx.allclose(fresh(TOKENS), want, atol=1e-3)
    if quantize:
        requant = load_adapters(tiny_moe(quantize=True), tmp_path)
        fuse_adapters(requant)
        assert isinstance(requant.layers[0].mlp.switch_mlp.down_proj, QuantizedSwitchLinear)
        assert isinstance(requant.model.embed_tokens, nn.QuantizedEmbedding)


def test_config_says_when_stock_cannot_load(tmp_path):
    from mlx_lm.tuner.utils import load_adapters as stock_load

    _train_and_save(tiny_moe(), tmp_path, "dora", ALL_KEYS)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["loadable_by_mlx_lm"] is False
    assert config["meshtune_layers"] == {f"model.layers.{i}.{k}": "DoRASwitchLinear"
                                         for i in range(2) for k in EXPERT_KEYS}
    with pytest.raises(ValueError, match="DoRA"):  # the flag tells the truth
        stock_load(tiny_moe(), str(tmp_path))

    q = tmp_path / "q"
    q.mkdir()
    _train_and_save(tiny_moe(quantize=True), q, "dora", ["self_attn.q_proj", "model.embed_tokens"])
    config = json.loads((q / "adapter_config.json").read_text())
    assert config["meshtune_layers"] == {"model.embed_tokens": "DoRAEmbedding"}

    lora = tmp_path / "lora"
    lora.mkdir()
    _train_and_save(tiny_moe(), lora, "lora", ALL_KEYS)
    config = json.loads((lora / "adapter_config.json").read_text())
    assert config["loadable_by_mlx_lm"] is True and "meshtune_layers" not in config


def test_load_checks_the_layers_only_meshtune_builds(tmp_path):
    _train_and_save(tiny_moe(), tmp_path, "dora", ALL_KEYS)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["lora_parameters"]["keys"] = ["self_attn.q_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    want = r"did not rebuild: model.layers.0.mlp.switch_mlp.down_proj \(DoRASwitchLinear\)"
    with pytest.raises(ValueError, match=want):
        load_adapters(tiny_moe(), tmp_path)


@pytest.mark.parametrize("quantize", [False, True])
def test_stock_mlx_lm_loads_our_switch_lora(tmp_path, quantize):
    from mlx_lm.tuner.utils import load_adapters as stock_load

    trained = _train_and_save(tiny_moe(quantize=quantize), tmp_path, "lora", None)
    assert isinstance(trained.layers[0].mlp.switch_mlp.up_proj, LoRASwitchLinear)
    stock = stock_load(tiny_moe(quantize=quantize), str(tmp_path))
    assert mx.allclose(stock(TOKENS), trained(TOKENS), atol=1e-4)


@pytest.mark.parametrize("quantize", [False, True])
def test_stock_mlx_lm_loads_our_linear_and_embedding_dora(model_factory, tmp_path, quantize):
    from mlx_lm.tuner.utils import load_adapters as stock_load

    def base():
        model = model_factory(layers=2)
        if quantize:
            nn.quantize(model, group_size=32, bits=4)
        return model

    # Stock's DoRAEmbedding cannot take a quantized table, so that case adapts the linears only.
    keys = None if quantize else ["self_attn.q_proj", "mlp.down_proj", "model.embed_tokens"]
    trained = _train_and_save(base(), tmp_path, "dora", keys)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["loadable_by_mlx_lm"] is True
    if not quantize:
        assert isinstance(trained.model.embed_tokens, DoRAEmbedding)  # tied: also the LM head
    stock = stock_load(base(), str(tmp_path))
    assert mx.allclose(stock(TOKENS), trained(TOKENS), atol=1e-4)


def _record_routing(model):
    """Each DoRASwitchLinear of `model` replaced by a copy (the same arrays and names) that records the experts it
    is routed to: path -> those experts."""
    routed: dict[str, set[int]] = {}

    class Recording(DoRASwitchLinear):
        def __call__(self, x, indices, sorted_indices=False):
            routed[self.path].update(int(i) for i in indices.flatten().tolist())
            return super().__call__(x, indices, sorted_indices)

    swaps = []
    for path, layer in model.named_modules():
        if isinstance(layer, DoRASwitchLinear):
            recording = copy.copy(layer)
            recording.__class__, recording.path, routed[path] = Recording, path, set()
            swaps.append((path, recording))
    model.update_modules(tree_unflatten(swaps))
    return routed


def _lengths(tokens):
    return mx.array([[0, tokens.shape[1]]] * tokens.shape[0], dtype=mx.int32)


@pytest.mark.parametrize("quantize", [False, True])
def test_dora_experts_get_gradients_where_routed(quantize):
    model = tiny_moe(experts=8, quantize=quantize)
    apply_adapters(model, fine_tune_type="dora", num_layers=-1, keys=EXPERT_KEYS, rank=4, scale=10.0, dropout=0.0)
    _randomize(model)  # B != 0 so lora_a has a gradient too
    routed = _record_routing(model)
    tokens = TOKENS[:1, :3]  # 3 tokens x top-2 of 8 experts: some experts stay idle

    def loss(model):
        ce, n = loss_terms(model, tokens, _lengths(tokens))
        return ce / n

    _, grads = nn.value_and_grad(model, loss)(model)
    grads = dict(tree_flatten(grads))
    idle = 0
    for path, layer in model.named_modules():
        if not isinstance(layer, DoRASwitchLinear):
            continue
        for e in range(8):
            for leaf in ("lora_a", "lora_b", "m"):
                g = mx.abs(grads[f"{path}.{leaf}"][e]).max().item()
                assert (g > 0) == (e in routed[path]), (path, e, leaf)
        idle += 8 - len(routed[path])
    assert idle > 0


@pytest.mark.parametrize("quantize", [False, True])
def test_compiled_sgd_on_moe_dora_reduces_loss(quantize):
    model = tiny_moe(quantize=quantize)
    apply_adapters(model, fine_tune_type="dora", num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
    opt = optim.SGD(learning_rate=0.05)
    opt.init(model.trainable_parameters())
    step = build_step(model, opt, Mesh.single(), max_grad_norm=0.0, compile=True)
    losses = []
    for _ in range(4):
        ce, n, _ = step.finish(TOKENS, _lengths(TOKENS), None, None)
        mx.eval(model.state, opt.state, ce, n)
        losses.append(ce.item() / n.item())
    assert losses[-1] < losses[0], losses
