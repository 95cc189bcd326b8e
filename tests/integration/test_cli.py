"""End-to-end runs of the `meshtune` command on the embedded model: files, metrics, errors."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from support import ARITH_DATA, TINY_MODEL, run_cli

QUICK = ["--batch-size", "8", "--num-layers", "-1", "--learning-rate", "1e-3", "--mask-prompt",
         "--train.steps_per_report", "2", "--steps-per-eval", "3", "--save-every", "3",
         "--train.val_batches", "2"]


def _records(run: Path) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 6-step LoRA run on the embedded default, shared by the read-only tests below."""
    from support import run_cli

    run = tmp_path_factory.mktemp("cli") / "run"
    proc = run_cli("train", "--iters", "6", *QUICK, "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_train_writes_the_promised_files(trained):
    run, proc = trained
    assert "BLAS:" in proc.stdout
    assert "trainable parameters" in proc.stdout
    assert (run / "adapters.safetensors").exists()
    config = json.loads((run / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == -1
    assert Path(config["model"]) == TINY_MODEL and Path(config["data"]) == ARITH_DATA
    assert config["lora_parameters"]["rank"] == 8
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000003", "0000006"]
    for ckpt in (run / "checkpoints").iterdir():
        assert {p.name for p in ckpt.iterdir()} == {"adapters.safetensors", "optimizer.safetensors",
                                                    "config.yaml", "state.json", "adapter_config.json"}
        state = json.loads((ckpt / "state.json").read_text())
        assert state["step"] == int(ckpt.name) and "epoch" in state["data_cursor"]


def test_metrics_lines(trained):
    run, _ = trained
    recs = _records(run)
    train = [r for r in recs if r["type"] == "train"]
    val = [r for r in recs if r["type"] == "val"]
    assert [r["step"] for r in train] == [2, 3, 4, 6]  # every 2 steps and at each save (every 3)
    assert [r["step"] for r in val] == [0, 3, 6]
    for r in train:
        assert r["tokens"] > 0 and r["tokens_per_sec"] > 0 and r["peak_memory_gb"] > 0
        assert r["learning_rate"] == pytest.approx(1e-3)
    assert val[-1]["val_loss"] < val[0]["val_loss"]


def test_stock_mlx_lm_loads_our_adapters_with_same_logits(trained):
    from mlx_lm.utils import load

    from meshtune.api import load_for_inference

    run, _ = trained
    stock, _ = load(str(TINY_MODEL), adapter_path=str(run))
    ours, tok = load_for_inference(str(TINY_MODEL), run)
    tokens = mx.array([tok.encode("What is 12 + 34?")])
    assert mx.array_equal(stock(tokens), ours(tokens))


def test_existing_run_is_not_overwritten(trained, cli):
    run, _ = trained
    before = (run / "adapters.safetensors").read_bytes()
    proc = cli("train", "--iters", "2", *QUICK, "--adapter-path", str(run))
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and "--resume" in proc.stderr
    assert (run / "adapters.safetensors").read_bytes() == before


def test_resume_reproduces_uninterrupted_losses(tmp_path, cli):
    whole, part = tmp_path / "whole", tmp_path / "part"
    # Report every 3 steps so the interrupted run's final report (step 3) is one the
    # uninterrupted run makes too; dropout makes the RNG matter.
    args = [*QUICK, "--adapter.dropout", "0.1", "--train.steps_per_report", "3"]
    assert cli("train", "--iters", "6", *args, "--adapter-path", str(whole)).returncode == 0
    assert cli("train", "--iters", "3", *args, "--adapter-path", str(part)).returncode == 0
    proc = cli("train", "--iters", "6", *args, "--adapter-path", str(part), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from step 3" in proc.stdout
    strip = lambda rs: [{k: v for k, v in r.items() if k in ("type", "step", "loss", "val_loss")}  # noqa: E731
                        for r in rs if r["type"] != "start"]  # the reports (a resumed run starts twice)
    assert strip(_records(part)) == strip(_records(whole))
    assert (part / "adapters.safetensors").read_bytes() == (whole / "adapters.safetensors").read_bytes()


def test_a_checkpoint_between_reports_resumes_to_the_same_reports_and_tokens(tmp_path, cli):
    """Reports every 2 steps, a checkpoint every 3: the save closes the report window, so the
    checkpoint at step 3 counts every token before it, and a run resumed from it reports what
    the uninterrupted run reported (losses, tokens, trained tokens), step for step."""
    import shutil

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli("train", "--iters", "6", *QUICK, "--adapter-path", str(whole)).returncode == 0
    train = [r for r in _records(whole) if r["type"] == "train"]
    assert [r["step"] for r in train] == [2, 3, 4, 6]  # the save at 3 reported its window
    shutil.copytree(whole, part)
    shutil.rmtree(part / "checkpoints" / "0000006")
    proc = cli("train", "--iters", "6", *QUICK, "--adapter-path", str(part), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from step 3" in proc.stdout
    keys = ("type", "step", "loss", "tokens", "trained_tokens", "val_loss")
    strip = lambda rs: [{k: v for k, v in r.items() if k in keys} for r in rs if r["type"] != "start"]  # noqa: E731
    assert strip(_records(part)) == strip(_records(whole))
    assert f"{train[-1]['trained_tokens']} tokens" in proc.stdout  # the run's own total, not one window short


def test_a_pipeline_checkpoint_given_as_adapters_points_at_its_run(tmp_path, cli):
    """generate, fuse and eval on a pipeline checkpoint (one shard per stage): one line naming the run."""
    step = tmp_path / "run" / "checkpoints" / "0000004"
    step.mkdir(parents=True)
    (step / "state.stage0.json").write_text("{}")
    for command in (["generate", "--prompt", "hi"], ["fuse", "--save-path", str(tmp_path / "fused")], ["eval"],
                    ["generate", "--prompt", "hi", "--model", str(TINY_MODEL)],  # with the base named too
                    ["fuse", "--save-path", str(tmp_path / "fused"), "--model", str(TINY_MODEL)]):
        proc = cli(*command, "--adapter-path", str(step))
        assert proc.returncode == 2, (command, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1] == (
            f"meshtune: error: --adapter-path {step} is a pipeline checkpoint (one weights file per stage), which "
            f"resumes but does not load as adapters; point it at the run ({tmp_path / 'run'})"), (command, proc.stderr)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, cli):
    proc = cli("train", "--iters", "2", *QUICK, "--adapter-path", str(tmp_path / "none"), "--resume")
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr


def test_bad_config_names_file_line_and_nearest_key(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  iters: 5\n  batch_sise: 4\n")
    proc = cli("train", "-c", str(bad))
    assert proc.returncode == 2
    assert "bad.yaml:3" in proc.stderr and "batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_override_is_rejected(cli):
    proc = cli("train", "--train.iter", "5")
    assert proc.returncode == 2 and "train.iters" in proc.stderr


def test_mlx_lm_config_is_accepted_and_mapping_printed(tmp_path, cli):
    cfg = tmp_path / "lora_config.yaml"
    cfg.write_text(f"model: {TINY_MODEL}\ndata: {ARITH_DATA}\ntrain: true\nfine_tune_type: lora\n"
                   "num_layers: 2\nbatch_size: 8\niters: 2\nlearning_rate: 1e-4\nsteps_per_report: 1\n"
                   "val_batches: 1\nlora_parameters:\n  rank: 4\n  scale: 10.0\n  dropout: 0.0\n"
                   f"adapter_path: {tmp_path / 'run'}\n")
    proc = cli("train", "-c", str(cfg))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mlx-lm key mapped: learning_rate -> optimizer.learning_rate" in proc.stdout
    assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())["lora_parameters"]["rank"] == 4


def test_full_fine_tune_loads_in_stock_mlx_lm(tmp_path, cli):
    from mlx_lm.utils import load

    run = tmp_path / "full"
    proc = cli("train", "--iters", "2", *QUICK, "--fine-tune-type", "full", "--num-layers", "1",
               "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    weights = mx.load(str(run / "adapters.safetensors"))
    assert weights and all(k.startswith("model.layers.3.") for k in weights)
    model, _ = load(str(TINY_MODEL), adapter_path=str(run))
    assert mx.array_equal(model.model.layers[3].mlp.up_proj.weight, weights["model.layers.3.mlp.up_proj.weight"])


def test_fuse_and_generate(trained, tmp_path, cli):
    from mlx_lm.utils import load

    run, _ = trained
    fused = tmp_path / "fused"
    proc = cli("fuse", "--adapter-path", str(run), "--save-path", str(fused))
    assert proc.returncode == 0, proc.stderr[-2000:]
    base, tok = load(str(TINY_MODEL), adapter_path=str(run))
    merged, _ = load(str(fused))
    tokens = mx.array([tok.encode("What is 40 + 2?")])
    assert mx.allclose(base(tokens), merged(tokens), atol=1e-4)
    proc = cli("generate", "--adapter-path", str(run), "--prompt", "What is 40 + 2?", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Greedy: the command prints what stock mlx-lm generates from the same model and prompt.
    from mlx_lm import generate

    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 40 + 2?"}],
                                     add_generation_prompt=True, return_dict=False)
    assert proc.stdout == generate(base, tok, prompt=prompt, max_tokens=4) + "\n"


def test_a_checkpoint_loads_as_adapters_in_stock_mlx_lm_and_meshtune(trained, cli):
    """mlx-lm users pick a step's adapters; a checkpoint folder carries the run's adapter_config.json."""
    from mlx_lm.utils import load

    run, _ = trained
    step = run / "checkpoints" / "0000006"  # the last step's: the run's own adapters
    final, tok = load(str(TINY_MODEL), adapter_path=str(run))
    at_step, _ = load(str(TINY_MODEL), adapter_path=str(step))
    tokens = mx.array([tok.encode("What is 40 + 2?")])
    assert mx.array_equal(final(tokens), at_step(tokens))
    proc = cli("generate", "--adapter-path", str(step), "--prompt", "What is 40 + 2?", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == cli("generate", "--adapter-path", str(run), "--prompt", "What is 40 + 2?",
                              "--max-tokens", "4").stdout


def test_eval_scores_a_run_s_adapters_on_its_test_split_as_mlx_lm_evaluates(trained, cli, tmp_path):
    """meshtune eval (mlx_lm.lora --test without --train): the run's data and mask from its
    adapter_config.json, every example of the split, the loss mlx-lm's evaluate gives once its
    extra padding target is left out (training/losses.target_mask)."""
    import types

    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import evaluate

    from meshtune.api import load_for_inference

    run, _ = trained
    proc = cli("eval", "--adapter-path", str(run), "--batch-size", "4")  # 100 test rows: 25 full batches
    assert proc.returncode == 0, proc.stderr[-2000:]
    head, _, tail = proc.stdout.strip().partition(" (")
    loss, ppl = float(head.split()[2].rstrip(",")), float(head.split()[5])
    assert tail.startswith("352 tokens of 100 examples in 25 batches of 4;")
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3)

    def unpadded_loss(model, batch, lengths):  # mlx-lm's default_loss without the padding target
        logits = model(batch[:, :-1])
        steps = mx.arange(1, batch.shape[1])
        mask = (steps >= lengths[:, 0:1]) & (steps < lengths[:, 1:])
        ce = (nn.losses.cross_entropy(logits, batch[:, 1:]) * mask).astype(mx.float32).sum()
        return ce / mask.sum(), mask.sum()

    model, tok = load_for_inference(str(TINY_MODEL), run)
    args = types.SimpleNamespace(data=str(ARITH_DATA), train=False, test=True, mask_prompt=True, hf_dataset=None)
    test_set = load_dataset(args, tok)[2]
    expected = evaluate(model, CacheDataset(test_set), 4, -1, 2048, loss=unpadded_loss)
    assert loss == pytest.approx(expected, abs=1e-3)
    wrong = cli("eval", "--adapter-path", str(run / "nothing"))
    assert wrong.returncode == 2 and "no adapter_config.json there" in wrong.stderr
    big = cli("eval", "--adapter-path", str(run), "--batch-size", "500")  # more than the 100 test rows
    assert big.returncode == 2 and "give --batch-size 100 (or less)" in big.stderr, big.stderr
    assert "--test" not in big.stderr.split("batch_size=500", 1)[1]  # train's way out, not eval's
    # Only the scored split is read: a folder of test.jsonl alone scores the same.
    alone = tmp_path / "only_test"
    alone.mkdir()
    shutil.copy(ARITH_DATA / "test.jsonl", alone)
    proc = cli("eval", "--adapter-path", str(run), "--batch-size", "4", "--data", str(alone))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(head + " (352 tokens of 100 examples in 25 batches of 4;"), proc.stdout


def test_a_run_on_relative_paths_generates_and_resumes_from_anywhere(tmp_path, cli):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(TINY_MODEL)
    (tmp_path / "data").symlink_to(ARITH_DATA)
    proc = cli("train", "--model", "models/tiny", "--data", "./data", "--iters", "2", *QUICK,
               "--adapter-path", "runs/a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "runs" / "a"
    saved = json.loads((run / "adapter_config.json").read_text())
    assert saved["model"] == str(tmp_path / "models" / "tiny")  # absolute, the link's own name kept
    assert saved["meshtune"]["data"]["path"] == str(tmp_path / "data")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = cli("generate", "--adapter-path", str(run), "--prompt", "What is 4 + 2?", "--max-tokens", "2",
               cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = cli("train", "--adapter-path", str(run), "--resume", "--iters", "3", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from step" in proc.stdout


def test_quantized_base_trains_and_fuse_requantizes(tmp_path, cli):
    from mlx_lm import convert
    from mlx_lm.utils import load

    q = tmp_path / "q4"
    convert(str(TINY_MODEL), mlx_path=str(q), quantize=True, q_group_size=32, q_bits=4)
    run = tmp_path / "run"
    proc = cli("train", "--model", str(q), "--iters", "2", *QUICK, "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    fused = tmp_path / "fused"
    assert cli("fuse", "--adapter-path", str(run), "--save-path", str(fused)).returncode == 0
    assert json.loads((fused / "config.json").read_text())["quantization"]["bits"] == 4
    model, tok = load(str(fused))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    dense = tmp_path / "dense"
    assert cli("fuse", "--adapter-path", str(run), "--save-path", str(dense), "--dequantize").returncode == 0
    assert "quantization" not in json.loads((dense / "config.json").read_text())
    # The run kept its measured base paths, and --resume multiplies by them instead of measuring anew.
    kept = json.loads((run / "base_path.rank0.json").read_text())
    assert kept and all(isinstance(v, int) for v in kept.values())
    proc = cli("train", "--adapter-path", str(run), "--resume", "--iters", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"base path: {len(kept)} measured crossovers from {run / 'base_path.rank0.json'}" in proc.stdout
    assert json.loads((run / "base_path.rank0.json").read_text()) == kept


def test_blas_choice_is_logged_and_can_be_turned_off(tmp_path, cli):
    from meshtune.runtime.blas import find_system_openblas

    env_preload = os.environ.pop("LD_PRELOAD", None)
    try:
        args = ["train", "--iters", "1", *QUICK, "--train.val_batches", "0"]
        on = cli(*args, "--adapter-path", str(tmp_path / "on"))
        off = cli("--no-system-blas", *args, "--adapter-path", str(tmp_path / "off"))
        by_config = cli(*args, "--runtime.system_blas", "false", "--adapter-path", str(tmp_path / "cfg"))
    finally:
        if env_preload is not None:
            os.environ["LD_PRELOAD"] = env_preload
    assert on.returncode == off.returncode == by_config.returncode == 0, \
        on.stderr[-2000:] + off.stderr[-2000:] + by_config.stderr[-2000:]
    assert "BLAS: MLX's bundled reference BLAS" in off.stdout
    assert "BLAS: MLX's bundled reference BLAS" in by_config.stdout
    if find_system_openblas():
        assert "BLAS: system OpenBLAS" in on.stdout


def test_bench_peer_prints_both_and_json(cli):
    proc = cli("bench", "peer", "--iters", "4", "--report-every", "2", "--batch-size", "8", "--repeats", "1",
               "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlx_lm.lora" in proc.stdout and "meshtune" in proc.stdout and "BLAS:" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"stock_tok_s", "meshtune_tok_s", "ratio"}
    assert result["stock_tok_s"] > 0 and result["meshtune_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["meshtune_tok_s"] / result["stock_tok_s"])


def test_grad_checkpoint_gives_the_same_losses(tmp_path, cli):
    args = ["train", "--iters", "2", *QUICK, "--train.steps_per_report", "1", "--train.val_batches", "0"]
    plain = cli(*args, "--adapter-path", str(tmp_path / "plain"))
    ckpt = cli(*args, "--grad-checkpoint", "--adapter-path", str(tmp_path / "ckpt"))
    assert plain.returncode == 0 and ckpt.returncode == 0, ckpt.stderr[-2000:]
    losses = lambda run: [r["loss"] for r in _records(run) if r["type"] == "train"]  # noqa: E731
    assert len(losses(tmp_path / "plain")) == 2  # a report a step: the comparison has losses to compare
    assert losses(tmp_path / "ckpt") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "model.path=/no/such/model: no mlx-lm model folder there"),
    (["--data", "/no/such/data"], "data.path=/no/such/data: no such folder"),
    (["--batch-size", "0"], "train.batch_size"),
])
def test_bad_input_is_one_line_naming_the_option(tmp_path, cli, args, message):
    proc = cli("train", "--iters", "1", *args, "--adapter-path", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "adapters.safetensors").exists()


def test_bf16_model_trains(tmp_path, cli):
    from mlx_lm import convert

    bf16 = tmp_path / "bf16"
    convert(str(TINY_MODEL), mlx_path=str(bf16), dtype="bfloat16")
    run = tmp_path / "run"
    proc = cli("train", "--model", str(bf16), "--iters", "2", *QUICK, "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [r["loss"] for r in _records(run) if r["type"] == "train"]
    assert losses and all(math.isfinite(loss) for loss in losses), losses  # reported, and neither NaN nor inf


def test_dora_on_a_quantized_base_fuses_and_stock_loads(tmp_path, cli):
    from mlx_lm import convert
    from mlx_lm.utils import load

    from meshtune.api import load_for_inference

    q = tmp_path / "q4"
    convert(str(TINY_MODEL), mlx_path=str(q), quantize=True, q_group_size=32, q_bits=4)
    run = tmp_path / "run"
    proc = cli("train", "--model", str(q), "--iters", "2", *QUICK, "--fine-tune-type", "dora",
               "--adapter-path", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "adapter_config.json").read_text())["loadable_by_mlx_lm"] is True
    ours, tok = load_for_inference(str(q), run)
    stock, _ = load(str(q), adapter_path=str(run))
    tokens = mx.array([tok.encode("What is 21 + 21?")])
    assert mx.allclose(ours(tokens), stock(tokens), atol=1e-3)
    fused = tmp_path / "fused"
    assert cli("fuse", "--adapter-path", str(run), "--save-path", str(fused), "--dequantize").returncode == 0
    merged, _ = load(str(fused))
    assert mx.allclose(merged(tokens), ours(tokens), atol=1e-3)
    assert "stock mlx-lm cannot load" not in proc.stdout
    # DoRA on the quantized (tied) embedding: stock cannot rebuild it, and the run says so as it starts.
    proc = cli("train", "--model", str(q), "--iters", "1", *QUICK, "--fine-tune-type", "dora",
               "--adapter.keys", "[model.embed_tokens, self_attn.q_proj]", "--adapter-path", str(tmp_path / "emb"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("note: stock mlx-lm cannot load the adapters of 1 layer (model.embed_tokens: DoRAEmbedding, ...)"
            in proc.stdout)
    assert json.loads((tmp_path / "emb" / "adapter_config.json").read_text())["loadable_by_mlx_lm"] is False


def test_overlapped_steps_train_exactly_as_steps_waited_for(tmp_path, cli):
    """runtime.overlap_steps dispatches each micro-batch while the one before still runs;
    the run's losses and adapters are those of a run that waits for every step (DoRA,
    dropout's random draws, two micro-batches a step, a save and an eval in between)."""
    args = [*QUICK, "--fine-tune-type", "dora", "--adapter.dropout", "0.1", "--train.grad_accumulation_steps", "2"]
    runs = {}
    for mode in ("true", "false"):
        runs[mode] = tmp_path / mode
        proc = cli("train", "--iters", "6", *args, "--runtime.overlap_steps", mode, "--adapter-path", str(runs[mode]))
        assert proc.returncode == 0, proc.stderr[-2000:]
    strip = lambda rs: [{k: v for k, v in r.items() if k in ("type", "step", "loss", "val_loss")} for r in rs]  # noqa: E731
    assert strip(_records(runs["true"])) == strip(_records(runs["false"]))
    assert len([r for r in _records(runs["true"]) if r["type"] == "train"]) == 4  # steps 2, 3 (a save), 4, 6
    for name in ("adapters.safetensors", "checkpoints/0000003/optimizer.safetensors"):
        assert (runs["true"] / name).read_bytes() == (runs["false"] / name).read_bytes(), name


def test_overlap_steps_takes_auto_true_or_false(tmp_path, cli):
    proc = cli("train", "--iters", "2", *QUICK, "--runtime.overlap_steps", "always", "--adapter-path", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "overlap_steps" in proc.stderr and "auto" in proc.stderr and "bool" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_dora_fold_takes_auto_true_or_false(tmp_path, cli):
    """adapter.dora_fold (the folded DoRA step on CUDA, auto by default): any other value is an error naming
    the option and its values, before anything is written."""
    proc = cli("train", "--iters", "2", *QUICK, "--adapter.dora_fold", "always", "--adapter-path", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "dora_fold" in proc.stderr and "auto" in proc.stderr and "bool" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_nonfinite_test_hook_takes_a_step_number(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("MESHTUNE_TEST_NONFINITE_STEP", "x")
    proc = cli("train", "--iters", "2", *QUICK, "--adapter-path", str(tmp_path / "r"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MESHTUNE_TEST_NONFINITE_STEP='x'" in lines[0] and "step number" in lines[0]
    assert not (tmp_path / "r").exists()


def test_adapters_start_from_a_trained_run_s(trained, tmp_path, cli):
    """--resume-adapter-file (adapter.init_from): step 0's validation loss is the trained run's last, same batches."""
    run, _ = trained
    new = tmp_path / "from"
    proc = cli("train", "--iters", "1", *QUICK, "--resume-adapter-file", str(run), "--adapter-path", str(new))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"adapters start from {run / 'adapters.safetensors'} (adapter.init_from)" in proc.stdout
    last = [r for r in _records(run) if r["type"] == "val"][-1]
    first = [r for r in _records(new) if r["type"] == "val"][0]
    assert first["step"] == 0 and first["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    fresh = [r for r in _records(run) if r["type"] == "val"][0]
    assert abs(fresh["val_loss"] - last["val_loss"]) > 1e-3  # the trained run moved: the test can tell
    bad = cli("train", "--iters", "1", "--adapter.init_from", str(tmp_path / "nothing"),
              "--adapter-path", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "adapter.init_from=" in bad.stderr and "no such file or folder" in bad.stderr


def test_adapters_of_another_kind_or_rank_to_start_from_are_one_line_naming_the_flags(trained, tmp_path, cli):
    run, _ = trained  # LoRA, rank 8
    for args, says in ((["--adapter.rank", "4"], "those are lora adapters of rank 8"),
                       (["--fine-tune-type", "dora"], "those are lora adapters of rank 8")):
        bad = cli("train", "--iters", "1", *args, "--adapter.init_from", str(run), "--adapter-path", str(tmp_path / "x"))
        assert bad.returncode == 2 and says in bad.stderr and "give --fine-tune-type lora --adapter.rank 8" in bad.stderr
        assert "loading model" not in bad.stdout  # before the load


def test_adapters_on_other_blocks_or_layers_to_start_from_are_one_line_naming_the_flags(trained, tmp_path, cli):
    run, _ = trained  # --num-layers -1: every block of the tiny model's 4
    bad = cli("train", "--iters", "1", "--num-layers", "2", "--adapter.init_from", str(run),
              "--adapter-path", str(tmp_path / "x"))
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "those adapters cover the last 4 of 4 blocks, this run 2" in bad.stderr
    assert "give --num-layers -1 to start from them" in bad.stderr and "loading model" not in bad.stdout
    same = cli("train", "--iters", "1", *QUICK[:2], "--num-layers", "4", "--adapter.init_from", str(run),
               "--adapter-path", str(tmp_path / "y"))  # 4 of 4 blocks is every block: the same layers
    assert same.returncode == 0, same.stderr[-2000:]


def test_a_run_whose_plan_does_not_fit_stops_before_loading_its_first_step(tmp_path):
    """runtime.memory_limit_gb below the plan: one line with the flags that make it fit, nothing written."""
    out = tmp_path / "run"
    proc = run_cli("train", "--iters", "1", "--adapter-path", str(out), "--runtime.memory_limit_gb", "0.001")
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
    assert proc.stderr.startswith("meshtune: error: this run's plan needs ~") and proc.stderr.count("\n") == 1, proc.stderr
    for flag in ("--runtime.memory_limit_gb gives 0.001 GB", "--grad-checkpoint", "--max-seq-length", "--num-layers",
                 "--parallel.pp", "--runtime.memory_limit_gb -1"):
        assert flag in proc.stderr, (flag, proc.stderr)
    assert not out.exists()
    ok = run_cli("train", "--iters", "1", "--adapter-path", str(out), "--runtime.memory_limit_gb", "4")
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_plan_refuses_a_missing_data_path_with_train_s_error(tmp_path, cli):
    missing = str(tmp_path / "nonexistent")
    planned = cli("plan", "--data", missing)
    trained = cli("train", "--data", missing, "--adapter-path", str(tmp_path / "run"))
    assert planned.returncode == trained.returncode == 2
    assert planned.stderr.splitlines()[-1] == trained.stderr.splitlines()[-1]
    assert planned.stderr.splitlines()[-1].startswith(f"meshtune: error: data.path={missing}: no such folder;")
