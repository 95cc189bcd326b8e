"""The whole run configuration: :class:`Config`, its sections, and the cross-field rules.

A run is described by a :class:`Config` (model, data, adapter, optimizer,
schedule, train, output, parallel, runtime; :mod:`meshtune.config.sections`), read
from YAML with :func:`~meshtune.config.load.load_config` or from a dict with
:meth:`Config.from_dict`, adjusted by ``--section.key value`` overrides, and
checked with :meth:`Config.validate`, which collects every problem and raises one
:class:`ConfigError` whose lines name the file and line (or option), the value and
the fix. mlx-lm ``lora_config.yaml`` files load too; see
:mod:`meshtune.config.mlx_lm_compat`.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .build import Built, build
from .fields import finite_float, type_problems
from .sections import (
    DEFAULT_DATA_PATH, DEFAULT_MODEL_PATH, OPTIMIZER_OPTIONS, SECTIONS, AdapterConfig, ConfigError, DataConfig,
    ModelConfig, OptimizerConfig, OutputConfig, ParallelConfig, RuntimeConfig, ScheduleConfig, TrainConfig,
)

# name -> (argument names, how many are required, indices that count steps)
_SCHEDULE_ARGS: dict[str, tuple[tuple[str, ...], int, tuple[int, ...]]] = {
    "constant": ((), 0, ()),
    "cosine_decay": (("init", "decay_steps", "end"), 2, (1,)),
    "linear_schedule": (("init", "end", "steps"), 3, (2,)),
    "exponential_decay": (("init", "decay_rate"), 2, ()),
    "step_decay": (("init", "decay_rate", "step_size"), 3, (2,)),
}


def is_local_path(text: str) -> bool:
    """Whether model.path / data.path `text` names a local path, not a hub id: it starts with /, . or ~
    (``./models/x`` is a folder even where none exists, which is then the error), or it exists."""
    return text.startswith(("/", ".", "~")) or Path(text).expanduser().exists()


def _source_path(text: str) -> Path:
    """A local path made absolute, or a hub id as given."""
    return Path(os.path.abspath(Path(text).expanduser())) if is_local_path(text) else Path(text)


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
        return cls.from_built(build(d, source))

    @classmethod
    def from_built(cls, built: Built) -> Config:
        """The config of a checked build (:func:`meshtune.config.build.build`)."""
        return cls(**built.sections, mapped=built.mapped, notes=built.notes, origins=built.origins)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain sections of plain values; ``from_dict`` of it gives an equal Config."""
        return {
            name: {f.name: copy.deepcopy(getattr(getattr(self, name), f.name)) for f in fields(cls)}
            for name, cls in SECTIONS.items()
        }

    def resolved_model_path(self) -> Path:
        """The model folder (absolute) or hub id, the shipped tiny model when model.path is ""."""
        return _source_path(self.model.path) if self.model.path else DEFAULT_MODEL_PATH

    def resolved_data_path(self) -> Path:
        """The data folder (absolute) or hub id, the shipped arithmetic data when data.path is ""."""
        return _source_path(self.data.path) if self.data.path else DEFAULT_DATA_PATH

    def with_absolute_paths(self) -> Config:
        """A copy whose model.path and data.path, where they name local paths, are absolute, so that
        what a run saves (its checkpoints' config, adapter_config.json, report.md) names them from
        any working directory: generate, fuse and --resume elsewhere find them."""
        cfg = copy.deepcopy(self)
        for section, key in ((cfg.model, "path"), (cfg.data, "path"), (cfg.adapter, "init_from")):
            if getattr(section, key):
                setattr(section, key, str(_source_path(getattr(section, key))))
        return cfg

    def parallel_sizes(self, world_size: int = 1) -> tuple[int, int, int]:
        """(dp, pp, micro_batches) with the 0 defaults resolved; validate first."""
        pp = self.parallel.pp
        dp = self.parallel.dp or max(world_size // max(pp, 1), 1)
        return dp, pp, self.parallel.micro_batches or pp

    def schedule_arguments(self) -> list[float | int]:
        """Positional arguments for the mlx schedule function ([] for constant).

        Unset arguments are derived (the run's schedule is built from these,
        training/optimizers.build_schedule): cosine_decay decays from learning_rate
        to 0 and linear_schedule goes linearly to 0, both over the steps after
        warmup.  Step counts come back as ints.
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
        mistyped = type_problems(self)
        if mistyped:
            raise ConfigError(mistyped)
        problems: list[str] = []

        def bad(option: str, value: Any, message: str) -> None:
            where = self.origins.get(option)
            problems.append(f"{where + ': ' if where else ''}{option} = {value!r}: {message}")

        self._check_ranges(bad)
        self._check_optimizer(bad)
        t, s = self.train, self.schedule
        if s.warmup >= t.iters >= 1:
            bad("schedule.warmup", s.warmup,
                f"must be less than train.iters ({t.iters}); lower --schedule.warmup or raise --iters")
        self._check_schedule_arguments(bad)
        self._check_parallel(bad, world_size)
        if problems:
            raise ConfigError(problems)

    def _check_ranges(self, bad: Any) -> None:
        """Each count, rate and name within its range: positive counts, a seed MLX takes, named fields."""
        t, a, s, p, d = self.train, self.adapter, self.schedule, self.parallel, self.data
        if p.pipeline_stages and p.pp != p.pipeline_stages:
            bad("parallel.pipeline_stages", p.pipeline_stages,
                f"parallel.pp = {p.pp} says otherwise; give --parallel.pp or --parallel.pipeline_stages, not both")
        for option, value in [
            ("train.iters", t.iters), ("train.batch_size", t.batch_size),
            ("train.grad_accumulation_steps", t.grad_accumulation_steps),
            ("train.steps_per_report", t.steps_per_report),
            ("train.steps_per_eval", t.steps_per_eval), ("train.save_every", t.save_every),
            ("data.pad_to", d.pad_to), ("data.max_seq_length", d.max_seq_length),
            ("parallel.pp", p.pp),
        ]:
            if value < 1:
                bad(option, value, f"must be at least 1; give a positive value, e.g. --{option} 1")
        if d.pack_length and not 2 <= d.pack_length <= d.max_seq_length:
            bad("data.pack_length", d.pack_length, f"must be 0 (picked from the data) or 2 to data.max_seq_length "
                f"({d.max_seq_length}); give --data.pack_length 0, or raise --max-seq-length")
        if a.fine_tune_type != "full" and a.rank < 1:
            bad("adapter.rank", a.rank, f"must be at least 1 for {a.fine_tune_type}; e.g. 8")
        if t.seed >= 2**32:
            bad("train.seed", t.seed, "must be below 2**32; pick a smaller seed")
        if t.divergence_reports < 0:
            bad("train.divergence_reports", t.divergence_reports,
                "must be 0 (never stop for a diverged loss) or a count of reports")
        if t.skip_nonfinite_steps < 0:
            bad("train.skip_nonfinite_steps", t.skip_nonfinite_steps,
                "must be 0 (stop at the first non-finite step) or a count of steps to skip")
        if t.val_batches < -1:
            bad("train.val_batches", t.val_batches, "must be -1 (the whole set), 0 (no validation) or a count")
        if t.test_batches != -1 and t.test_batches < 1:
            bad("train.test_batches", t.test_batches,
                "must be -1 (the whole set) or at least 1; --train.test false skips testing")
        for option, value in [
            ("parallel.dp", p.dp), ("parallel.micro_batches", p.micro_batches),
            ("output.keep_last_n", self.output.keep_last_n), ("train.seed", t.seed),
            ("schedule.warmup", s.warmup), ("schedule.warmup_init", s.warmup_init),
            ("train.max_grad_norm", t.max_grad_norm),
        ]:
            if value < 0:
                bad(option, value, f"must not be negative; --{option} 0 gives the default behaviour")
        if not 0 <= a.dropout < 1:
            bad("adapter.dropout", a.dropout, "must be in [0, 1); --adapter.dropout 0 disables dropout")
        if not p.bucket_mb > 0:
            bad("parallel.bucket_mb", p.bucket_mb, "must be positive; --parallel.bucket_mb 25 is a good start")
        if a.num_layers != -1 and a.num_layers < 1:
            bad("adapter.num_layers", a.num_layers, "must be -1 (all blocks) or at least 1")
        if a.keys is not None and (not a.keys or not all(a.keys)):
            bad("adapter.keys", a.keys, "must list module paths such as self_attn.q_proj; "
                "--adapter.keys null adapts every linear layer")
        for option in ("prompt_feature", "completion_feature", "text_feature", "chat_feature"):
            if not getattr(d, option):
                bad(f"data.{option}", "", "must name a JSONL field")
        if not self.output.adapter_path:
            bad("output.adapter_path", "", "must name a folder, e.g. adapters")

    def _check_optimizer(self, bad: Any) -> None:
        """The learning rate, weight decay and the options the optimizer takes."""
        o = self.optimizer
        if not (o.learning_rate > 0 and math.isfinite(o.learning_rate)):
            bad("optimizer.learning_rate", o.learning_rate, "must be a positive number, e.g. 1e-5")
        if o.weight_decay is not None:
            if o.weight_decay < 0:
                bad("optimizer.weight_decay", o.weight_decay, "must not be negative")
            elif o.name == "adam":
                bad("optimizer.weight_decay", o.weight_decay,
                    "adam has no weight decay; use --optimizer adamw, or --optimizer.weight_decay null")
        known = OPTIMIZER_OPTIONS[o.name]
        for key, value in o.options.items():
            numbers = value if isinstance(value, (list, tuple)) else [value]
            why = next((finite_float(float(v))[2] for v in numbers
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and not finite_float(float(v))[0]),
                       None)
            if why:
                bad(f"optimizer.options.{key}", value, why)
        for key in o.options:
            if key == "learning_rate":
                bad("optimizer.options", o.options,
                    "set the rate with --learning-rate (optimizer.learning_rate), not in options")
            elif key == "weight_decay":
                bad("optimizer.options", o.options, "set weight decay with --optimizer.weight_decay, not in options")
            elif key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                guess = f" (did you mean '{close[0]}'?)" if close else ""
                bad("optimizer.options", o.options,
                    f"{o.name} takes no option '{key}'{guess}; it takes {', '.join(sorted(known))}")

    def _check_schedule_arguments(self, bad: Any) -> None:
        s, lr = self.schedule, self.optimizer.learning_rate
        names, required, step_at = _SCHEDULE_ARGS[s.name]
        if s.arguments is None:
            if s.name in ("exponential_decay", "step_decay"):
                bad("schedule.arguments", None,
                    f"{s.name} needs its arguments [{', '.join(names)}]; give them as --schedule.arguments '[...]'")
            return
        if s.name == "constant":
            bad("schedule.arguments", s.arguments,
                "the constant schedule takes no arguments; --schedule.arguments null, or pick another --schedule.name")
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
                f"optimizer.learning_rate ({lr}); make them equal or derive them with --schedule.arguments null")

    def _check_parallel(self, bad: Any, world_size: int) -> None:
        p, batch = self.parallel, self.train.batch_size
        if world_size < 1:
            bad("world_size", world_size, "must be at least 1")
            return
        if p.pp < 1 or p.dp < 0 or p.micro_batches < 0 or batch < 1:
            return  # already reported; the arithmetic below needs sane values
        if p.dp == 0 and world_size % p.pp:
            divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
            fix = f"--parallel.pp {divisors[0]}" if len(divisors) == 1 else f"--parallel.pp N, N one of {divisors}"
            bad("parallel.pp", p.pp, f"does not divide the world size {world_size}; give {fix}")
            return
        dp = p.dp or world_size // p.pp
        if dp * p.pp != world_size:
            fix = (f"--parallel.dp {world_size // p.pp}, or --parallel.dp 0 to derive it" if world_size % p.pp == 0
                   else f"pick a --parallel.pp that divides {world_size} and --parallel.dp 0")
            bad("parallel.dp", p.dp,
                f"dp * pp = {dp} * {p.pp} = {dp * p.pp} but the world size is {world_size}; {fix}")
            return
        if batch % dp:
            below, above = batch // dp * dp, (batch // dp + 1) * dp
            nearest = f"{below} or {above}" if below else f"{above}"
            bad("train.batch_size", batch, f"must be divisible by the {dp} data-parallel ranks; "
                                           f"the nearest valid sizes are {nearest} (--batch-size)")
            return
        if p.stage_layers is not None and (len(p.stage_layers) != p.pp or min(p.stage_layers, default=0) < 1):
            bad("parallel.stage_layers", p.stage_layers,
                f"give {p.pp} block counts (one per stage of parallel.pp), each at least 1, "
                "or --parallel.stage_layers null")
        micro = p.micro_batches or p.pp
        if p.pp > 1 and (batch // dp) % micro:
            local = batch // dp
            bad("parallel.micro_batches", p.micro_batches,
                f"{micro} micro-batches do not divide the local batch {local} "
                f"(train.batch_size / dp); pick a divisor of {local} for --parallel.micro_batches")
