"""Gradient buckets: how gradients are grouped (their sums are checked by the data-parallel tests)."""

from __future__ import annotations

from meshtune.parallel.gradient_sums import buckets


def test_buckets_fill_to_the_size_and_keep_order():
    assert buckets([10, 10, 10, 10, 10], bucket_bytes=80, itemsize=4) == [[0, 1], [2, 3], [4]]
    assert buckets([100, 1, 1], bucket_bytes=40, itemsize=4) == [[0], [1, 2]]
    assert buckets([], bucket_bytes=40, itemsize=4) == []


def test_every_index_lands_in_exactly_one_bucket():
    sizes = [3, 700, 1, 64, 64, 5, 9000, 2]
    groups = buckets(sizes, bucket_bytes=1024, itemsize=2)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))


def test_backward_order_puts_the_last_computed_gradients_last():
    from meshtune.parallel.gradient_sums import backward_order

    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.lora_a",
             "model.layers.0.mlp.down_proj.lora_a", "model.layers.0.input_layernorm.weight",
             "model.layers.0.post_attention_layernorm.weight", "model.layers.1.self_attn.o_proj.lora_b",
             "model.layers.1.mlp.gate_proj.lora_b", "model.norm.weight", "tokens"]
    got = [names[i] for i in backward_order(names)]
    assert got == ["tokens", "model.norm.weight", "model.layers.1.mlp.gate_proj.lora_b",
                   "model.layers.1.self_attn.o_proj.lora_b", "model.layers.0.mlp.down_proj.lora_a",
                   "model.layers.0.post_attention_layernorm.weight", "model.layers.0.self_attn.q_proj.lora_a",
                   "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
