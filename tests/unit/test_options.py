"""Options users can find and defaults they know: --help listing, config YAML, mlx-lm defaults, hints, resume."""

from __future__ import annotations

from types import SimpleNamespace

import argparse
import json
from pathlib import Path

import pytest
import yaml

from meshtune.config import Config, ConfigError, describe_options, load_config
from meshtune.config import mlx_lm_compat as compat
from meshtune.config.resume import resume_config, saved_run_config
from meshtune.config.show import config_yaml, options_help

# Shared keys whose defaults differ on purpose, and why.
DIFFERENT_ON_PURPOSE = {
    "model": "meshtune's default is the tiny model it ships, not a hub download",
    "data": "meshtune's default is the arithmetic data it ships, not a hub dataset",
    "project_name": "mlx-lm's None and meshtune's '' both mean: no project named",
    "resume_adapter_file": "mlx-lm's None and meshtune's '' both mean: the adapters start from their initialisation",
}


def test_defaults_match_mlx_lm_key_by_key() -> None:
    from mlx_lm.lora import CONFIG_DEFAULTS

    ours = Config().to_dict()

    def value(dotted: str):
        section, _, key = dotted.partition(".")
        return ours[section][key]

    shared = [k for k in CONFIG_DEFAULTS if k in compat.FLAT_KEYS and k not in DIFFERENT_ON_PURPOSE]
    assert len(shared) >= 20, shared
    for key in shared:
        assert value(compat.FLAT_KEYS[key]) == CONFIG_DEFAULTS[key], key
    for sub, want in CONFIG_DEFAULTS["lora_parameters"].items():
        assert value(compat.NESTED_KEYS["lora_parameters"][sub]) == want, sub
    # The ones users quote, spelled out.
    cfg = Config()
    assert (cfg.train.batch_size, cfg.optimizer.learning_rate, cfg.train.iters) == (4, 1e-5, 1000)
    assert (cfg.data.mask_prompt, cfg.adapter.rank, cfg.adapter.scale, cfg.adapter.num_layers) == (False, 8, 20.0, 16)


def test_help_lists_every_key_by_section_with_type_default_and_doc() -> None:
    text = options_help()
    lines = text.splitlines()
    for dotted, _, default, doc in describe_options():
        at = next((i for i, l in enumerate(lines) if l.startswith(f"  --{dotted} ")), None)
        assert at is not None, dotted
        assert "(default " in lines[at] and lines[at + 1].startswith("      " + doc.split()[0]), lines[at:at + 2]
    assert "  --train.batch_size INT (default 4)\n      Global batch" in text
    assert "  --optimizer.learning_rate FLOAT (default 1e-05)\n      Peak learning rate" in text
    # the whole first sentence: the choices of report_to are not cut off
    assert "tensorboard, wandb, or both" in text.split("--output.report_to", 1)[1].split("--output.", 1)[0]
    assert "  --adapter.fine_tune_type {lora,dora,full} (default lora)" in text
    assert lines.index("model: The model to fine-tune.") < lines.index("runtime: Process-level settings.")
    for flag, key in compat.MLX_LM_FLAGS.items():
        assert f"{flag} -> {key}" in text or f"{flag}* -> {key}" in text, flag
    assert max(map(len, lines)) < 200


@pytest.mark.parametrize("source, overrides", [
    (None, []),
    (None, ["--iters", "7", "--learning-rate", "3e-4", "--adapter.keys", "[self_attn.q_proj]", "--mask-prompt"]),
    ("meshtune/configs/mlx_lm_style.yaml", ["--optimizer.options", "{betas: [0.8, 0.9]}"]),
    ("meshtune/configs/demo.yaml", ["--parallel.stage_layers", "[1, 3]", "--parallel.pp", "2"]),
])
def test_config_yaml_reads_back_to_the_same_config_and_text(tmp_path: Path, source, overrides) -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / source if source else None, overrides)
    text = config_yaml(cfg)
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    again = load_config(path)
    assert again == cfg and config_yaml(again) == text
    assert set(yaml.safe_load(text)) == set(cfg.to_dict())


@pytest.mark.parametrize("args, says, not_says", [
    (["--lerning-rate", "1e-4"], "unknown option --lerning-rate; did you mean --learning-rate "
                                 "(--optimizer.learning_rate)?", None),
    (["--dry-run"], "unknown option --dry-run", "needs a value"),
    (["--dry-run", "--iters", "3"], "unknown option --dry-run", "needs a value"),
    (["--mask-promt"], "did you mean --mask-prompt (--data.mask_prompt)?", "needs a value"),
    (["--batch_size", "8"], "did you mean --batch-size (--train.batch_size)?", None),
    (["--iters"], "option --iters needs a value", None),
    (["--train.iter", "5"], "did you mean --train.iters?", None),
    (["--lr-schedule", "cosine"], "mlx-lm's lr_schedule is a YAML mapping; here its entries are options: "
                                  "--schedule.name", "parallel.schedule"),
])
def test_mistyped_options_suggest_the_flag(args, says, not_says) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert says in str(e.value)
    assert not_says is None or not_says not in str(e.value)


@pytest.mark.parametrize("section, settings, flag", [
    ("schedule", {"schedule": {"warmup": 10}, "train": {"iters": 10}}, "--schedule.warmup"),
    ("optimizer", {"optimizer": {"weight_decay": 0.1}}, "--optimizer adamw"),
    ("schedule", {"schedule": {"name": "constant", "arguments": [1e-5]}}, "--schedule.arguments null"),
    ("adapter", {"adapter": {"keys": []}}, "--adapter.keys null"),
    ("parallel", {"parallel": {"dp": 2}}, "--parallel.dp 4"),
    ("train", {"train": {"test_batches": 0}}, "--train.test false"),
])
def test_config_problems_name_the_flag_that_fixes_them(section, settings, flag) -> None:
    with pytest.raises(ConfigError, match=section) as e:
        Config.from_dict(settings).validate(world_size=4)
    assert flag in str(e.value)


def _args(config: str | None = None, resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(config=config, resume=resume)


def test_data_or_model_without_config_gets_meshtune_defaults_and_bare_gets_the_demo() -> None:
    from meshtune.cli.commands import _train_config

    said: list[str] = []
    for rest in (["--data", "somewhere"], ["--model", "m"], ["--data.path=x", "--iters", "5"]):
        cfg = _train_config(_args(), rest, say=said.append)
        expected = Config().to_dict()
        assert cfg.train.batch_size == 4 and cfg.optimizer.learning_rate == 1e-5, rest
        assert cfg.data.mask_prompt is False and cfg.adapter.num_layers == expected["adapter"]["num_layers"]
    # --model alone trains on the embedded data, and says so; with --data nothing is said.
    assert said == ["note: no --data given: training on the embedded arithmetic data; pass --data with a "
                    "folder or a hub dataset id for your own"], said
    said.clear()
    demo = _train_config(_args(), ["--iters", "5"], say=said.append)
    assert (demo.train.batch_size, demo.train.iters, demo.data.mask_prompt) == (16, 5, True)
    assert said == ["note: no --model/--data/-c given: the embedded tiny model on the arithmetic data, "
                    "with the demo's settings (meshtune/configs/demo.yaml)"]


def _saved_run(tmp_path: Path, step: int = 4, **changes) -> Path:
    run = tmp_path / "run"
    saved = load_config(None, ["--data", "d", "--iters", str(step), "--adapter.rank", "4", "--batch-size", "8",
                               "--parallel.pp", "2"]).to_dict()
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        saved[section][key] = value
    (run / "checkpoints" / f"{step:07d}").mkdir(parents=True)
    (run / "checkpoints" / f"{step:07d}" / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run


def test_resume_takes_the_run_settings_from_the_checkpoint(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    saved, source = saved_run_config(run)
    assert source == str(run / "checkpoints" / "0000004" / "config.yaml")
    given = load_config(None, ["--adapter-path", str(run), "--output.resume", "true", "--iters", "10",
                               "--parallel.pp", "1"])
    cfg = resume_config(given, saved, source)
    assert (cfg.adapter.rank, cfg.train.batch_size, cfg.data.path, cfg.train.iters) == (4, 8, "d", 10)
    # Where this launch writes is its own; the checkpoint's pipeline stages give way to the flag given.
    assert cfg.parallel.pp == 1 and cfg.output.adapter_path == str(run) and cfg.output.resume
    same = load_config(None, ["--adapter-path", str(run), "--adapter.rank", "4", "--data", "./d"])
    assert resume_config(same, saved, source).data.path == "d"  # one folder, spelled two ways


def test_resume_refuses_a_changed_setting_naming_key_and_checkpoint_value(tmp_path: Path) -> None:
    run = _saved_run(tmp_path)
    given = load_config(None, ["--adapter-path", str(run), "--adapter.rank", "16", "--learning-rate", "1e-3"])
    with pytest.raises(ConfigError) as e:
        resume_config(given, *saved_run_config(run))
    assert len(e.value.problems) == 2
    assert "--resume: adapter.rank = 16 differs from the checkpoint's 4" in e.value.problems[0]
    assert "optimizer.learning_rate = 0.001 differs from the checkpoint's 1e-05" in e.value.problems[1]


def test_saved_run_config_falls_back_to_adapter_config(tmp_path: Path) -> None:
    assert saved_run_config(tmp_path / "nothing") is None
    (tmp_path / "adapter_config.json").write_text(json.dumps({"meshtune": {"train": {"iters": 3}}}))
    assert saved_run_config(tmp_path) == ({"train": {"iters": 3}}, str(tmp_path / "adapter_config.json"))


def test_num_layers_beyond_the_model_adapts_every_block(model_factory) -> None:
    from meshtune.adapters import apply_adapters
    from meshtune.adapters.apply import block_count, chosen_blocks

    model = model_factory(layers=2)
    assert block_count(model) == 2 and len(chosen_blocks(model, 32)) == 2 and len(chosen_blocks(model, 1)) == 1
    every = apply_adapters(model_factory(layers=2), fine_tune_type="lora", num_layers=-1, keys=None, rank=2,
                           scale=1.0, dropout=0.0)
    assert apply_adapters(model, fine_tune_type="lora", num_layers=32, keys=None, rank=2, scale=1.0,
                          dropout=0.0) == every


@pytest.mark.parametrize("env_rank, printed", [(None, True), ("0", True), ("1", False)])
def test_a_stopped_run_says_how_to_resume_once(tmp_path, env_rank, printed) -> None:
    from meshtune.api import RunResult
    from meshtune.cli.commands import continue_line

    run = tmp_path / "my run"
    result = RunResult(adapter_path=run, step=7, train_loss=None, val_loss=None, test_loss=None,
                       trained_tokens=0, stopped_early=True)
    # the writer is the mesh's rank 0 (a launcher's MLX_RANK 0, or one process)
    mesh = SimpleNamespace(world_size=1 if env_rank is None else 2, is_writer=env_rank in (None, "0"))
    line = continue_line(result, mesh, {} if env_rank is None else {"MLX_RANK": env_rank})
    again = "meshtune train" if env_rank is None else "meshtune launch -n 2 -- meshtune train"
    assert line == (f"to continue from step 7: {again} --adapter-path '{run}' --resume" if printed else None)


@pytest.mark.parametrize("recorded, flags, has_template, chat, why", [
    ("text", {}, True, False, "trained on text data"),
    ("chat", {}, True, True, "trained on chat data"),
    ("completions", {}, True, True, "trained on completions data"),
    (None, {}, True, True, "record no data format"),
    ("chat", {}, False, False, "no chat template"),
    ("completions", {"raw": True}, True, False, "--raw"),
    ("text", {"chat": True}, True, True, "--chat"),
])
def test_generate_uses_the_template_only_for_chat_or_completion_runs(tmp_path, recorded, flags, has_template,
                                                                      chat, why) -> None:
    from meshtune.prompt_format import choose_prompt_format, run_prompt_format

    (tmp_path / "adapter_config.json").write_text(json.dumps({} if recorded is None else {"data_format": recorded}))
    got = choose_prompt_format(run_prompt_format(tmp_path), has_template=has_template, has_adapters=True, **flags)
    assert got.chat == chat and why in got.why
    assert choose_prompt_format(run_prompt_format(None), has_template=has_template,
                                has_adapters=False).chat == has_template


def test_accumulation_says_what_iters_counts_here_and_in_mlx_lm() -> None:
    from meshtune.cli.commands import _train_config

    said: list[str] = []
    _train_config(_args(), ["--data", "d", "--iters", "30", "--grad-accumulation-steps", "2"], say=said.append)
    assert said == ["note: train.iters counts optimizer updates, each of 2 batches (grad_accumulation_steps): 30 "
                    "updates read 60 batches; mlx_lm.lora's --iters counts batches, so for its 30 give --iters 15"]
    said.clear()
    _train_config(_args(), ["--data", "d", "--iters", "30"], say=said.append)
    assert said == []


def test_resume_of_an_empty_folder_says_nothing_about_the_demo(tmp_path) -> None:
    from meshtune.cli.commands import _train_config

    said: list[str] = []
    cfg = _train_config(_args(resume=True), ["--adapter-path", str(tmp_path)], say=said.append)
    assert cfg.output.resume and not any("demo" in line for line in said), said
    _train_config(_args(), ["--adapter-path", str(tmp_path)], say=said.append)
    assert any("the demo's settings" in line for line in said)
