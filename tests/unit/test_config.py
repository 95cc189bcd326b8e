"""Tests for meshtune.config: strict loading, mlx-lm mapping, overrides, validation."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest
import yaml

import meshtune

from meshtune.config import (
    MLX_LM_FLAGS,
    MLX_LM_SWITCHES,
    OPTIMIZER_OPTIONS,
    SECTIONS,
    Config,
    ConfigError,
    apply_overrides,
    describe_options,
    field_help,
    load_config,
    parse_override_args,
)

CONFIGS = sorted((Path(__file__).parents[2] / "meshtune" / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def problems_of(excinfo: pytest.ExceptionInfo) -> list[str]:
    return excinfo.value.problems


def test_defaults_validate() -> None:
    cfg = Config()
    cfg.validate()
    assert cfg.optimizer.learning_rate == 1e-5
    assert cfg.adapter.keys is None and cfg.optimizer.options == {}
    assert load_config(None) == cfg
    Config.from_dict({"train": {"val_batches": 0}}).validate()  # 0 skips validation


def test_yaml_exponent_numbers_are_floats(tmp_path: Path) -> None:
    path = write(tmp_path, """
        optimizer:
          learning_rate: 1e-5
          options: {a: 1E5, b: -3e+2, c: 2.5}
    """)
    cfg = load_config(path)
    assert cfg.optimizer.learning_rate == 1e-5
    assert cfg.optimizer.options == {"a": 1e5, "b": -300.0, "c": 2.5}
    assert all(isinstance(v, float) for v in cfg.optimizer.options.values())
    # The float resolver lives on a subclass: the global SafeLoader is untouched.
    assert yaml.safe_load("1e-5") == "1e-5"


def test_shipped_configs_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "mlx_lm_style.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses_and_validates(path: Path) -> None:
    cfg = load_config(path)
    cfg.validate(world_size=1)
    assert cfg.resolved_model_path().name == "tiny-llama"
    assert cfg.resolved_data_path().name == "arithmetic"


def test_demo_config_values() -> None:
    cfg = load_config(Path(__file__).parents[2] / "meshtune" / "configs" / "demo.yaml")
    assert cfg.adapter.fine_tune_type == "lora" and cfg.adapter.num_layers == -1
    assert cfg.data.mask_prompt is True
    assert (cfg.train.iters, cfg.train.batch_size) == (1000, 16)
    assert cfg.optimizer.learning_rate == 2e-4  # "2e-4" in YAML must read as a float
    assert (cfg.train.steps_per_eval, cfg.train.save_every) == (250, 500)
    assert cfg.mapped == []


def test_mlx_lm_style_example_is_mapped() -> None:
    cfg = load_config(Path(__file__).parents[2] / "meshtune" / "configs" / "mlx_lm_style.yaml")
    assert "learning_rate -> optimizer.learning_rate" in cfg.mapped
    assert cfg.optimizer.name == "adamw"
    assert cfg.optimizer.weight_decay == 0.01
    assert cfg.optimizer.options == {"betas": [0.9, 0.98], "eps": 1e-6}
    assert cfg.schedule_arguments() == [1e-3, 180, 1e-5]


def test_unknown_key_names_file_line_and_nearest(tmp_path: Path) -> None:
    path = write(tmp_path, """
        # a comment
        model:
          path: ""
        train:
          batch_size: 4

          iter: 10
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:7: unknown key 'train.iter'; did you mean 'train.iters'?"


def test_unknown_keys_suggest_across_sections(tmp_path: Path) -> None:
    path = write(tmp_path, """
        adaptor:
          rank: 4
        train:
          learning_rate: 1e-4
          zzz: 1
        iter: 3
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    p = problems_of(e)
    assert p[0] == f"{path}:1: unknown key 'adaptor'; did you mean 'adapter'?"
    assert p[1] == f"{path}:4: unknown key 'train.learning_rate'; did you mean 'optimizer.learning_rate'?"
    assert p[2].startswith(f"{path}:5: unknown key 'train.zzz'; valid keys in 'train': iters, ")
    assert "did you mean 'iters' (mlx-lm spelling of train.iters)" in p[3]


def test_wrong_type_names_expected_type(tmp_path: Path) -> None:
    path = write(tmp_path, """
        train:
          iters: "ten"
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}:2: train.iters = 'ten' (str): expected int"


def test_bool_and_int_are_strict() -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict({
            "train": {"compile": 1, "test": 0, "iters": True, "batch_size": 1e3, "seed": "3"},
            "model": {"path": 5},
        }, "t.yaml")
    p = problems_of(e)
    assert "t.yaml: train.compile = 1 (int): expected bool: write true or false" in p
    assert "t.yaml: train.test = 0 (int): expected bool: write true or false" in p
    assert "t.yaml: train.iters = True (bool): expected int" in p
    assert "t.yaml: train.batch_size = 1000.0 (float): expected int: write 1000" in p
    assert "t.yaml: train.seed = '3' (str): expected int" in p
    assert "t.yaml: model.path = 5 (int): expected str: quote it" in p
    assert len(p) == 6


def test_ints_accepted_for_floats() -> None:
    cfg = Config.from_dict({"optimizer": {"learning_rate": 1}, "schedule": {"arguments": [1, 100]}})
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.schedule.arguments == [1.0, 100.0]
    with pytest.raises(ConfigError, match="expected float"):
        Config.from_dict({"optimizer": {"learning_rate": True}})


def test_choices_listed() -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"optimizer": {"name": "AdamW"}, "adapter": {"fine_tune_type": "qlora"}})
    p = problems_of(e)
    assert "optimizer.name = 'AdamW' (str): expected one of 'adam', 'adamw', 'sgd', 'adafactor', 'muon'; did you mean 'adamw'?" in p[0]
    assert "expected one of 'lora', 'dora', 'full'" in p[1]


def test_list_item_type_named() -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"adapter": {"keys": ["q_proj", 3]}})
    assert "item 1 = 3 (int): expected str" in str(e.value)
    with pytest.raises(ConfigError, match="expected list of str"):
        Config.from_dict({"adapter": {"keys": "q_proj"}})


def test_key_and_type_errors_collected_once(tmp_path: Path) -> None:
    path = write(tmp_path, """
        train:
          iter: 10
          compile: "yes"
        adapter: lora
        optimizer:
          learning_rate: fast
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    p = problems_of(e)
    assert len(p) == 4
    assert str(e.value).startswith("4 configuration problems:\n  - ")
    assert any("section 'adapter' must be a mapping" in x for x in p)


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        train:
          iters: 3
          keys: [a, b
        other: 1
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:4: YAML syntax error")
    assert "\n" not in str(e.value)


def test_duplicate_key_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  iters: 3\n  iters: 4\n")
    with pytest.raises(ConfigError, match=r":3: duplicate key 'train.iters' \(first at line 2\)"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    # An empty file (or one of comments) is refused rather than read as "all defaults" (issue: a run of
    # 1,000 default iterations from a file whose settings never got written).
    for text in ("", "# only a comment\n"):
        with pytest.raises(ConfigError, match="the config file is empty"):
            load_config(write(tmp_path, text))


@pytest.mark.parametrize("section, key, value, why", [
    ("optimizer", "learning_rate", float("nan"), "expected a finite number"),
    ("optimizer", "learning_rate", 1e39, "is inf in float32"),
    ("optimizer", "weight_decay", float("nan"), "expected a finite number"),
    ("schedule", "warmup_init", float("nan"), "expected a finite number"),
    ("train", "max_grad_norm", float("nan"), "expected a finite number"),
    ("adapter", "scale", float("nan"), "expected a finite number"),
    ("adapter", "scale", float("inf"), "expected a finite number"),
    ("schedule", "arguments", [1e-5, float("nan")], "item 1 = nan"),
])
def test_a_setting_that_is_not_finite_names_its_key(section, key, value, why) -> None:
    """nan, inf and numbers float32 cannot hold are refused when the config is read, before any model loads."""
    with pytest.raises(ConfigError) as e:
        Config.from_dict({section: {key: value}}, "t.yaml")
    assert any(p.startswith(f"t.yaml: {section}.{key} = ") and why in p for p in problems_of(e)), problems_of(e)


def test_a_non_finite_optimizer_option_names_its_key() -> None:
    cfg = Config.from_dict({"optimizer": {"name": "sgd", "options": {"momentum": float("nan")}}})
    with pytest.raises(ConfigError, match="optimizer.options.momentum = nan: expected a finite number"):
        cfg.validate()


def test_validate_reports_every_problem() -> None:
    cfg = Config.from_dict({
        "train": {"iters": 0, "batch_size": 0, "val_batches": -2, "test_batches": 0, "grad_accumulation_steps": 0, "max_grad_norm": -1.0,
                  "steps_per_report": 0, "steps_per_eval": 0, "save_every": 0},
        "adapter": {"rank": 0, "dropout": 1.0, "num_layers": 0},
        "data": {"pad_to": 0, "max_seq_length": 0},
        "optimizer": {"learning_rate": 0.0},
        "output": {"keep_last_n": -1},
    })
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    text = str(e.value)
    for option in [
        "train.iters = 0", "train.batch_size = 0", "train.grad_accumulation_steps = 0",
        "adapter.rank = 0", "train.steps_per_report = 0", "train.steps_per_eval = 0",
        "train.save_every = 0", "data.pad_to = 0", "data.max_seq_length = 0",
        "adapter.dropout = 1.0", "adapter.num_layers = 0", "optimizer.learning_rate = 0.0",
        "train.max_grad_norm = -1.0", "output.keep_last_n = -1",
        "train.val_batches = -2", "train.test_batches = 0",
    ]:
        assert option in text, option
    assert len(e.value.problems) == 16
    assert all("\n" not in p for p in e.value.problems)


def test_validate_names_origin(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  iters: 10\nschedule:\n  warmup: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(path).validate()
    assert str(e.value) == (
        f"{path}:4: schedule.warmup = 10: must be less than train.iters (10); "
        "lower --schedule.warmup or raise --iters"
    )


def test_validate_parallel() -> None:
    Config.from_dict({"parallel": {"pp": 2}, "train": {"batch_size": 8}}).validate(world_size=4)
    with pytest.raises(ConfigError, match=r"train.batch_size = 6: must be divisible by the 4 data-parallel ranks; the nearest valid sizes are 4 or 8"):
        Config.from_dict({"train": {"batch_size": 6}}).validate(world_size=4)
    with pytest.raises(ConfigError, match=r"dp \* pp = 2 \* 1 = 2 but the world size is 4"):
        Config.from_dict({"parallel": {"dp": 2}}).validate(world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.pp = 3: does not divide the world size 4"):
        Config.from_dict({"parallel": {"pp": 3}}).validate(world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.micro_batches = 3: 3 micro-batches do not divide the local batch 4"):
        Config.from_dict({"parallel": {"pp": 2, "micro_batches": 3}, "train": {"batch_size": 8}}).validate(world_size=4)
    # micro_batches 0 means pp, which must divide the local batch too.
    with pytest.raises(ConfigError, match="2 micro-batches do not divide the local batch 3"):
        Config.from_dict({"parallel": {"pp": 2}, "train": {"batch_size": 3}}).validate(world_size=2)
    assert Config.from_dict({"parallel": {"pp": 2}}).parallel_sizes(world_size=8) == (4, 2, 2)


def test_schedule_arguments() -> None:
    def check(schedule: dict, lr: float = 1e-5, iters: int = 100) -> Config:
        cfg = Config.from_dict({"schedule": schedule, "optimizer": {"learning_rate": lr}, "train": {"iters": iters}})
        cfg.validate()
        return cfg

    assert check({"name": "constant"}).schedule_arguments() == []
    assert check({"name": "cosine_decay", "warmup": 10}).schedule_arguments() == [1e-5, 90, 0.0]
    assert check({"name": "linear_schedule"}).schedule_arguments() == [1e-5, 0.0, 100]
    assert check({"name": "step_decay", "arguments": [1e-5, 0.9, 10]}).schedule_arguments() == [1e-5, 0.9, 10]
    with pytest.raises(ConfigError, match="the constant schedule takes no arguments"):
        check({"name": "constant", "arguments": [1e-5]})
    with pytest.raises(ConfigError, match=r"cosine_decay takes 2 to 3 arguments \[init, decay_steps, end\], got 4"):
        check({"name": "cosine_decay", "arguments": [1e-5, 10, 0, 1]})
    with pytest.raises(ConfigError, match="exponential_decay needs its arguments"):
        check({"name": "exponential_decay"})
    with pytest.raises(ConfigError, match=r"argument 1 \(decay_steps\) counts steps"):
        check({"name": "cosine_decay", "arguments": [1e-5, 10.5]})
    with pytest.raises(ConfigError, match="differs from optimizer.learning_rate"):
        check({"name": "cosine_decay", "arguments": [1e-4, 10]})


def test_learning_rate_taken_from_schedule_when_unset() -> None:
    cfg = Config.from_dict({"lr_schedule": {"name": "cosine_decay", "arguments": [1e-4, 100]}})
    cfg.validate()
    assert cfg.optimizer.learning_rate == 1e-4
    assert any("taken from lr_schedule.arguments[0]" in n for n in cfg.notes)


def test_full_fine_tune_with_keys_ignores_rank() -> None:
    Config.from_dict({"adapter": {"fine_tune_type": "full", "keys": ["mlp.gate_proj"], "rank": 0}}).validate()
    with pytest.raises(ConfigError, match="adapter.rank = 0: must be at least 1 for lora"):
        Config.from_dict({"adapter": {"rank": 0}}).validate()


def test_optimizer_options_checked() -> None:
    Config.from_dict({"optimizer": {"name": "adamw", "weight_decay": 0.1, "options": {"betas": [0.9, 0.95]}}}).validate()
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"optimizer": {"weight_decay": 0.1, "options": {"beta": [0.9, 0.95]}}}).validate()
    assert "adam has no weight decay" in e.value.problems[0]
    assert "adam takes no option 'beta' (did you mean 'betas'?)" in e.value.problems[1]


def test_overrides_parse_types() -> None:
    items = parse_override_args([
        "--optimizer.learning_rate", "1e-5", "--adapter.keys", "[q_proj, v_proj]",
        "--train.compile", "false", "--train.iters=20", "--model.path", "2024", "--train.test",
    ])
    d = apply_overrides({}, items)
    assert d == {
        "optimizer": {"learning_rate": 1e-5},
        "adapter": {"keys": ["q_proj", "v_proj"]},
        "train": {"compile": False, "iters": 20, "test": True},
        "model": {"path": "2024"},
    }
    cfg = Config.from_dict(d)
    assert isinstance(cfg.optimizer.learning_rate, float) and cfg.train.compile is False


def test_overrides_reject_unknown_and_bad_types() -> None:
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, [("--train.iter", "3"), ("--train.iters", "ten"),
                             ("--train.compile", "0")])
    assert e.value.problems == [
        "command line: unknown option --train.iter; did you mean --train.iters?",
        "command line: --train.iters = 'ten' (str): expected int",
        "command line: --train.compile = 0 (int): expected bool: write true or false",
    ]
    with pytest.raises(ConfigError, match="option --train.iters needs a value"):
        parse_override_args(["--train.iters"])


def test_mlx_lm_flags_are_overrides() -> None:
    cfg = load_config(None, parse_override_args(["--mask-prompt", "--iters", "5", "--learning-rate", "1e-3",
                                                 "--num-layers", "-1", "--adapter-path", "out"]))
    assert (cfg.data.mask_prompt, cfg.train.iters, cfg.optimizer.learning_rate) == (True, 5, 1e-3)
    assert (cfg.adapter.num_layers, cfg.output.adapter_path) == (-1, "out")


def test_overrides_win_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, "iters: 5\ntrain:\n  batch_size: 2\nlearning_rate: 1e-4\n")
    cfg = load_config(path, ["--train.iters", "7", "--optimizer.learning_rate", "1e-3"])
    assert (cfg.train.iters, cfg.train.batch_size, cfg.optimizer.learning_rate) == (7, 2, 1e-3)
    assert cfg.origins["train.iters"] == "command line"
    assert cfg.origins["train.batch_size"] == f"{path}:3"
    # The CLI hands over (dotted key, text) pairs.
    cfg = load_config(path, [("train.iters", "8"), ("output.overwrite", "true")])
    assert (cfg.train.iters, cfg.output.overwrite) == (8, True)
    cfg = load_config(path, {"train.iters": 9, "optimizer": {"name": "sgd"}})
    assert (cfg.train.iters, cfg.optimizer.name) == (9, "sgd")
    # apply_overrides drops the mlx-lm spelling it replaces rather than creating a conflict.
    d = apply_overrides({"iters": 5, "lora_parameters": {"rank": 4, "scale": 1.0}},
                        [("--train.iters", "6"), ("--adapter.rank", "2")])
    cfg = Config.from_dict(d)
    assert (cfg.train.iters, cfg.adapter.rank, cfg.adapter.scale) == (6, 2, 1.0)


def test_file_and_override_errors_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  iter: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["--train.itres", "3"])
    assert len(e.value.problems) == 2


MLX_LM_CONFIG = """
    model: "mlx_model"
    train: true
    fine_tune_type: lora
    training_mode: normal
    optimizer: adamw
    optimizer_config:
      adamw:
        betas: [0.9, 0.98]
        eps: 1e-6
        weight_decay: 0.05
      sgd:
        momentum: 0.9
    data: "/path/to/training/data"
    seed: 0
    num_layers: 16
    batch_size: 4
    iters: 1000
    val_batches: 25
    learning_rate: 1e-5
    steps_per_report: 10
    steps_per_eval: 200
    resume_adapter_file: null
    adapter_path: "adapters"
    save_every: 100
    test: false
    test_batches: 100
    max_seq_length: 2048
    grad_checkpoint: false
    clear_cache_threshold: 0
    report_to: null
    project_name: demo
    lora_parameters:
      keys: ["self_attn.q_proj", "self_attn.v_proj"]
      rank: 8
      scale: 20.0
      dropout: 0.0
    lr_schedule:
      name: cosine_decay
      warmup: 100
      warmup_init: 1e-7
      arguments: [1e-5, 1000, 1e-7]
"""


def test_mlx_lm_config_is_mapped(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MLX_LM_CONFIG, "lora_config.yaml"))
    cfg.validate()
    assert cfg.model.path == "mlx_model" and cfg.data.path == "/path/to/training/data"
    assert cfg.adapter.keys == ["self_attn.q_proj", "self_attn.v_proj"]
    assert (cfg.adapter.rank, cfg.adapter.scale, cfg.train.test_batches) == (8, 20.0, 100)
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.weight_decay == 0.05
    assert cfg.optimizer.options == {"betas": [0.9, 0.98], "eps": 1e-6}
    assert (cfg.schedule.name, cfg.schedule.warmup, cfg.schedule.warmup_init) == ("cosine_decay", 100, 1e-7)
    assert cfg.schedule_arguments() == [1e-5, 1000, 1e-7]
    for line in [
        "model -> model.path", "learning_rate -> optimizer.learning_rate", "iters -> train.iters",
        "lora_parameters.rank -> adapter.rank", "lr_schedule.arguments -> schedule.arguments",
        "optimizer_config.adamw -> optimizer.options",
        "optimizer_config.adamw.weight_decay -> optimizer.weight_decay",
        "adapter_path -> output.adapter_path",
    ]:
        assert line in cfg.mapped, line
    notes = "\n".join(cfg.notes)
    assert (cfg.output.report_to, cfg.output.project_name) == (None, "demo")
    for word in ["train: true ignored", "clear_cache_threshold ignored",
                 "training_mode: normal ignored", "optimizer_config.sgd ignored"]:
        assert word in notes, word


def test_mixed_flat_and_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "iters: 5\noptimizer: sgd\ntrain:\n  batch_size: 2\n")
    cfg = load_config(path)
    assert (cfg.train.iters, cfg.train.batch_size, cfg.optimizer.name) == (5, 2, "sgd")


def test_value_given_both_ways_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, """
        learning_rate: 1e-5
        optimizer:
          learning_rate: 1e-5
        lora_parameters:
          rank: 4
        adapter:
          rank: 4
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.problems[0] == (
        f"{path}:3: optimizer.learning_rate is given twice, as optimizer.learning_rate "
        f"and as learning_rate ({path}:1); keep only one"
    )
    assert "adapter.rank is given twice" in e.value.problems[1]


def test_resume_adapter_file_is_adapter_init_from(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "resume_adapter_file: adapters/adapters.safetensors\n"))
    assert cfg.adapter.init_from == "adapters/adapters.safetensors"
    assert "resume_adapter_file -> adapter.init_from" in cfg.mapped
    assert load_config(write(tmp_path, "resume_adapter_file: null\n", "ok.yaml")).adapter.init_from == ""
    assert load_config(None, ["--resume-adapter-file", "a.safetensors"]).adapter.init_from == "a.safetensors"


def test_other_rejected_mlx_lm_keys() -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"hf_dataset": [{"path": "a/b"}, {"path": "c/d"}], "train": False,
                          "training_mode": "dpo", "lora_parameters": {"alpha": 16}})
    text = str(e.value)
    assert "hf_dataset lists 2 datasets; meshtune trains on one" in text
    assert "train: false (mlx-lm's test-only mode): meshtune train always trains; score trained adapters with meshtune eval" in text
    assert "training_mode 'dpo' is not supported" in text
    assert "uses 'scale', not 'alpha'" in text


def test_mlx_lm_hf_dataset_maps_to_data_keys_with_mlx_lm_default_splits() -> None:
    cfg = Config.from_dict({"hf_dataset": {"path": "org/name", "prompt_feature": "q", "test_split": "test"}})
    assert (cfg.data.path, cfg.data.prompt_feature, cfg.data.test_split) == ("org/name", "q", "test")
    assert (cfg.data.train_split, cfg.data.valid_split) == ("train[:80%]", "train[-10%:]")  # mlx-lm's slices
    cfg = Config.from_dict({"hf_dataset": [{"name": "org/x", "valid_split": "validation"}]})
    assert (cfg.data.path, cfg.data.valid_split) == ("org/x", "validation")
    with pytest.raises(ConfigError, match="hf_dataset.config .load_dataset arguments. is not supported"):
        Config.from_dict({"hf_dataset": {"path": "org/x", "config": {"name": "sub"}}})
    with pytest.raises(ConfigError, match="did you mean 'hf_dataset.train_split'"):
        Config.from_dict({"hf_dataset": {"path": "org/x", "train_splt": "train"}})


def test_hf_dataset_naming_a_jsonl_folder_takes_its_files_not_mlx_lm_s_slices(tmp_path) -> None:
    from meshtune.data import check_source

    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    cfg = Config.from_dict({"hf_dataset": {"path": str(tmp_path), "text_feature": "text"}})
    assert (cfg.data.path, cfg.data.train_split, cfg.data.valid_split) == (str(tmp_path), "", "")
    check_source(cfg.data.path, {"train": cfg.data.train_split})
    # A slice given for a jsonl folder is refused before any model loads.
    with pytest.raises(ValueError, match=r"data.train_split='train\[:50%\]' applies to Hugging Face datasets"):
        check_source(str(tmp_path), {"train": "train[:50%]"})


def test_round_trip() -> None:
    cfg = Config.from_dict({
        "adapter": {"keys": ["q_proj"], "dropout": 0.1},
        "optimizer": {"name": "adamw", "weight_decay": 0.01, "options": {"betas": [0.9, 0.95]}},
        "schedule": {"name": "cosine_decay", "arguments": [1e-5, 500]},
        "parallel": {"pp": 2, "schedule": "gpipe"},
    })
    d = cfg.to_dict()
    assert set(d) == set(SECTIONS)
    assert Config.from_dict(d) == cfg
    assert Config.from_dict(d).to_dict() == d
    # Through YAML text too: what a saved config reads back as.
    path_cfg = Config.from_dict(yaml.safe_load(yaml.safe_dump(d)))
    assert path_cfg == cfg
    assert Config().to_dict() == Config.from_dict(Config().to_dict()).to_dict()
    # to_dict hands out copies.
    d["adapter"]["keys"].append("v_proj")
    assert cfg.adapter.keys == ["q_proj"]


def test_round_trip_through_file(tmp_path: Path) -> None:
    cfg = Config.from_dict({"optimizer": {"learning_rate": 3e-4}, "schedule": {"warmup_init": 1e-7}})
    path = tmp_path / "saved.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(path) == cfg


def test_field_help_and_descriptions() -> None:
    assert field_help("train", "iters") == "Optimizer steps to run."
    rows = describe_options()
    assert len(rows) == sum(len(v.__dataclass_fields__) for v in SECTIONS.values())
    assert all(help_text for *_, help_text in rows), [r for r in rows if not r[3]]
    assert ("train.batch_size", "int", 4, field_help("train", "batch_size")) in rows
    with pytest.raises(ConfigError, match="did you mean 'train.iters'"):
        field_help("train", "iter")


def test_mlx_lm_flags_target_real_options() -> None:
    for flag, dotted in MLX_LM_FLAGS.items():
        section, key = dotted.split(".")
        assert key in SECTIONS[section].__dataclass_fields__, flag
    switches = {f for f, d in MLX_LM_FLAGS.items()
                if SECTIONS[d.split(".")[0]].__dataclass_fields__[d.split(".")[1]].type == "bool"}
    assert switches == set(MLX_LM_SWITCHES)
    for flag in ["--model", "--data", "--adapter-path", "--iters", "--batch-size", "--fine-tune-type",
                 "--num-layers", "--learning-rate", "--max-seq-length", "--steps-per-eval",
                 "--steps-per-report", "--save-every", "--seed", "--val-batches",
                 "--grad-accumulation-steps", "--grad-checkpoint", "--mask-prompt", "--optimizer",
                 "--test", "--test-batches"]:
        assert flag in MLX_LM_FLAGS


def test_resolved_paths() -> None:
    cfg = Config()
    assert cfg.resolved_model_path() == Path(inspect.getfile(meshtune)).parent / "assets" / "tiny-llama"
    assert cfg.resolved_data_path() == Path(inspect.getfile(meshtune)).parent / "assets" / "data" / "arithmetic"
    cfg = Config.from_dict({"model": "some/model", "data": {"path": "data/x"}})
    assert cfg.resolved_model_path() == Path("some/model")
    assert cfg.resolved_data_path() == Path("data/x")


def test_optimizer_options_match_mlx() -> None:
    optim = pytest.importorskip("mlx.optimizers")
    classes = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD,
               "adafactor": optim.Adafactor, "muon": optim.Muon}
    for name, cls in classes.items():
        params = set(inspect.signature(cls.__init__).parameters) - {"self", "learning_rate"}
        assert params == OPTIMIZER_OPTIONS[name], name


def test_pipeline_stages_is_pp_under_its_long_name(tmp_path):
    from meshtune.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  pipeline_stages: 2\n")
    assert load_config(path).parallel.pp == 2
    path.write_text("parallel:\n  pipeline_stages: 2\n  pp: 3\n")
    cfg = load_config(path)
    with pytest.raises(ConfigError, match="parallel.pipeline_stages"):
        cfg.validate(world_size=6)


def test_resume_compares_a_key_the_checkpoint_lacks_with_its_default():
    """A checkpoint written before a config key existed resumes when this run keeps the key's default,
    and names the key when it does not."""
    from meshtune.config.resume import run_mismatches
    from meshtune.config import Config

    saved = Config().to_dict()
    del saved["data"]["skip_empty"]
    assert run_mismatches(Config().to_dict(), saved) == []
    changed = Config.from_dict({"data": {"skip_empty": True}}).to_dict()
    assert run_mismatches(changed, saved) == ["data.skip_empty"]
    saved["adapter"]["rank"] = 4
    assert run_mismatches(Config().to_dict(), saved) == ["adapter.rank"]


def test_negative_skip_nonfinite_steps_is_an_error():
    cfg = Config.from_dict({"train": {"skip_nonfinite_steps": -1}})
    with pytest.raises(ConfigError, match="train.skip_nonfinite_steps = -1: must be 0"):
        cfg.validate()


def test_resume_reads_a_checkpoint_s_relative_paths_from_here(tmp_path, monkeypatch):
    """A run saved before paths were saved absolute resumes from the folder it was started in."""
    from meshtune.config.resume import run_mismatches
    from meshtune.config import Config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    saved = Config.from_dict({"model": {"path": "models/tiny"}, "data": {"path": "./data"}}).to_dict()
    now = Config.from_dict(saved).with_absolute_paths().to_dict()
    assert now["model"]["path"] == str(tmp_path / "models" / "tiny") and now["data"]["path"] == str(tmp_path / "data")
    assert run_mismatches(now, saved) == []
    moved = Config.from_dict({**saved, "model": {"path": "/elsewhere"}}).with_absolute_paths().to_dict()
    assert run_mismatches(moved, saved) == ["model.path"]
    hub = Config.from_dict({"model": {"path": "org/model"}}).to_dict()  # a hub id stays as given
    assert Config.from_dict(hub).with_absolute_paths().model.path == "org/model"
    assert run_mismatches(hub, hub) == []


def test_a_run_s_adapter_config_json_reads_back_as_its_config_less_its_launch(tmp_path):
    """-c runs/x/adapter_config.json starts a new run with x's settings (mlx-lm's -c reads its own too)."""
    import json

    from meshtune.config import load_config

    ran = Config.from_dict({"train": {"iters": 7, "batch_size": 2}, "adapter": {"rank": 4},
                            "output": {"adapter_path": "runs/x", "resume": True}, "parallel": {"pp": 2},
                            "runtime": {"watchdog_s": 5}})
    saved = {"fine_tune_type": "lora", "num_layers": 16, "lora_parameters": {"rank": 4}, "model": "m", "data": "d",
             "loadable_by_mlx_lm": True, "data_format": "completions", "meshtune": ran.to_dict()}
    (tmp_path / "adapter_config.json").write_text(json.dumps(saved))
    cfg = load_config(tmp_path / "adapter_config.json")
    expected = ran.to_dict()
    expected["output"].update(adapter_path=Config().output.adapter_path, resume=False)
    expected["parallel"], expected["runtime"] = Config().to_dict()["parallel"], Config().to_dict()["runtime"]
    assert cfg.to_dict() == expected
