"""The meshtune run configuration: one typed, strict tree of small sections.

A run is described by a :class:`Config` (model, data, adapter, optimizer,
schedule, train, output, parallel, runtime), read from YAML with
:func:`load_config` or from a dict with :meth:`Config.from_dict`, adjusted
by ``--section.key value`` overrides, and checked with
:meth:`Config.validate`.  Loading is strict: unknown keys, wrong types and
bad choices are all collected and raised as one :class:`ConfigError` whose
lines name the file and line (or option), the value and the fix.  mlx-lm
``lora_config.yaml`` files load too; see :mod:`meshtune.config_compat`.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from . import config_compat as compat
from .config_compat import MLX_LM_FLAGS, MLX_LM_SWITCHES

__all__ = [
    "AdapterConfig", "Config", "ConfigError", "DataConfig", "MLX_LM_FLAGS",
    "MLX_LM_SWITCHES", "ModelConfig", "OptimizerConfig", "OutputConfig",
    "ParallelConfig", "RuntimeConfig", "ScheduleConfig", "SECTIONS", "TrainConfig",
    "apply_overrides", "describe_options", "field_help", "load_config",
    "parse_override_args",
]

ASSETS = Path(__file__).parent / "assets"
DEFAULT_MODEL_PATH = ASSETS / "tiny-llama"
DEFAULT_DATA_PATH = ASSETS / "data" / "arithmetic"


class ConfigError(ValueError):
    """One or more configuration problems, each a self-contained line."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} configuration problems:\n{lines}"
        super().__init__(message)


@dataclass(kw_only=True)
class ModelConfig:
    """The model to fine-tune."""

    path: str = ""
    """Local model folder; "" uses the tiny model shipped in meshtune/assets/tiny-llama."""
    trust_remote_code: bool = False
    """Let the tokenizer run code that ships with the model."""


@dataclass(kw_only=True)
class DataConfig:
    """The training data and how it becomes token batches."""

    path: str = ""
    """Folder with train/valid/test.jsonl; "" uses the arithmetic data in meshtune/assets/data/arithmetic."""
    max_seq_length: int = 2048
    """Longest sequence in tokens; longer examples are truncated."""
    mask_prompt: bool = False
    """Leave prompt tokens out of the loss (prompt/completion and chat data)."""
    pad_to: int = 32
    """Pad batch lengths up to a multiple of this many tokens."""
    prompt_feature: str = "prompt"
    """JSONL field holding the prompt of a prompt/completion example."""
    completion_feature: str = "completion"
    """JSONL field holding the completion of a prompt/completion example."""
    text_feature: str = "text"
    """JSONL field holding the text of a plain-text example."""
    chat_feature: str = "messages"
    """JSONL field holding the message list of a chat example."""


@dataclass(kw_only=True)
class AdapterConfig:
    """What is trained: LoRA/DoRA adapters or the full weights."""

    fine_tune_type: Literal["lora", "dora", "full"] = "lora"
    """lora, dora or full (train the weights of the chosen blocks)."""
    num_layers: int = 16
    """How many transformer blocks, counted from the last, to train; -1 trains all."""
    keys: list[str] | None = None
    """Module paths inside a block to adapt, e.g. [self_attn.q_proj, self_attn.v_proj];
    unset adapts every linear layer."""
    rank: int = 8
    """LoRA/DoRA rank (unused by full fine-tuning)."""
    scale: float = 20.0
    """Multiplier on the adapter output (mlx-lm's scale, not peft's alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer and its settings."""

    name: Literal["adam", "adamw", "sgd", "adafactor", "muon"] = "adam"
    """adam, adamw, sgd, adafactor or muon (the mlx.optimizers classes)."""
    learning_rate: float = 1e-5
    """Peak learning rate; a schedule starts from it (after warmup)."""
    weight_decay: float | None = None
    """Weight decay; unset keeps the optimizer's own default (adam has none)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the mlx optimizer, e.g. {betas: [0.9, 0.98], eps: 1e-6}."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """How the learning rate changes over the run."""

    name: Literal["constant", "cosine_decay", "linear_schedule", "exponential_decay", "step_decay"] = "constant"
    """constant or an mlx.optimizers.schedulers function name."""
    arguments: list[float] | None = None
    """Arguments of the schedule function, the initial rate first (as mlx-lm's
    lr_schedule.arguments); unset derives them from learning_rate and iters."""
    warmup: int = 0
    """Steps of linear warmup before the schedule starts."""
    warmup_init: float = 0.0
    """Learning rate at the first warmup step."""


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop."""

    iters: int = 1000
    """Optimizer steps to run."""
    batch_size: int = 4
    """Global batch: examples per step summed over all data-parallel ranks."""
    grad_accumulation_steps: int = 1
    """Batches whose gradients are summed before each optimizer update."""
    grad_checkpoint: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seed for shuffling, initialisation and dropout."""
    steps_per_report: int = 10
    """Steps between training-loss reports."""
    steps_per_eval: int = 200
    """Steps between validation runs."""
    val_batches: int = 25
    """Validation batches per evaluation; -1 uses the whole validation set, 0 skips validation."""
    save_every: int = 100
    """Steps between adapter checkpoints."""
    test: bool = False
    """Evaluate on test.jsonl after training."""
    test_batches: int = 500
    """Test batches to evaluate; -1 uses the whole test set."""
    compile: bool = True
    """Compile the training step with mx.compile."""


@dataclass(kw_only=True)
class OutputConfig:
    """Where results go."""

    adapter_path: str = "adapters"
    """Folder for adapter weights, checkpoints and the saved config."""
    resume: bool = False
    """Continue from the latest checkpoint in adapter_path."""
    overwrite: bool = False
    """Replace an earlier run found in adapter_path instead of refusing to start."""
    keep_checkpoints: int = 0
    """Numbered checkpoints to keep, newest first; 0 keeps all."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How the run is spread over the machines of a distributed group."""

    dp: int = 0
    """Data-parallel ranks; 0 derives world size / pp."""
    pp: int = 1
    """Pipeline stages the model is split into."""
    schedule: Literal["naive", "gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule: naive, gpipe or 1f1b."""
    micro_batches: int = 0
    """Micro-batches per local batch in the pipeline; 0 uses pp."""


@dataclass(kw_only=True)
class RuntimeConfig:
    """Process-level settings."""

    system_blas: bool = True
    """Use a system OpenBLAS on Linux when one is present."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "adapter": AdapterConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "output": OutputConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
}

# Keyword arguments of the mlx 0.32 optimizer constructors besides
# learning_rate, so a misspelt option fails at load time rather than after
# the model has loaded.
OPTIMIZER_OPTIONS: dict[str, frozenset[str]] = {
    "adam": frozenset({"betas", "eps", "bias_correction"}),
    "adamw": frozenset({"betas", "eps", "weight_decay", "bias_correction"}),
    "sgd": frozenset({"momentum", "weight_decay", "dampening", "nesterov"}),
    "adafactor": frozenset({"eps", "clip_threshold", "decay_rate", "beta_1", "weight_decay",
                            "scale_parameter", "relative_step", "warmup_init"}),
    "muon": frozenset({"momentum", "weight_decay", "nesterov", "ns_steps"}),
}

# name -> (argument names, how many are required, indices that count steps)
_SCHEDULE_ARGS: dict[str, tuple[tuple[str, ...], int, tuple[int, ...]]] = {
    "constant": ((), 0, ()),
    "cosine_decay": (("init", "decay_steps", "end"), 2, (1,)),
    "linear_schedule": (("init", "end", "steps"), 3, (2,)),
    "exponential_decay": (("init", "decay_rate"), 2, ()),
    "step_decay": (("init", "decay_rate", "step_size"), 3, (2,)),
}


@dataclass(kw_only=True)
class Config:
    """A whole meshtune run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    mapped: list[str] = field(default_factory=list, compare=False, repr=False)
    """mlx-lm keys read as meshtune ones, e.g. "learning_rate -> optimizer.learning_rate"."""
    notes: list[str] = field(default_factory=list, compare=False, repr=False)
    """Things the loader did that the user should hear about (ignored keys, derived values)."""
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Dotted key -> where its value was set ("run.yaml:7", "command line")."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, source: str = "<dict>") -> Config:
        """Build a config from sections and/or flat mlx-lm keys; strict."""
        return _build(d, source, {}, [], [])

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain sections of plain values; ``from_dict`` of it gives an equal Config."""
        return {
            name: {f.name: copy.deepcopy(getattr(getattr(self, name), f.name)) for f in fields(cls)}
            for name, cls in SECTIONS.items()
        }

    def resolved_model_path(self) -> Path:
        """The model folder, the shipped tiny model when model.path is ""."""
        return Path(self.model.path).expanduser() if self.model.path else DEFAULT_MODEL_PATH

    def resolved_data_path(self) -> Path:
        """The data folder, the shipped arithmetic data when data.path is ""."""
        return Path(self.data.path).expanduser() if self.data.path else DEFAULT_DATA_PATH

    def parallel_sizes(self, world_size: int = 1) -> tuple[int, int, int]:
        """(dp, pp, micro_batches) with the 0 defaults resolved; validate first."""
        pp = self.parallel.pp
        dp = self.parallel.dp or max(world_size // max(pp, 1), 1)
        return dp, pp, self.parallel.micro_batches or pp

    def schedule_arguments(self) -> list[float | int]:
        """Positional arguments for the mlx schedule function ([] for constant).

        Unset arguments are derived as meshtune.optimizers does: cosine_decay
        decays from learning_rate to 0 and linear_schedule goes linearly to
        0, both over the steps after warmup.  Step counts come back as ints.
        """
        s = self.schedule
        _, _, step_at = _SCHEDULE_ARGS[s.name]
        if s.name == "constant":
            return []
        if s.arguments is not None:
            args: list[float | int] = list(s.arguments)
        elif s.name == "cosine_decay":
            args = [self.optimizer.learning_rate, self.train.iters - s.warmup, 0.0]
        elif s.name == "linear_schedule":
            args = [self.optimizer.learning_rate, 0.0, self.train.iters - s.warmup]
        else:
            raise ConfigError(f"schedule.arguments is required for {s.name}; run validate() first")
        return [int(a) if i in step_at else a for i, a in enumerate(args)]

    def validate(self, world_size: int = 1) -> None:
        """Check every cross-field rule; raise one ConfigError listing all problems."""
        type_problems = _type_problems(self)
        if type_problems:
            raise ConfigError(type_problems)
        problems: list[str] = []

        def bad(option: str, value: Any, message: str) -> None:
            where = self.origins.get(option)
            problems.append(f"{where + ': ' if where else ''}{option} = {value!r}: {message}")

        t, a, o, s, p, d = self.train, self.adapter, self.optimizer, self.schedule, self.parallel, self.data
        for option, value in [
            ("train.iters", t.iters), ("train.batch_size", t.batch_size),
            ("train.grad_accumulation_steps", t.grad_accumulation_steps),
            ("train.steps_per_report", t.steps_per_report),
            ("train.steps_per_eval", t.steps_per_eval), ("train.save_every", t.save_every),
            ("data.pad_to", d.pad_to), ("data.max_seq_length", d.max_seq_length),
            ("parallel.pp", p.pp),
        ]:
            if value < 1:
                bad(option, value, "must be at least 1; set a positive value")
        if a.fine_tune_type != "full" and a.rank < 1:
            bad("adapter.rank", a.rank, f"must be at least 1 for {a.fine_tune_type}; e.g. 8")
        if t.seed >= 2**32:
            bad("train.seed", t.seed, "must be below 2**32; pick a smaller seed")
        if t.val_batches < -1:
            bad("train.val_batches", t.val_batches, "must be -1 (the whole set), 0 (no validation) or a count")
        if t.test_batches != -1 and t.test_batches < 1:
            bad("train.test_batches", t.test_batches, "must be -1 (the whole set) or at least 1; train.test false skips testing")
        for option, value in [
            ("parallel.dp", p.dp), ("parallel.micro_batches", p.micro_batches),
            ("output.keep_checkpoints", self.output.keep_checkpoints), ("train.seed", t.seed),
            ("schedule.warmup", s.warmup), ("schedule.warmup_init", s.warmup_init),
            ("train.max_grad_norm", t.max_grad_norm),
        ]:
            if value < 0:
                bad(option, value, "must not be negative; use 0 for the default behaviour")
        if not 0 <= a.dropout < 1:
            bad("adapter.dropout", a.dropout, "must be in [0, 1); 0 disables dropout")
        if a.num_layers != -1 and a.num_layers < 1:
            bad("adapter.num_layers", a.num_layers, "must be -1 (all blocks) or at least 1")
        if a.keys is not None and (not a.keys or not all(a.keys)):
            bad("adapter.keys", a.keys, "must list module paths such as self_attn.q_proj; "
                "leave it unset to adapt every linear layer")
        for option in ("prompt_feature", "completion_feature", "text_feature", "chat_feature"):
            if not getattr(d, option):
                bad(f"data.{option}", "", "must name a JSONL field")
        if not self.output.adapter_path:
            bad("output.adapter_path", "", "must name a folder, e.g. adapters")

        if not (o.learning_rate > 0 and math.isfinite(o.learning_rate)):
            bad("optimizer.learning_rate", o.learning_rate, "must be a positive number, e.g. 1e-5")
        if o.weight_decay is not None:
            if o.weight_decay < 0:
                bad("optimizer.weight_decay", o.weight_decay, "must not be negative")
            elif o.name == "adam":
                bad("optimizer.weight_decay", o.weight_decay,
                    "adam has no weight decay; use optimizer.name adamw or unset weight_decay")
        known = OPTIMIZER_OPTIONS[o.name]
        for key in o.options:
            if key == "learning_rate":
                bad("optimizer.options", o.options, "set the rate with optimizer.learning_rate, not in options")
            elif key == "weight_decay":
                bad("optimizer.options", o.options, "set weight decay with optimizer.weight_decay, not in options")
            elif key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                guess = f" (did you mean '{close[0]}'?)" if close else ""
                bad("optimizer.options", o.options,
                    f"{o.name} takes no option '{key}'{guess}; it takes {', '.join(sorted(known))}")

        if s.warmup >= t.iters >= 1:
            bad("schedule.warmup", s.warmup, f"must be less than train.iters ({t.iters}); shorten the warmup or train longer")
        self._check_schedule_arguments(bad)
        self._check_parallel(bad, world_size)
        if problems:
            raise ConfigError(problems)

    def _check_schedule_arguments(self, bad: Any) -> None:
        s, lr = self.schedule, self.optimizer.learning_rate
        names, required, step_at = _SCHEDULE_ARGS[s.name]
        if s.arguments is None:
            if s.name in ("exponential_decay", "step_decay"):
                bad("schedule.arguments", None, f"{s.name} needs its arguments [{', '.join(names)}]; set schedule.arguments")
            return
        if s.name == "constant":
            bad("schedule.arguments", s.arguments,
                "the constant schedule takes no arguments; remove them or pick another schedule.name")
            return
        if not required <= len(s.arguments) <= len(names):
            count = f"{required}" if required == len(names) else f"{required} to {len(names)}"
            bad("schedule.arguments", s.arguments,
                f"{s.name} takes {count} arguments [{', '.join(names)}], got {len(s.arguments)}")
            return
        for i in step_at:
            if i < len(s.arguments) and not (s.arguments[i] >= 1 and float(s.arguments[i]).is_integer()):
                bad("schedule.arguments", s.arguments,
                    f"argument {i} ({names[i]}) counts steps: use a whole number of at least 1")
        if not math.isclose(s.arguments[0], lr, rel_tol=1e-9):
            bad("schedule.arguments", s.arguments,
                f"the first argument (initial rate {s.arguments[0]}) differs from "
                f"optimizer.learning_rate ({lr}); make them equal or unset schedule.arguments")

    def _check_parallel(self, bad: Any, world_size: int) -> None:
        p, batch = self.parallel, self.train.batch_size
        if world_size < 1:
            bad("world_size", world_size, "must be at least 1")
            return
        if p.pp < 1 or p.dp < 0 or p.micro_batches < 0 or batch < 1:
            return  # already reported; the arithmetic below needs sane values
        if p.dp == 0 and world_size % p.pp:
            divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
            bad("parallel.pp", p.pp, f"does not divide the world size {world_size}; use one of {divisors}")
            return
        dp = p.dp or world_size // p.pp
        if dp * p.pp != world_size:
            fix = (f"set parallel.dp to {world_size // p.pp} or to 0 to derive it" if world_size % p.pp == 0
                   else f"pick a parallel.pp that divides {world_size} and set parallel.dp to 0")
            bad("parallel.dp", p.dp,
                f"dp * pp = {dp} * {p.pp} = {dp * p.pp} but the world size is {world_size}; {fix}")
            return
        if batch % dp:
            fix = (batch // dp + 1) * dp
            bad("train.batch_size", batch, f"must be divisible by the {dp} data-parallel ranks; use e.g. {fix}")
            return
        micro = p.micro_batches or p.pp
        if p.pp > 1 and (batch // dp) % micro:
            local = batch // dp
            bad("parallel.micro_batches", p.micro_batches,
                f"{micro} micro-batches do not divide the local batch {local} "
                f"(train.batch_size / dp); pick a divisor of {local}")


# ---------------------------------------------------------------------------
# Field types, help and suggestions

@functools.lru_cache(maxsize=None)
def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


@functools.lru_cache(maxsize=None)
def _all_help() -> dict[tuple[str, str], str]:
    # Field docstrings are string statements after the field; only the source has them.
    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except OSError:
        return {}
    classes = {cls.__name__: name for name, cls in SECTIONS.items()}
    found: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for stmt, after in zip(node.body, node.body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    found[(classes[node.name], stmt.target.id)] = " ".join(after.value.value.split())
    return found


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in SECTIONS for k in _field_types(s)]


def field_help(section: str, key: str) -> str:
    """The help text of ``section.key``, taken from its docstring."""
    if section not in SECTIONS or key not in _field_types(section):
        dotted = f"{section}.{key}"
        raise ConfigError(f"unknown option '{dotted}'{_did_you_mean(dotted, _all_keys())}")
    return _all_help().get((section, key), "")


def describe_options() -> list[tuple[str, str, Any, str]]:
    """(dotted key, type name, default, help) for every option, for --help output."""
    rows = []
    for section, cls in SECTIONS.items():
        default = cls()
        for key, tp in _field_types(section).items():
            rows.append((f"{section}.{key}", _type_name(tp), getattr(default, key), field_help(section, key)))
    return rows


def _did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _suggest_key(dotted: str, prefix: str = "") -> str:
    """'; did you mean ...?' for an unknown dotted key, or the valid keys."""
    section, _, key = dotted.partition(".")
    if section in SECTIONS:
        same = difflib.get_close_matches(key, list(_field_types(section)), n=1, cutoff=0.6)
        if same:
            return f"; did you mean '{prefix}{section}.{same[0]}'?"
        elsewhere = [s for s in SECTIONS if key in _field_types(s)]
        if elsewhere:
            return f"; did you mean '{prefix}{elsewhere[0]}.{key}'?"
        return f"; valid keys in '{section}': {', '.join(_field_types(section))}"
    return _did_you_mean(dotted, _all_keys(), prefix) or f"; sections are {', '.join(SECTIONS)}"


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """(ok, value as stored, why not).  Ints pass as floats; nothing else converts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return True, value, ""
        lowered = {str(a).lower(): a for a in args}
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
            hint = f"; did you mean {lowered[close[0]]!r}?" if close else ""
        return False, value, f"expected {_type_name(tp)}{hint}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None, ""
        results = [_coerce(value, a) for a in args if a is not type(None)]
        good = [r for r in results if r[0]]
        if good:
            return good[0]
        # With one real alternative its own message says more (e.g. which list item is wrong).
        return results[0] if len(results) == 1 else (False, value, f"expected {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            return False, value, f"expected {_type_name(tp)}, e.g. [a, b]"
        items = [_coerce(v, args[0]) for v in value]
        failed = [i for i, r in enumerate(items) if not r[0]]
        if failed:
            i = failed[0]
            return False, value, f"expected {_type_name(tp)}; item {i} = {_describe(value[i])}: {items[i][2]}"
        return True, [r[1] for r in items], ""
    if origin is dict or tp is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return True, copy.deepcopy(value), ""
        return False, value, "expected a mapping of names to values"
    if tp is Any:
        return True, value, ""
    if tp is bool:
        if isinstance(value, bool):
            return True, value, ""
        return False, value, "expected bool: write true or false"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        hint = f": write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        return False, value, f"expected int{hint}"
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value), ""
        return False, value, "expected float, e.g. 1e-5"
    if tp is str:
        if isinstance(value, str):
            return True, value, ""
        return False, value, "expected str: quote it"
    raise TypeError(f"unsupported config field type {tp!r}")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _type_problems(cfg: Config) -> list[str]:
    problems = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        if not isinstance(obj, SECTIONS[section]):
            problems.append(f"{section}: expected a {SECTIONS[section].__name__}, got {type(obj).__name__}")
            continue
        for key, tp in _field_types(section).items():
            ok, _, why = _coerce(getattr(obj, key), tp)
            if not ok:
                problems.append(f"{section}.{key} = {_describe(getattr(obj, key))}: {why}")
    return problems


# ---------------------------------------------------------------------------
# YAML

class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5, 1E5 and -3e+2 as floats, as mlx-lm does.

    A subclass, so yaml.SafeLoader itself stays untouched.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_error(e: yaml.YAMLError, name: str) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{name}:{mark.line + 1}" if mark is not None else name
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return ConfigError(f"{where}: YAML syntax error: {problem}{f' ({context})' if context else ''}; fix the YAML there")


def _read_yaml(text: str, name: str) -> tuple[Any, dict[str, int], list[str]]:
    """(data, dotted key -> line, duplicate-key problems)."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise _yaml_error(e, name) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    problems: list[str] = []

    def walk(n: yaml.Node, prefix: str) -> None:
        if not isinstance(n, yaml.MappingNode):
            return
        for key_node, value_node in n.value:
            path = f"{prefix}{key_node.value}" if isinstance(key_node, yaml.ScalarNode) else f"{prefix}?"
            line = key_node.start_mark.line + 1
            if path in lines:
                problems.append(f"{name}:{line}: duplicate key '{path}' (first at line {lines[path]}); keep one")
                continue
            lines[path] = line
            walk(value_node, path + ".")

    if node is not None:
        walk(node, "")
    return data, lines, problems


def _parse_scalar(text: str, tp: Any) -> Any:
    # A plain string option keeps its text: "--model.path 2024" or "--output.adapter_path yes" mean paths.
    if tp is str and text[:1] not in ("'", '"'):
        return text
    loader = _YamlLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------
# Building a Config

@dataclass
class _Setting:
    value: Any
    where: str
    spelled: str
    override: bool = False


def _resolve_overrides(
    items: list[tuple[str, Any]], source: str, parse: bool
) -> tuple[list[tuple[str, Any, str]], list[str]]:
    """Check override keys (and parse string values); ([(dotted, value, key)], problems)."""
    resolved, problems = [], []
    for raw_key, value in items:
        # mlx_lm.lora's own flags (--learning-rate, ...) mean the same as our keys.
        key = MLX_LM_FLAGS.get(str(raw_key), str(raw_key)).removeprefix("--")
        section, _, name = key.partition(".")
        dotted = f"{section}.{name.replace('-', '_')}"
        if section not in SECTIONS or dotted.partition(".")[2] not in _field_types(section):
            flat = compat.FLAT_KEYS.get(key.replace("-", "_"))
            hint = f"; did you mean --{flat}?" if flat else _suggest_key(dotted, "--").replace("'", "")
            problems.append(f"{source}: unknown option --{key}{hint}")
            continue
        tp = _field_types(section)[dotted.partition(".")[2]]
        if parse and isinstance(value, str):
            try:
                value = _parse_scalar(value, tp)
            except yaml.YAMLError as e:
                problems.append(f"{source}: --{dotted} {value!r}: cannot parse the value "
                                f"({getattr(e, 'problem', e)}); quote it for the shell, e.g. '[a, b]'")
                continue
        resolved.append((dotted, value, f"--{dotted}"))
    return resolved, problems


def _build(
    raw: Any,
    source: str,
    lines: dict[str, int],
    overrides: list[tuple[str, Any, str]],
    problems: list[str],
    override_source: str = "command line",
) -> Config:
    problems = list(problems)
    mapped: list[str] = []
    notes: list[str] = []
    settings: dict[str, _Setting] = {}

    def loc(path: str) -> str:
        return f"{source}:{lines[path]}" if path in lines else source

    def put(target: str, value: Any, spelled: str) -> None:
        old = settings.get(target)
        if old is not None and not old.override:
            problems.append(f"{loc(spelled)}: {target} is given twice, as {spelled} "
                            f"and as {old.spelled} ({old.where}); keep only one")
        elif old is None:
            settings[target] = _Setting(value, loc(spelled), spelled)

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(raw).__name__}")

    # Overrides go in first and win over anything the file says.
    for target, value, spelled in overrides:
        settings[target] = _Setting(value, override_source, spelled, override=True)

    optimizer_config = None
    for key, value in raw.items():
        if not isinstance(key, str):
            problems.append(f"{loc(str(key))}: key {key!r} is not a name; quote it or fix the typo")
        elif key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                dotted = f"{key}.{sub}"
                if isinstance(sub, str) and sub in _field_types(key):
                    put(dotted, v, dotted)
                else:
                    problems.append(f"{loc(dotted)}: unknown key '{dotted}'{_suggest_key(dotted)}")
        elif key in SECTIONS and value is None:
            continue  # an empty section
        elif key == "optimizer_config":
            optimizer_config = value
        elif compat.is_flat(key):
            result = compat.map_flat(key, value, loc)
            for target, v, spelled in result.assignments:
                put(target, v, spelled)
            mapped += result.mapped
            notes += result.notes
            problems += result.problems
        elif key in SECTIONS:
            problems.append(f"{loc(key)}: section '{key}' must be a mapping of keys "
                            f"({', '.join(_field_types(key))}), got {type(value).__name__}")
        else:
            close = difflib.get_close_matches(key, [*SECTIONS, *compat.flat_names()], n=1)
            if close and close[0] in compat.FLAT_KEYS:
                hint = f"; did you mean '{close[0]}' (mlx-lm spelling of {compat.FLAT_KEYS[close[0]]})?"
            elif close:
                hint = f"; did you mean '{close[0]}'?"
            else:
                hint = f"; sections are {', '.join(SECTIONS)}"
            problems.append(f"{loc(key)}: unknown key '{key}'{hint}")

    name = settings["optimizer.name"].value if "optimizer.name" in settings else "adam"
    result = compat.map_optimizer_config(optimizer_config, name, list(OPTIMIZER_OPTIONS), loc)
    for target, v, spelled in result.assignments:
        put(target, v, spelled)
    mapped += result.mapped
    notes += result.notes
    problems += result.problems

    # mlx-lm takes the rate from the schedule's first argument; keep that when no rate is given.
    args = settings.get("schedule.arguments")
    if (args is not None and "optimizer.learning_rate" not in settings and isinstance(args.value, list)
            and args.value and isinstance(args.value[0], (int, float)) and not isinstance(args.value[0], bool)):
        settings["optimizer.learning_rate"] = _Setting(args.value[0], args.where, f"{args.spelled}[0]")
        notes.append(f"optimizer.learning_rate = {args.value[0]} taken from {args.spelled}[0]")

    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for target, s in settings.items():
        section, _, key = target.partition(".")
        ok, value, why = _coerce(s.value, _field_types(section)[key])
        if ok:
            values[section][key] = value
        else:
            shown = s.spelled if s.spelled.lstrip("-") == target else f"{s.spelled} (-> {target})"
            problems.append(f"{s.where}: {shown} = {_describe(s.value)}: {why}")
    if problems:
        raise ConfigError(problems)
    cfg = Config(**{s: SECTIONS[s](**values[s]) for s in SECTIONS})
    cfg.mapped, cfg.notes = mapped, notes
    # "<dict>"-style sources say nothing a message could use.
    cfg.origins = {t: s.where for t, s in settings.items() if not s.where.startswith("<")}
    return cfg


def parse_override_args(tokens: list[str]) -> list[tuple[str, str]]:
    """Split ``["--train.iters", "10", "--train.compile=false"]`` into (key, text) pairs.

    A bool option given without a value means true.
    """
    items, problems = _split_override_args(tokens)
    if problems:
        raise ConfigError(problems)
    return items


def _split_override_args(tokens: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    items: list[tuple[str, str]] = []
    problems: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            problems.append(f"command line: unexpected argument {token!r}; options look like --section.key value")
            i += 1
            continue
        if "=" in token:
            key, _, text = token.partition("=")
            items.append((key, text))
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            items.append((token, tokens[i + 1]))
            i += 2
        else:
            section, _, name = token[2:].partition(".")
            is_switch = token in MLX_LM_SWITCHES or (
                section in SECTIONS and _field_types(section).get(name.replace("-", "_")) is bool)
            if is_switch:
                items.append((token, "true"))
            else:
                problems.append(f"command line: option {token} needs a value, e.g. {token} VALUE")
            i += 1
    return items, problems


def apply_overrides(
    cfg_dict: dict[str, Any], items: list[tuple[str, str]], source: str = "command line"
) -> dict[str, Any]:
    """Return a copy of ``cfg_dict`` with ``--section.key value`` items set.

    Values are read with the config's YAML scalar rules (``1e-5`` is a float,
    ``[a, b]`` a list, ``false`` a bool); text given for a str option stays
    as written.  Unknown keys and wrong types raise one ConfigError.  An
    mlx-lm spelling of the same option in ``cfg_dict`` is dropped: the
    override wins.
    """
    resolved, problems = _resolve_overrides(items, source, parse=True)
    out = copy.deepcopy(cfg_dict) if cfg_dict else {}
    for target, value, spelled in resolved:
        section, _, key = target.partition(".")
        ok, value, why = _coerce(value, _field_types(section)[key])
        if not ok:
            problems.append(f"{source}: {spelled} = {_describe(value)}: {why}")
            continue
        for flat, sub in compat.aliases_of(target):
            if sub is None and flat in out and not isinstance(out[flat], dict):
                del out[flat]
            elif sub is not None and isinstance(out.get(flat), dict):
                out[flat].pop(sub, None)
        if not isinstance(out.get(section), dict):
            out[section] = {}
        out[section][key] = value
    if problems:
        raise ConfigError(problems)
    return out


def load_config(
    path: str | Path | None,
    overrides: list[str] | list[tuple[str, str]] | dict[str, Any] | None = None,
) -> Config:
    """Read a YAML config (None: defaults), apply overrides, check keys and types.

    ``overrides`` is command-line text, either as tokens
    (``["--train.iters", "10"]``) or as (key, text) pairs
    (``[("train.iters", "10")]``), values parsed as YAML scalars; or a dict
    of typed values, keyed by dotted name or nested by section.  Cross-field rules are left to
    :meth:`Config.validate`, which needs the world size.
    """
    raw: Any = {}
    lines: dict[str, int] = {}
    problems: list[str] = []
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{source}: cannot read the config file ({e.strerror or e}); check the path") from None
        raw, lines, problems = _read_yaml(text, source)
    if overrides is None:
        resolved: list[tuple[str, Any, str]] = []
    elif isinstance(overrides, dict):
        flat_items: list[tuple[str, Any]] = []
        for key, value in overrides.items():
            if key in SECTIONS and isinstance(value, dict):
                flat_items += [(f"{key}.{k}", v) for k, v in value.items()]
            else:
                flat_items.append((key, value))
        resolved, more = _resolve_overrides(flat_items, "overrides", parse=False)
        problems += more
    else:
        pairs = [o for o in overrides if isinstance(o, tuple)]
        items, more = _split_override_args([o for o in overrides if not isinstance(o, tuple)])
        items = pairs + items
        resolved, even_more = _resolve_overrides(items, "command line", parse=True)
        problems += more + even_more
    return _build(raw, source, lines, resolved, problems,
                  "overrides" if isinstance(overrides, dict) else "command line")
