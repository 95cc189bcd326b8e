"""Each pipeline rank holds and allocates only its own stage's parts, on 2 real ranks (ring backend).

The model is a random Qwen3-shaped one (dense, 4-bit, or mixture-of-experts) saved as a model folder,
so the ranks load it as users' runs do: lazily, then cut to the stage before any weight is read.
Each rank says what its parameter tree holds; that must be exactly its blocks (and the embedding on
the first stage, the norm and head on the last) as the safetensors header counts them, plus the
adapters it trains. Its peak memory since the process started must leave out the other stage's weights
(and, for LoRA on a dense model, stay under 0.6x one process's peak).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from support import run_cli
from meshtune.bench.models import Shape, write_model_folder
from meshtune.bench.pipeline import write_text_data
from meshtune.plan.model_facts import block_of, read_model

SHAPE = Shape(arch="qwen3", layers=4, hidden=512, intermediate=2048, heads=8, kv_heads=4, vocab=512)


def _moe_folder(folder: Path) -> Path:
    """A random Qwen3-MoE model (4 experts, 2 a token) saved as a model folder."""
    import dataclasses
    import shutil

    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe

    mx.random.seed(0)
    args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                               num_attention_heads=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                               mlp_only_layers=[], moe_intermediate_size=256, rms_norm_eps=1e-6, vocab_size=512,
                               num_key_value_heads=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=False,
                               max_position_embeddings=4096, norm_topk_prob=True)
    model = qwen3_moe.Model(args)
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(args)))
    for f in (Path(__file__).resolve().parents[2] / "meshtune" / "assets" / "tiny-llama").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dense = write_model_folder(SHAPE, mx.float32, root / "dense")
    proc = run_cli("train", "--help")  # the CLI imports; the conversion below is mlx-lm's own
    assert proc.returncode == 0
    from mlx_lm import convert

    convert(str(dense), mlx_path=str(root / "q4"), quantize=True, q_group_size=64, q_bits=4, dtype="float32")
    return {"dense": dense, "quantized": root / "q4", "moe": _moe_folder(root / "moe")}


def _stage_bytes(folder: Path, bounds: tuple[int, int], first: bool, last: bool) -> int:
    """Bytes of the base weights a stage computes with, from the safetensors headers (nothing loaded)."""
    total = 0
    for t in read_model(folder).tensors:
        block = block_of(t.name)
        if block is not None:
            total += t.nbytes if bounds[0] <= block < bounds[1] else 0
        elif "embed_tokens" in t.name:
            total += t.nbytes if first else 0
        else:  # the final norm and the head
            total += t.nbytes if last else 0
    return total


@pytest.mark.parametrize("model, kind, ratio", [
    ("dense", "lora", 0.6), ("dense", "full", None), ("quantized", "dora", None), ("moe", "lora", None),
])
def test_each_rank_holds_and_allocates_only_its_stage(tmp_path, models, model, kind, ratio):
    folder = models[model]
    data = write_text_data(tmp_path / "data", 31, rows=16)
    flags = ["train", "--model", str(folder), "--data", str(data), "--fine-tune-type", kind, "--iters", "2",
             "--batch-size", "2", "--max-seq-length", "33", "--data.pad_to", "32", "--steps-per-eval", "2",
             "--val-batches", "1", "--optimizer", "sgd", "--learning-rate", "0.01"]
    one = run_cli(*flags, "--adapter-path", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two = run_cli("launch", "-n", "2", "--", sys.executable, "-m", "meshtune.cli", *flags, "--parallel.pp", "2",
                  "--adapter-path", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    adapters = mx.load(str(tmp_path / "two" / "adapters.safetensors"))
    whole = sum(t.nbytes for t in read_model(folder).tensors)
    one_peak = [json.loads(l) for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    one_peak = max(r["peak_memory_gb"] for r in one_peak if r["type"] == "train") * 1e9
    for rank, bounds in enumerate([(0, 2), (2, 4)]):
        said = next(l for l in two.stdout.splitlines() if l.startswith(f"[rank {rank}] pipeline stage {rank} holds"))
        assert f"blocks [{bounds[0]}, {bounds[1]})" in said
        held = float(re.search(r": ([0-9.]+) MB of weights", said).group(1)) * 1e6
        base = _stage_bytes(folder, bounds, first=rank == 0, last=rank == 1)
        # What the stage trains beside its base: adapters of its own blocks (full trains the base itself).
        extra = 0 if kind == "full" else sum(v.nbytes for k, v in adapters.items()
                                             if bounds[0] <= (block_of(k) or 0) < bounds[1])
        assert held == pytest.approx(base + extra, abs=1e3), (said, base, extra)
        assert base < 0.7 * whole  # the other stage's half is not in this rank's tree
        finished = next(l for l in two.stdout.splitlines() if l.startswith(f"[rank {rank}] rank {rank} finished"))
        peak = float(finished.split("peak memory ")[1].split(" GB")[0]) * 1e9
        # Since the process started (the load included), this rank's peak leaves out the other stage's weights:
        # one process holds all this rank holds, and those weights (and their blocks' activations) beside it.
        other = whole - base
        assert peak + other <= one_peak, (finished, other, one_peak)
        if ratio is not None:
            assert peak <= ratio * one_peak, (finished, one_peak)
    # Evaluation runs through the stages and gives one process's loss.
    val = [[json.loads(l)["val_loss"] for l in (tmp_path / r / "metrics.jsonl").read_text().splitlines()
            if '"val"' in l] for r in ("one", "two")]
    assert val[1] == pytest.approx(val[0], rel=1e-5)


def test_full_fine_tuning_stages_write_a_sharded_model_and_resume_on_more_stages(tmp_path):
    # The tiny model ties its head to the embedding: the table is the first stage's to write.
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from support import TINY_MODEL
    from meshtune.inference import load_for_inference

    run = tmp_path / "run"
    flags = ["train", "--fine-tune-type", "full", "--optimizer", "sgd", "--learning-rate", "0.01", "--batch-size", "6",
             "--save-every", "2", "--val-batches", "1", "--steps-per-eval", "2", "--adapter-path", str(run)]
    for ranks, more in ((2, ["--iters", "2"]), (3, ["--iters", "4", "--resume"])):
        proc = run_cli("launch", "-n", str(ranks), "--", sys.executable, "-m", "meshtune.cli", *flags,
                       "--parallel.pp", str(ranks), *more)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for rank in range(ranks):
            assert f"[rank {rank}] rank {rank} finished at step {more[1]}" in proc.stdout
    assert "resumed from step 2" in proc.stdout  # a 2-stage checkpoint, on 3 stages

    folder = run / "model"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]  # the 2-stage save's are gone
    for name in shards:  # each stage wrote what the index says it holds, and nothing else
        assert sorted(mx.load(str(folder / name))) == sorted(k for k, f in index["weight_map"].items() if f == name)
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0]
    # Stock mlx-lm loads the folder as a model: the base with the trained weights of the adapters file.
    model, _ = load(str(folder))
    want, _ = load_for_inference(str(TINY_MODEL), run)
    got, want = dict(tree_flatten(model.parameters())), dict(tree_flatten(want.parameters()))
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in got)
    gen = run_cli("generate", "--model", str(folder), "--prompt", "What is 40 + 2?", "--max-tokens", "4")
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr[-2000:]


def test_a_model_over_the_memory_limit_stops_on_one_process_and_trains_on_two_stages(tmp_path, models):
    # The dense model's weights (65 MB) and one process's plan (~88 MB) exceed a 60 MB rank; half fits.
    data = write_text_data(tmp_path / "data", 31, rows=16)
    flags = ["train", "--model", str(models["dense"]), "--data", str(data), "--iters", "2", "--batch-size", "2",
             "--max-seq-length", "33", "--data.pad_to", "32", "--optimizer", "sgd", "--val-batches", "0",
             "--runtime.memory_limit_gb", "0.06"]
    one = run_cli(*flags, "--adapter-path", str(tmp_path / "one"))
    assert one.returncode == 2, one.stdout[-1000:] + one.stderr[-1000:]
    assert one.stderr.startswith("meshtune: error: this run's plan needs ~") and one.stderr.count("\n") == 1
    assert "gives 0.06 GB; to fit: 2 pipeline stages, one a rank (--parallel.pp 2 under meshtune launch -n 2)" \
        in one.stderr, one.stderr
    assert not (tmp_path / "one").exists()
    two = run_cli("launch", "-n", "2", "--", sys.executable, "-m", "meshtune.cli", *flags, "--parallel.pp", "2",
                  "--adapter-path", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    for rank in range(2):
        finished = next(l for l in two.stdout.splitlines() if l.startswith(f"[rank {rank}] rank {rank} finished"))
        assert "finished at step 2" in finished
        assert float(finished.split("peak memory ")[1].split(" GB")[0]) < 0.06, finished
