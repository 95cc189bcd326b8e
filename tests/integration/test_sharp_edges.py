"""Sharp edges, end to end: resume without flags, --num-layers past the model, generate's template
choice, fuse over an existing folder, mistyped mlx-lm flags."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from support import ARITH_DATA, TINY_MODEL

QUICK = ["--train.val_batches", "1", "--steps-per-eval", "100", "--save-every", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 steps on prompt/completion data with meshtune's defaults and --num-layers 32 (the model has 4)."""
    from support import run_cli

    out = tmp_path_factory.mktemp("edges") / "run"
    proc = run_cli("train", "--data", str(ARITH_DATA), "--iters", "4", "--num-layers", "32", *QUICK,
                   "--adapter-path", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_num_layers_past_the_model_adapts_all_blocks_with_one_note(run):
    out, proc = run
    notes = [l for l in proc.stdout.splitlines() if "--num-layers" in l]
    assert notes == ["note: adapter.num_layers 32 (--num-layers) is more than the model's 4 blocks: adapting all 4"]
    assert {k.split(".")[2] for k in mx.load(str(out / "adapters.safetensors"))} == {"0", "1", "2", "3"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["data_format"] == "completions" and config["num_layers"] == 4  # what was trained
    assert config["meshtune"]["train"]["batch_size"] == 4 and config["meshtune"]["data"]["mask_prompt"] is False


def test_resume_needs_only_the_adapter_path(run, tmp_path, cli):
    out, _ = run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "0000004")  # as if stopped after step 2
    proc = cli("train", "--adapter-path", str(copy), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from step 2" in proc.stdout and "step 4: train loss" in proc.stdout
    assert "--num-layers" not in proc.stdout  # said when the run started, not again
    assert (copy / "adapters.safetensors").read_bytes() == (out / "adapters.safetensors").read_bytes()
    changed = cli("train", "--adapter-path", str(copy), "--resume", "--iters", "6", "--batch-size", "8")
    assert changed.returncode == 2
    assert changed.stderr.splitlines() == [
        f"meshtune: error: command line: --resume: train.batch_size = 8 differs from the checkpoint's 4 "
        f"({copy}/checkpoints/0000004/config.yaml); drop --batch-size to resume with the run's own "
        "settings, or start a new run in another --adapter-path"]


def test_resume_with_iters_not_past_the_checkpoint_is_an_error(run, tmp_path, cli):
    out, _ = run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # its newest checkpoint is step 4
    for iters in ("2", "4"):
        proc = cli("train", "--adapter-path", str(copy), "--resume", "--iters", iters)
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"meshtune: error: --resume: --iters {iters} is not past the checkpoint's step 4 "
            f"({copy}/checkpoints/0000004); give --iters above 4 to train more"]
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["0000002", "0000004"]


def test_generate_picks_the_template_by_the_trained_format(run, tmp_path, cli):
    from mlx_lm import generate
    from mlx_lm.utils import load

    out, _ = run
    data = tmp_path / "text"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{a} + {a} = {2 * a}"}) + "\n"
                                                     for a in range(8)))
    text_run = tmp_path / "text_run"
    trained = cli("train", "--data", str(data), "--iters", "1", *QUICK, "--adapter-path", str(text_run))
    assert trained.returncode == 0, trained.stderr[-2000:]
    prompt = "3 + 3 ="
    raw = cli("generate", "--adapter-path", str(text_run), "--prompt", prompt, "--max-tokens", "3")
    assert raw.returncode == 0, raw.stderr[-2000:]
    assert raw.stderr.splitlines() == ["generate: raw prompt (the adapters were trained on text data; "
                                       "--chat forces the template)"]
    model, tok = load(str(TINY_MODEL), adapter_path=str(text_run))
    assert raw.stdout == generate(model, tok, prompt=tok.encode(prompt), max_tokens=3) + "\n"
    chat = cli("generate", "--adapter-path", str(out), "--prompt", prompt, "--max-tokens", "3")
    assert chat.returncode == 0 and chat.stderr.startswith("generate: chat template (the adapters were trained "
                                                           "on completions data")
    forced = cli("generate", "--adapter-path", str(out), "--prompt", prompt, "--max-tokens", "3", "--raw")
    assert forced.stderr.startswith("generate: raw prompt (--raw)")


def test_fuse_refuses_a_folder_with_files_unless_overwrite(run, tmp_path, cli):
    out, _ = run
    target = tmp_path / "fused"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    proc = cli("fuse", "--adapter-path", str(out), "--save-path", str(target))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"meshtune: error: --save-path {target} is a folder that already holds "
                                        "files; pass --overwrite to write the fused model over it, or choose "
                                        "another --save-path"]
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    proc = cli("fuse", "--adapter-path", str(out), "--save-path", str(target), "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "config.json").exists()


@pytest.mark.parametrize("args, line", [
    (["--lerning-rate", "1e-4"], "meshtune: error: command line: unknown option --lerning-rate; did you mean "
                                 "--learning-rate (--optimizer.learning_rate)?"),
    (["--dry-run"], "meshtune: error: command line: unknown option --dry-run; see meshtune train --help for every "
                    "option"),
])
def test_mistyped_flags_are_one_line_naming_the_flag(cli, args, line):
    proc = cli("train", "--data", str(ARITH_DATA), *args)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line]
