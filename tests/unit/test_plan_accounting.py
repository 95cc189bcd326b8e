"""meshtune plan's pure parts: safetensors headers, weight and trainable accounting, layouts, bubble, link.

Synthetic models are written in tmp_path as a config.json plus real safetensors files
(mx.save_safetensors of real arrays, quantized by mx.quantize) or hand-written headers, so
the accounting is checked against the bytes MLX itself stores.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from support import TINY_MODEL

from meshtune.config import AdapterConfig, Config
from meshtune.plan import parse_link, plan
from meshtune.plan.layouts import bubble, micro_in_flight, ring_allreduce_bytes
from meshtune.plan.memory import (activations, backward_transient_elems, chunked_loss, head_bytes, head_elems,
                                  optimizer_bytes, trained)
from meshtune.plan.model_facts import read_header, read_model

H, I, V = 64, 128, 50  # hidden, MLP width, vocabulary of the synthetic models


def _write(folder: Path, config: dict, arrays: dict[str, mx.array]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), arrays)
    return folder


def _config(**extra: object) -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": I, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "tie_word_embeddings": True,
            **extra}


def _dense(dtype: mx.Dtype) -> dict[str, mx.array]:
    arrays = {"model.embed_tokens.weight": mx.zeros((V, H), dtype), "model.norm.weight": mx.ones((H,), dtype)}
    for b in range(2):
        p = f"model.layers.{b}."
        arrays.update({p + "self_attn.q_proj.weight": mx.zeros((H, H), dtype),
                       p + "self_attn.k_proj.weight": mx.zeros((H // 2, H), dtype),
                       p + "mlp.down_proj.weight": mx.zeros((H, I), dtype),
                       p + "input_layernorm.weight": mx.ones((H,), dtype)})
    return arrays


def _adapter(**kw: object) -> AdapterConfig:
    return AdapterConfig(**{"num_layers": -1, "rank": 4, **kw})


@pytest.mark.parametrize("dtype,kind", [(mx.float16, "F16"), (mx.bfloat16, "BF16"), (mx.float32, "F32")])
def test_dense_weights_are_the_stored_bytes_by_dtype(tmp_path: Path, dtype: mx.Dtype, kind: str) -> None:
    arrays = _dense(dtype)
    facts = read_model(_write(tmp_path / kind, _config(), arrays))
    assert facts.weight_bytes() == {kind: sum(a.nbytes for a in arrays.values())}
    assert facts.activation_dtype_bytes == dtype.size
    assert facts.block_params() == [H * H + H // 2 * H + H * I + H] * 2


def test_lora_dora_full_trainable_counts(tmp_path: Path) -> None:
    facts = read_model(_write(tmp_path / "m", _config(), _dense(mx.float32)))
    per_block = 4 * ((H + H) + (H + H // 2) + (I + H))  # r (in + out) per linear
    lora = trained(facts, _adapter())
    assert sum(t.params for t in lora) == 2 * per_block and all(t.extra for t in lora)
    dora = trained(facts, _adapter(fine_tune_type="dora"))
    assert sum(t.params for t in dora) == 2 * (per_block + H + H // 2 + H)  # plus one magnitude per output row
    full = trained(facts, _adapter(fine_tune_type="full", num_layers=1))
    # The block whole, as mlx_lm.lora trains it: its linear layers and its norm.
    assert sum(t.params for t in full) == H * H + H // 2 * H + H * I + H and not any(t.extra for t in full)
    keyed = trained(facts, _adapter(keys=["self_attn.q_proj"]))
    assert [t.name for t in keyed] == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert [t.name for t in trained(facts, _adapter(num_layers=3))] == [t.name for t in lora]  # more than all: all


@pytest.mark.parametrize("model_type,chunked", [("llama", True), ("qwen3", True), ("gemma2", False)])
def test_the_loss_counts_one_chunk_of_logits_where_the_step_chunks_it(tmp_path: Path, model_type: str,
                                                                      chunked: bool) -> None:
    """The last stage's logits term: one 1024-token chunk for the families training/head_loss.py
    handles, every token for the others; the rest of the estimate is the same."""
    facts = read_model(_write(tmp_path / model_type, _config(model_type=model_type), _dense(mx.float32)))
    norm, loss = head_elems(facts)
    assert head_bytes(facts, _adapter(), 512) == 512 * (norm * 4 + loss * 4)  # under one chunk: every token
    assert head_bytes(facts, _adapter(), 4096) == 4096 * norm * 4 + (1024 if chunked else 4096) * loss * 4


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_heads_loss_and_a_blocks_backward_are_not_held_together(tmp_path: Path, checkpoint: bool) -> None:
    """The head's loss is done before the first block's backward starts: the last stage holds the larger of
    the head and a block's backward transients, a stage without the head only the latter (with SiLU's)."""
    facts = read_model(_write(tmp_path / "m", _config(), _dense(mx.float32)))
    for examples, seq in [(1, 64), (8, 512)]:
        def total(last: bool) -> float:
            return activations(facts, adapter=_adapter(), examples=examples, seq=seq, blocks=range(2), last=last,
                               checkpoint=checkpoint)[0]
        last = backward_transient_elems(facts, seq) * examples * seq * 4
        # A stage without the head counts SiLU's backward in its blocks' (backward_transient_elems).
        headless = backward_transient_elems(facts, seq, headless=True) * examples * seq * 4
        head = head_bytes(facts, _adapter(), examples * seq)
        assert total(True) - total(False) == max(head, last) - headless


def test_an_adapted_or_biased_trained_head_takes_the_plain_loss(tmp_path: Path) -> None:
    """As training/head_loss.split_head decides: LoRA on the head, or a trained head with a bias, keep
    the whole batch's logits; a frozen head, or a plain weight trained in full, is chunked."""
    tied = read_model(_write(tmp_path / "tied", _config(), _dense(mx.float32)))
    assert chunked_loss(tied, _adapter())
    assert not chunked_loss(tied, _adapter(keys=["self_attn.q_proj", "model.embed_tokens"]))
    assert chunked_loss(tied, _adapter(fine_tune_type="full", keys=["model.embed_tokens"]))
    arrays = {**_dense(mx.float32), "lm_head.weight": mx.zeros((V, H)), "lm_head.bias": mx.zeros((V,))}
    biased = read_model(_write(tmp_path / "biased", _config(tie_word_embeddings=False), arrays))
    assert chunked_loss(biased, _adapter(fine_tune_type="full"))  # the head is not among the trained layers
    assert not chunked_loss(biased, _adapter(fine_tune_type="full", keys=["lm_head"]))
    assert not chunked_loss(biased, _adapter(keys=["lm_head"]))


def test_quantized_weights_scales_biases_and_input_width(tmp_path: Path) -> None:
    mx.random.seed(0)
    arrays: dict[str, mx.array] = {"model.norm.weight": mx.ones((H,), mx.float16)}
    for name, shape in (("model.layers.0.mlp.down_proj", (H, I)), ("model.layers.0.self_attn.q_proj", (H, H)),
                        ("model.embed_tokens", (V + 14, H))):
        w, scales, biases = mx.quantize(mx.random.normal(shape).astype(mx.float16), group_size=32, bits=4)
        arrays.update({f"{name}.weight": w, f"{name}.scales": scales, f"{name}.biases": biases})
    config = _config(num_hidden_layers=1, vocab_size=V + 14, quantization={"group_size": 32, "bits": 4})
    facts = read_model(_write(tmp_path / "q", config, arrays))
    quantized = sum(a.nbytes for k, a in arrays.items() if k != "model.norm.weight")
    assert facts.weight_bytes() == {"q4": quantized, "F16": H * 2}
    layers = {layer.name: layer for layer in facts.layers}
    down = layers["model.layers.0.mlp.down_proj"]
    assert (down.in_dims, down.out_dims, down.quantized) == (I, H, True)
    embed = layers["model.embed_tokens"]
    assert (embed.in_dims, embed.out_dims, embed.embedding) == (V + 14, H, True)
    assert facts.activation_dtype_bytes == 2  # the scales' dtype
    assert sum(t.params for t in trained(facts, _adapter(rank=8))) == 8 * (I + H) + 8 * (H + H)
    # Full fine-tuning cannot train packed words: refused as `meshtune train` refuses it.
    with pytest.raises(ValueError, match=r"adapter.fine_tune_type=full: layer model.layers.0.mlp.down_proj of "
                                         r"\S+/q is quantized.*--fine-tune-type lora"):
        trained(facts, _adapter(fine_tune_type="full"))


def test_moe_experts_from_a_hand_written_header(tmp_path: Path) -> None:
    experts, moe_i = 4, 32
    tensors = {"model.embed_tokens.weight": ("BF16", [V, H]), "model.norm.weight": ("BF16", [H])}
    for proj, shape in (("gate_proj", [experts, moe_i, H]), ("up_proj", [experts, moe_i, H]),
                        ("down_proj", [experts, H, moe_i])):
        tensors[f"model.layers.0.mlp.switch_mlp.{proj}.weight"] = ("BF16", shape)
    tensors["model.layers.0.mlp.gate.weight"] = ("BF16", [experts, H])
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = 2 * int(mx.prod(mx.array(shape)).item())
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    folder = tmp_path / "moe"
    folder.mkdir()
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (folder / "config.json").write_text(json.dumps(_config(num_hidden_layers=1, num_experts=experts,
                                                           num_experts_per_tok=2, moe_intermediate_size=moe_i)))
    assert [t.name for t in read_header(folder / "model.safetensors")] == list(tensors)
    facts = read_model(folder)
    assert (facts.experts, facts.experts_per_token, facts.moe_intermediate) == (experts, 2, moe_i)
    assert facts.weight_bytes() == {"BF16": offset}
    items = {t.name: t for t in trained(facts, _adapter(rank=2))}
    assert items["model.layers.0.mlp.switch_mlp.gate_proj"].params == experts * 2 * (H + moe_i)
    assert items["model.layers.0.mlp.gate"].params == 2 * (H + experts)


def test_optimizer_state_by_optimizer() -> None:
    from meshtune.plan.memory import Trained

    items = [Trained("a", 6 * 10, 4, 0, True, shapes=((1, 6, 10),))]
    assert optimizer_bytes("adam", items, {}) == optimizer_bytes("adamw", items, {}) == 2 * 60 * 4
    assert optimizer_bytes("sgd", items, {}) == optimizer_bytes("muon", items, {}) == 60 * 4
    assert optimizer_bytes("adafactor", items, {}) == (6 + 10) * 4  # a row and a column factor
    assert optimizer_bytes("adafactor", items, {"beta_1": 0.9}) == (6 + 10 + 60) * 4


def test_the_update_holds_the_squares_or_the_copies_of_what_is_not_updated_in_place() -> None:
    """plan/estimate.update_extra, beside the gradients: Adam updates a tensor of IN_PLACE_FROM elements or
    more in place (only the norm's squares, the gradients' size, are new), a smaller one with new weights
    and both moments (3x); other optimizers make new weights and state for every tensor."""
    from meshtune.plan.estimate import update_extra
    from meshtune.plan.memory import Trained
    from meshtune.training import IN_PLACE_FROM

    big = Trained("w", IN_PLACE_FROM, 2, 0, False, shapes=((IN_PLACE_FROM // 4, 4),))
    small = Trained("b", 4 * 100, 2, 0, False, shapes=((4, 100),))
    mixed = Trained("g", IN_PLACE_FROM + 400, 2, 0, False, shapes=((IN_PLACE_FROM // 4, 4), (4, 100)))
    assert update_extra([big], "adamw", {}) == IN_PLACE_FROM * 2  # the squares
    assert update_extra([small], "adam", {}) == 3 * 400 * 2  # new weights, m and v
    assert update_extra([mixed], "adam", {}) == (IN_PLACE_FROM + 400) * 2  # squares of all > copies of the small
    assert update_extra([big], "sgd", {}) == 2 * IN_PLACE_FROM * 2  # new weights and v: no in-place path


@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 4), (3, 6), (4, 8)])
def test_bubble_and_in_flight_follow_the_schedules(stages: int, micro: int) -> None:
    for name in ("gpipe", "1f1b"):
        assert bubble(name, stages, micro) == pytest.approx((stages - 1) / (micro + stages - 1))
    assert bubble("naive", stages, micro) == pytest.approx(1 - 1 / stages)
    assert micro_in_flight("gpipe", stages, micro) == [micro] * stages
    assert micro_in_flight("1f1b", stages, micro) == [min(stages - s, micro) for s in range(stages)]
    assert micro_in_flight("naive", stages, micro) == [1] * stages


@pytest.mark.parametrize("text,bytes_s", [("10gbit", 1.25e9), ("1gbit", 1.25e8), ("100mbit", 1.25e7),
                                          ("40gbit", 5e9), ("5GB/s", 5e9), ("10Gb/s", 1.25e9)])
def test_link_forms(text: str, bytes_s: float) -> None:
    assert parse_link(text) == pytest.approx(bytes_s)


@pytest.mark.parametrize("text", ["fast", "10", "10 gigs", "-1gbit"])
def test_bad_link_names_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match=r"--link .*e\.g\.|--link .*like 10gbit"):
        parse_link(text)


def test_hub_id_not_on_disk_asks_for_a_local_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="plan reads a local folder") as err:
        read_model("mlx-community/Not-A-Model-4bit")
    assert "\n" not in str(err.value)


def test_candidates_and_their_split_match_the_pipeline(tmp_path: Path) -> None:
    import mlx_lm.utils

    from meshtune.adapters.apply import apply_adapters
    from meshtune.parallel.pipeline.stage import split_stages

    cfg = Config.from_dict({"adapter": {"num_layers": -1}, "train": {"batch_size": 6}})
    result = plan(cfg, 4, 1.0, "10gbit", seq_len=32)
    assert [r["layout"] for r in result["layouts"]] == ["1 process", "DP 4", "DP 2 x PP 2", "PP 4"]
    bad = {r["layout"]: r["problem"] for r in result["layouts"]}
    assert "--batch-size 6 is not divisible by dp 4" in bad["DP 4"]
    assert "--parallel.micro_batches 4 does not divide" in bad["PP 4"]
    assert result["recommended"] == "1 process" and "no layout using all 4 ranks is valid (DP 4: " in result["reason"]
    model, _ = mlx_lm.utils.load_model(TINY_MODEL)
    apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=None, rank=8, scale=20.0, dropout=0.0)
    for pp in (2, 3, 4):
        layout = plan(Config.from_dict({"adapter": {"num_layers": -1}, "train": {"batch_size": 12}}), pp, 1.0,
                      "1gbit", seq_len=32)["layouts"][-1]
        bounds = split_stages(model, pp)
        assert layout["stage_layers"] == [e - s for s, e in bounds], pp


@pytest.mark.parametrize("tied", [True, False])
def test_each_stage_counts_only_its_own_weights(tmp_path: Path, tied: bool) -> None:
    # The pipeline cut (parallel/pipeline/stage_cut.py): blocks per stage, the table on the first (and, tied, the last).
    arrays = _dense(mx.float32)
    if not tied:
        arrays["lm_head.weight"] = mx.zeros((V, H))
    folder = _write(tmp_path / "m", _config(tie_word_embeddings=tied), arrays)
    cfg = Config.from_dict({"model": {"path": str(folder)}, "adapter": {"num_layers": -1}, "train": {"batch_size": 4}})
    row = next(r for r in plan(cfg, 2, 1.0, "10gbit", seq_len=8)["layouts"] if r["layout"] == "PP 2")
    size = {k: v.nbytes for k, v in arrays.items()}
    block = [sum(n for k, n in size.items() if k.startswith(f"model.layers.{b}.")) for b in range(2)]
    table, head = size["model.embed_tokens.weight"], size.get("lm_head.weight", size["model.embed_tokens.weight"])
    assert [st["weights"] for st in row["stages"]] == [table + block[0], block[1] + size["model.norm.weight"] + head]
    one = plan(cfg, 1, 1.0, "10gbit", seq_len=8)["layouts"][0]
    assert one["stages"][0]["weights"] == sum(size.values())
    # Each stage holds the adapters of its own blocks only.
    assert sum(st["adapters"] for st in row["stages"]) == one["stages"][0]["adapters"]
    from meshtune.plan.report import size_text, table

    said = table(plan(cfg, 2, 1.0, "10gbit", seq_len=8))
    first, last = row["stages"]
    assert (f"PP 2 per stage (weights / total): 0 [0, 1) + embedding {size_text(first['weights'])} / "
            f"{size_text(first['total'])}; 1 [1, 2) + norm, head {size_text(last['weights'])}") in said


def test_the_plan_says_how_many_stages_fit_where_one_process_does_not() -> None:
    cfg = Config.from_dict({"adapter": {"num_layers": -1}, "train": {"batch_size": 4}})
    whole = plan(cfg, 1, 1.0, "10gbit", seq_len=32)
    need = whole["layouts"][0]["total"]
    assert whole["stages_to_fit"] is None  # one process fits 1 GB
    stages = [st["total"] for st in plan(cfg, 2, 1.0, "10gbit", seq_len=32)["layouts"][-1]["stages"]]
    tight = plan(cfg, 1, (max(stages) + need) / 2 / 1e9, "10gbit", seq_len=32)
    assert tight["recommended"] is None and tight["stages_to_fit"] == 2
    assert tight["reason"].endswith("; 2 pipeline stages fit (2 ranks, --parallel.pp 2)")
    assert plan(cfg, 1, 1e-6, "10gbit", seq_len=32)["stages_to_fit"] is None  # not even one block a rank fits


def test_seq_len_is_at_least_1_and_at_most_what_a_run_keeps() -> None:
    cfg = Config.from_dict({"data": {"max_seq_length": 512}})
    assert plan(cfg, 1, 16.0, "10gbit")["seq_len"] == 512  # the worst case by default
    assert plan(cfg, 1, 16.0, "10gbit", seq_len=128)["seq_len"] == 128
    with pytest.raises(ValueError, match=r"--seq-len 0: give the tokens per example"):
        plan(cfg, 1, 16.0, "10gbit", seq_len=0)
    with pytest.raises(ValueError, match=r"--seq-len 4096 is longer than data.max_seq_length=512.*--seq-len 512 or"):
        plan(cfg, 1, 16.0, "10gbit", seq_len=4096)
    tight = plan(cfg, 1, 1e-6, "10gbit", seq_len=128)  # fits nowhere: the fix names the flag that was given
    assert "a smaller --batch-size or --seq-len" in tight["reason"]
    assert "a smaller --batch-size or --max-seq-length" in plan(cfg, 1, 1e-6, "10gbit")["reason"]


def test_allreduce_bytes() -> None:
    assert ring_allreduce_bytes(100.0, 1) == 0
    assert ring_allreduce_bytes(100.0, 4) == pytest.approx(150.0)


@pytest.mark.parametrize("kind", ["quantized", "moe"])
def test_whole_plan_on_quantized_and_moe_models(tmp_path: Path, kind: str) -> None:
    if kind == "quantized":
        test_quantized_weights_scales_biases_and_input_width(tmp_path)
        folder = tmp_path / "q"
    else:
        test_moe_experts_from_a_hand_written_header(tmp_path)
        folder = tmp_path / "moe"
    cfg = Config.from_dict({"model": {"path": str(folder)}, "adapter": {"num_layers": -1},
                            "optimizer": {"name": "adafactor"}})
    result = plan(cfg, 1, 1.0, "1gbit", seq_len=64)
    row = result["layouts"][0]
    stage = row["stages"][0]
    assert row["total"] > stage["weights"] + stage["adapters"] + stage["optimizer"]
    assert stage["activations"] > 0 and stage["activations_ckpt"] > 0  # one block: checkpointing saves nothing
    assert result["recommended"] == "1 process"


@pytest.mark.parametrize("kind, num_layers", [("full", -1), ("full", 2), ("lora", -1), ("dora", 2)])
def test_the_trained_parameters_are_the_ones_train_trains(kind: str, num_layers: int) -> None:
    """The planner's count from the safetensors headers equals what apply_adapters makes trainable."""
    from mlx_lm.utils import load

    from meshtune.adapters import apply_adapters, trainable_parameters

    adapter = _adapter(fine_tune_type=kind, num_layers=num_layers)
    model, _ = load(str(TINY_MODEL))
    apply_adapters(model, fine_tune_type=kind, num_layers=num_layers, keys=None, rank=adapter.rank,
                   scale=adapter.scale, dropout=0.0)
    assert sum(t.params for t in trained(read_model(TINY_MODEL), adapter)) == sum(
        v.size for v in trainable_parameters(model).values())


def test_k_links_carry_a_step_s_traffic_k_times_as_fast() -> None:
    """`--links K` (a hostfile's addresses per host): MLX's ring stripes over them; the bytes stay the same."""
    cfg = Config.from_dict({"adapter": {"num_layers": -1}, "train": {"batch_size": 4}})
    one, two = (plan(cfg, 2, 16.0, "1gbit", seq_len=32, links=k) for k in (1, 2))
    assert two["link_bytes_per_s"] == 2 * one["link_bytes_per_s"] and two["links"] == 2
    dp1, dp2 = ({r["layout"]: r for r in p["layouts"]}["DP 2"] for p in (one, two))
    assert dp2["comm_bytes"] == dp1["comm_bytes"] > 0 and dp2["comm_ms"] == pytest.approx(dp1["comm_ms"] / 2)
    with pytest.raises(ValueError, match="--links 0: give the links"):
        plan(cfg, 2, 16.0, "1gbit", links=0)
