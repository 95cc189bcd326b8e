"""The Python API: finetune(cfg) -> RunResult; fuse, generate and evaluate_adapters (meshtune/inference.py).

`finetune` reads as its phases. Set up (`_set_up`, `_begin`): validate, pick the layout's strategy
(training/strategy.py) once from the mesh, load the model and add adapters, read this rank's data, build
the optimizer, restore a checkpoint when resuming; only then is the folder written. Fit (`_fit`): the
loop, which saves a checkpoint and the adapters on schedule and at the end. Finish (`_finish`): the
report and the run's last line. Everything after set-up goes through the strategy. The CLI calls only these.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import adapters as ad
from .adapters import BasePath, StepContext
from .adapters.apply import block_count
from .runtime.blas import describe_blas
from .runtime.cuda import attention_inputs_multiple
from .runtime.device_memory import detect
from .training.checkpoint import (CheckpointWriteError, NonFiniteValues, TrainingState, atomic_write_text,
                                  resumable_checkpoint, write_error)
from .config import Config
from .config.resume import run_mismatches
from .data import BatchIterator, check_packable
from .data.batches import padded_width
from .runtime.heap import keep_freed_memory
from .parallel.data_parallel import DataParallel
from .runtime.mesh import Mesh
from .parallel.pipeline.executor import Pipeline
from .run_data import TRAINING_WAYS_OUT, eval_batches, load_splits, warner
from .run_dir import PLOT_FILE, REPORT_FILE, RunDir
from .training.metrics import MetricsWriteError, Reporter, read_metrics
from .report import summary_line, write_report
from .training.trackers import open_trackers
from .training.optimizers import build_optimizer, build_schedule
from .runtime.outdir import check_free_space, check_writable, human_bytes
from .runtime.relaunch import resume_command
from .runtime.run_lock import FolderLock, lock_folder
from .training.forced_fault import with_forced_fault
from .training.divergence import Diverged, DivergenceWatch
from .training.loop import LoopSettings, NonFiniteStep, OutOfMemory, stop_if_requested, train
from .training import ATTENTION_CHUNK, ATTENTION_CHUNKED_FROM
from .training.attention import install_chunked_attention, needs_chunked_attention
from .training.grad_checkpoint import enable_grad_checkpoint
from .training.in_flight import overlaps_steps
from .training.strategy import Strategy
from .runtime.stop_signals import StopSignals
from .runtime.watchdog import Watchdog, heartbeat_folder
from .plan.row_length import packed_row_length
from .inference import complete, evaluate_adapters, fuse, generate, load_for_inference, load_model
from .prompt_format import recorded_prompt_format
from .preflight import (check_before_load, check_output_folder, check_plan_fits, fitting_advice, init_file,
                        no_checkpoint, on_writer)

__all__ = ["RunResult", "finetune", "complete", "evaluate_adapters", "fuse", "generate", "load_for_inference",
           "load_model"]


@dataclass(kw_only=True)
class RunResult:
    """What a finished (or stopped) run leaves behind."""

    adapter_path: Path
    step: int
    train_loss: float | None
    val_loss: float | None
    test_loss: float | None
    trained_tokens: int
    stopped_early: bool


def _prepare_model(cfg: Config, model_path: str, say: Callable[[str], None],
                   paths: BasePath) -> tuple[nn.Module, Any, StepContext]:
    """Load the base, pick the CPU activation, freeze and add adapters (their bases multiplying through `paths`);
    (model, tokenizer, the adapters' per-step work for the training step)."""
    if cfg.runtime.keep_freed_memory:
        keep_freed_memory()  # before the model's arrays: they and every step's reuse kept pages
    say(f"loading model {model_path}")
    # Lazily: a weight is read when first evaluated, after the plan's check and, on a pipeline
    # rank, after the other stages' parts are dropped (parallel/pipeline/stage_cut.py).
    model, tokenizer = load_model(model_path, cfg.model.trust_remote_code, lazy=True)
    if cfg.runtime.fast_cpu_activations and mx.default_device().type == mx.cpu:
        from .runtime.fastmath import install_fast_swiglu

        if install_fast_swiglu():
            say("CPU: SwiGLU uses meshtune's vectorised SiLU (runtime.fast_cpu_activations)")
    if needs_chunked_attention():
        install_chunked_attention()  # said once the data's rows are known (_say_chunked_attention)
    a = cfg.adapter
    blocks = block_count(model)
    # As --num-layers -1; mlx-lm refuses, but the intent is plain. Said only when the user set it (the
    # default, 16 as mlx-lm's, adapting all of a smaller model needs no word), and once: not on --resume.
    if a.num_layers > blocks and "adapter.num_layers" in cfg.origins and not cfg.output.resume:
        say(f"note: adapter.num_layers {a.num_layers} (--num-layers) is more than the model's {blocks} blocks: "
            f"adapting all {blocks}")
    touched = ad.apply_adapters(model, fine_tune_type=a.fine_tune_type, num_layers=a.num_layers,
                                keys=a.keys, rank=a.rank, scale=a.scale, dropout=a.dropout, lazy=True, base_path=paths)
    trainable = sum(v.size for v in ad.trainable_parameters(model).values())
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    say(f"{a.fine_tune_type} on {touched} layers: {trainable / 1e6:.3f}M trainable parameters "
        f"of {total / 1e6:.3f}M ({100 * trainable / max(total, 1):.2f}%)")
    if a.init_from and not cfg.output.resume:  # a resumed run's checkpoint holds the weights since
        start = init_file(a.init_from)
        ad.load_trainable(model, start)
        say(f"adapters start from {start} (adapter.init_from)")
    only_ours = ad.stock_unloadable(model)
    if only_ours:
        first, kind = next(iter(only_ours.items()))
        n = len(only_ours)
        say(f"note: stock mlx-lm cannot load the adapters of {n} layer{'s' * (n != 1)} ({first}: {kind}, ...); "
            "meshtune generate and fuse can, and the fused model loads anywhere")
    recomputed = (enable_grad_checkpoint(model.layers[0]),) if cfg.train.grad_checkpoint else ()
    return model, tokenizer, StepContext.for_run(dora_fold=a.dora_fold, recomputed=recomputed)


def finetune(cfg: Config, mesh: Mesh | None = None, *, log: Callable[[str], None] = print,
             show_progress: bool = True, stop: StopSignals | None = None) -> RunResult:
    """Fine-tune as `cfg` says on `mesh` (default: this one process): set up, fit, finish.

    `stop` records SIGTERM/SIGINT; the command line holds it from before set-up to after the report,
    so a signal at any moment is a stop request. Without one, the run takes them from its first step
    to its report."""
    mesh = mesh or Mesh.single()
    cfg.validate(world_size=mesh.world_size)
    cfg = cfg.with_absolute_paths()  # what the run saves names its model and data from anywhere
    say = log if mesh.is_writer else (lambda _line: None)
    out = Path(cfg.output.adapter_path)
    # One run per folder (runtime/run_lock.py): taken before the folder is read, held until the run ends.
    lock = on_writer(mesh, lambda: (check_writable(out), lock_folder(out, say))[1])
    try:
        run = _set_up(cfg, mesh, out, say)
        run = _begin(run, lock, stop)
        fitted, test_loss = _fit(run, show_progress=show_progress, stop=stop)
        return _finish(run, fitted, test_loss)
    finally:
        if lock is not None:
            lock.release()


@dataclass(kw_only=True)
class _Run:
    """What set-up hands the fit and the finish: the run's parts, built and checked, and where it starts."""

    cfg: Config
    mesh: Mesh
    out: Path
    say: Callable[[str], None]
    model: nn.Module
    optimizer: Any
    strategy: Strategy
    paths: BasePath  # how quantized bases multiply, and the crossovers measured so far
    batches: BatchIterator
    val_batches: Any
    test_batches: Any
    trackers: list[str]
    resolved: dict[str, Any]
    adapter_config: dict[str, Any]
    need: int  # bytes a save needs free: said when a save or a report fails for space
    start: TrainingState | None = None  # _begin's
    setup_bytes: int = 0  # what setup holds (weights, adapters, optimizer state): the rest of the peak is activations
    setup_peak: int = 0  # the load's peak


def _set_up(cfg: Config, mesh: Mesh, out: Path, say: Callable[[str], None]) -> _Run:
    """Check every input, load the model and the data, build the optimizer and the layout's strategy.
    Nothing is written to the folder (its lock held by the writer: finetune)."""
    # The one place the layout picks its strategy (training/strategy.py); below, only its interface.
    layout = Pipeline if mesh.pp > 1 else DataParallel
    on_writer(mesh, lambda: (check_output_folder(cfg, out), check_writable(out)))
    say(describe_blas())
    if mesh.world_size > 1:  # every rank says it is alive, so a launcher's log shows all of them
        stage = f", pipeline stage {mesh.pp_rank} of {mesh.pp}" if mesh.pp > 1 else ""
        print(f"rank {mesh.rank} of {mesh.world_size}: data-parallel rank {mesh.dp_rank} of {mesh.dp}{stage} "
              f"(pid {os.getpid()})", flush=True)

    # Seeds first: adapter initialisation draws from mlx's RNG.
    mx.random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    model_path, data_path = str(cfg.resolved_model_path()), str(cfg.resolved_data_path())
    trackers = check_before_load(cfg, mesh, layout, out)  # the data, layout, adapters, trackers, ranks
    paths = BasePath(cfg.adapter.base_path)  # how quantized bases multiply (adapters/base_path.py)
    kept = RunDir(out).base_path_record(mesh.rank)
    if cfg.output.resume and kept.exists():  # before apply_adapters measures any
        say(f"base path: {paths.adopt(json.loads(kept.read_text()))} measured crossovers from {kept}, "
            "as the run took them")
    machine = detect()  # the memory a rank may use, taken before the model takes its share
    model, tokenizer, step_context = _prepare_model(cfg, model_path, say, paths)
    need = 0  # bytes a save needs free: said when a save or a report fails for space
    if mesh.is_writer:  # the trainable size is known only now; still before step 1
        need = check_free_space(out, trainable_bytes=sum(v.nbytes for v in ad.trainable_parameters(model).values()),
                                optimizer=cfg.optimizer.name)
    cfg, data, batches = _training_data(cfg, mesh, model, tokenizer, say)
    longest = int(data.train.lengths.max(initial=0))
    check_plan_fits(cfg, mesh, longest, machine)
    _say_chunked_attention(cfg, longest, say)
    # Built before anything is written, so a split smaller than a batch stops the run with the folder untouched.
    val_batches = (eval_batches(data.valid, cfg, mesh, cfg.train.val_batches, TRAINING_WAYS_OUT)
                   if data.valid is not None and cfg.train.val_batches != 0 else None)
    test_batches = (eval_batches(data.test, cfg, mesh, cfg.train.test_batches, TRAINING_WAYS_OUT)
                    if cfg.train.test and data.test is not None else None)
    optimizer = _optimizer(cfg)
    resolved = cfg.to_dict()
    # adapter_config.json describes every layer of the model: taken before a pipeline rank drops the others'.
    # generate and serve frame prompts as the run trained (prompt_format.py).
    adapter_config = ad.mlx_lm_adapter_config(cfg.adapter, model_path=model_path, data_path=data_path, model=model,
                                              extra={"meshtune": resolved, **recorded_prompt_format(data.train)})
    # A pipeline rank holds and trains only its stage's parts from here on.
    strategy = layout.from_config(cfg, mesh, model, optimizer, overlap=overlaps_steps(cfg.runtime.overlap_steps),
                                  say=say, step_context=step_context)
    ad.settle_norms(model)  # DoRA's base norms, of the layers this rank holds: the first weights read
    return _Run(cfg=cfg, mesh=mesh, out=out, say=say, model=model, optimizer=optimizer, strategy=strategy,
                paths=paths, batches=batches, val_batches=val_batches, test_batches=test_batches, trackers=trackers,
                resolved=resolved, adapter_config=adapter_config, need=need)


def _say_chunked_attention(cfg: Config, longest: int, say: Callable[[str], None]) -> None:
    """Say that attention runs a chunk of queries at a time, where this run's longest unpacked row takes that path
    (training/attention.py; a packed row's mask goes to mlx-lm's own)."""
    # The model's inputs: one token fewer than the widest batch's columns.
    inputs = padded_width(longest, pad_to=cfg.data.pad_to, max_seq_length=cfg.data.max_seq_length) - 1
    if needs_chunked_attention() and not cfg.data.pack and inputs >= ATTENTION_CHUNKED_FROM:
        say(f"attention on rows of {ATTENTION_CHUNKED_FROM}+ tokens runs {ATTENTION_CHUNK} queries at a time "
            "(MLX has no fused attention backward on this device; memory linear in the row)")


def _training_data(cfg: Config, mesh: Mesh, model: nn.Module, tokenizer: Any, say: Callable[[str], None]
                   ) -> tuple[Config, Any, BatchIterator]:
    """The splits this rank reads and its training batches; the config with packed rows' picked length
    recorded (data.pack_length), so a resume packs the same rows."""
    if cfg.data.pack:
        check_packable(model)
    data = load_splits(cfg, tokenizer, mesh, need_valid=cfg.train.val_batches != 0, need_test=cfg.train.test,
                       ways_out=TRAINING_WAYS_OUT)
    # On CUDA, training batches widened for fused attention's backward (evaluation runs none); every
    # rank the same, or a pipeline's stages would disagree on activation shapes.
    multiple = attention_inputs_multiple(model)
    if len(set(mesh.all_ints(multiple or 0))) > 1:
        multiple = None
    row_length = cfg.data.max_seq_length
    if cfg.data.pack:  # what the data needs, unless the user said
        rows = packed_row_length(cfg, data.train.lengths)
        say(rows.line())
        row_length = rows.tokens
        if rows.picked:  # recorded in the run's config, so a resume packs the same rows
            cfg = replace(cfg, data=replace(cfg.data, pack_length=rows.tokens))
    batches = BatchIterator(data.train, batch_size=cfg.train.batch_size,
                            max_seq_length=row_length, pad_to=cfg.data.pad_to,
                            seed=cfg.train.seed, rank=mesh.dp_rank, world_size=mesh.dp, loop=True,
                            warn=warner(mesh), pack=cfg.data.pack, inputs_multiple_of=multiple)
    return cfg, data, batches


def _optimizer(cfg: Config) -> Any:
    """The optimizer with its learning-rate schedule, as the config names them."""
    schedule = build_schedule(name=cfg.schedule.name, arguments=cfg.schedule_arguments(),
                              warmup=cfg.schedule.warmup, warmup_init=cfg.schedule.warmup_init,
                              learning_rate=cfg.optimizer.learning_rate)
    o = cfg.optimizer
    return build_optimizer(name=o.name, learning_rate=schedule, weight_decay=o.weight_decay, options=o.options)


def _begin(run: _Run, lock: FolderLock | None, stop: StopSignals | None) -> _Run:
    """Restore the checkpoint (--resume) or start the optimizer afresh; then, every input checked, the
    first writes to the folder: an overwritten run cleared, the run's adapter_config.json."""
    cfg, mesh, out, model, optimizer = run.cfg, run.mesh, run.out, run.model, run.optimizer
    start = TrainingState(step=0, data_cursor=run.batches.state())
    if cfg.output.resume:
        start = _restore(out, run.strategy, run.batches, run.resolved, run.say)
        if mesh.is_writer:
            _drop_metrics_after(out, start.step)
        run.say(f"resumed from step {start.step} ({RunDir(out).checkpoints})")
    else:
        optimizer.init(model.trainable_parameters())
    strategy = with_forced_fault(run.strategy, done=start.step)  # a test hook, off unless its variable is set
    # What setup holds (weights, adapters, optimizer state): the rest of the peak is activations.
    mx.eval(model.parameters(), optimizer.state)
    setup_bytes, setup_peak = mx.get_active_memory(), mx.get_peak_memory()  # the load's peak included
    mx.reset_peak_memory()
    if stop is not None:  # a request during set-up ends the run here, before its first write to the folder
        stop_if_requested(stop, mesh, start.step)
    if mesh.is_writer:
        # Only now, with every input checked, does an overwrite remove the earlier run: all of it, before
        # the new run writes its first file.
        if cfg.output.overwrite and not cfg.output.resume and out.exists():
            lock.clear()
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RunDir(out).config, json.dumps(run.adapter_config, indent=2))
    return replace(run, start=start, strategy=strategy, setup_bytes=setup_bytes, setup_peak=setup_peak)


def _saver(run: _Run) -> Callable[[TrainingState], None]:
    """What the loop calls to save: the step's checkpoint, then the trained weights as the one adapters file."""
    cfg, mesh, out, strategy = run.cfg, run.mesh, run.out, run.strategy

    def save(state: TrainingState) -> None:
        """The step's checkpoint, then the trained weights as the one adapters file (a collective)."""
        strategy.save(out, state, config=run.resolved, keep=cfg.output.keep_last_n)
        crossovers = run.paths.measured()
        if crossovers:  # what --resume multiplies by on this rank (adapters/base_path.py)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(RunDir(out).base_path_record(mesh.rank), json.dumps(crossovers, indent=1))
        try:
            strategy.write_weights(RunDir(out).adapters)
        except OSError as err:
            raise CheckpointWriteError(write_error(out, err)) from None
    return save


def _fit(run: _Run, *, show_progress: bool, stop: StopSignals | None) -> tuple[Any, float | None]:
    """The training loop from the start step, with its reports, saves and evaluations; then the test split.
    Returns the loop's result and the test loss (None: not asked, or stopped early)."""
    cfg, mesh, out, strategy, start = run.cfg, run.mesh, run.out, run.strategy, run.start
    assert start is not None, "_begin sets the start step"
    validate = None
    if run.val_batches is not None:
        validate = lambda: strategy.evaluate(run.val_batches, beat=watchdog.alive)  # noqa: E731
    t = cfg.train
    settings = LoopSettings(iters=t.iters, steps_per_report=t.steps_per_report, steps_per_eval=t.steps_per_eval,
                            save_every=t.save_every, skip_nonfinite=t.skip_nonfinite_steps)
    watchdog = Watchdog(cfg.runtime.watchdog_s, mesh.rank, mesh.world_size, heartbeat_folder(out))
    run.model.train()
    signals = nullcontext(stop) if stop is not None else StopSignals()
    with watchdog, signals as stop, Reporter(out, total_steps=t.iters, start_step=start.step, writer=mesh.is_writer,
                                             log=run.say, show_progress=show_progress,
                                             trackers=open_trackers(run.trackers, out, config=run.resolved,
                                                                    project=cfg.output.project_name)) as reporter:
        # How to start these ranks again, for the report of a run that is cut off (no line printed).
        reporter.note("start", start.step, None, resume=resume_command(out, mesh))
        try:
            result = train(strategy, iter(run.batches), settings=settings, seed=t.seed, mesh=mesh, reporter=reporter,
                           start=start, validate=validate, save=_saver(run), cursor=run.batches.state, stop=stop,
                           beat=watchdog.beat, watch=DivergenceWatch(vocab_size=vocabulary_size(run.model),
                                                                      reports=t.divergence_reports))
        except (CheckpointWriteError, MetricsWriteError, Diverged, NonFiniteStep, NonFiniteValues,
                OutOfMemory) as err:
            raise with_last_good(err, out, cfg, run.need) from None
        test_loss = None
        if run.test_batches is not None and not result.stopped_early:
            test_loss, n = strategy.evaluate(run.test_batches, beat=watchdog.alive)
            reporter.eval(result.step, split="test", loss=test_loss, tokens=n, seconds=0.0)
    return result, test_loss


def _finish(run: _Run, result: Any, test_loss: float | None) -> RunResult:
    """The run's last lines and its report (report.md, loss.png, from metrics.jsonl), and what it left."""
    mesh, out = run.mesh, run.out
    run.say(f"adapters written to {RunDir(out).adapters}")
    if mesh.world_size > 1:
        peak = mx.get_peak_memory()
        # The peak since the process started: the load's included (a pipeline rank's shows its stage alone).
        print(f"rank {mesh.rank} finished at step {result.step} (peak memory "
              f"{max(peak, run.setup_peak) / 1e9:.4f} GB, activations {(peak - run.setup_bytes) / 1e9:.4f} GB)",
              flush=True)
    if mesh.is_writer:
        try:
            summary = write_report(out, run.resolved)
        except OSError as err:  # the adapters and checkpoints are written: only the report is missing
            raise CheckpointWriteError(f"{write_error(out, err)}; the run finished, only {REPORT_FILE} or "
                                       f"{PLOT_FILE} is missing (meshtune report --adapter-path {out} writes "
                                       "them again)") from None
        run.say(summary_line(summary, out, RunDir(out).adapters))
    return RunResult(adapter_path=out, step=result.step, train_loss=result.train_loss,
                     val_loss=result.val_loss, test_loss=test_loss, trained_tokens=result.trained_tokens,
                     stopped_early=result.stopped_early)


def _restore(out: Path, strategy: Strategy, batches: BatchIterator, resolved: dict[str, Any],
             say: Callable[[str], None]) -> TrainingState:
    """Load the newest intact checkpoint into model, optimizer and data cursor.

    Damaged ones (checksums, missing files) are skipped with a line each; a pipeline's
    ranks agree on the step and each stage loads what it trains (parallel/pipeline/state.py).
    The RNG needs no restoring: the loop reseeds it from (seed, step) every step.
    """
    ckpt = strategy.latest_checkpoint(out, say)
    if ckpt is None:
        found = RunDir(out).checkpoints.is_dir() and any(RunDir(out).checkpoints.iterdir())
        what = "no intact checkpoint (all were skipped, see above)" if found else "no checkpoint"
        raise ValueError(no_checkpoint(out, what))
    changed = run_mismatches(resolved, ckpt.config)
    if changed:
        defaults = Config().to_dict()
        pairs = [(k, *k.split(".")) for k in changed]
        values = "; ".join(f"{k} = {resolved[s][f]!r}, the checkpoint has "
                           f"{ckpt.config.get(s, {}).get(f, defaults[s][f])!r}" for k, s, f in pairs)
        raise ValueError(f"--resume: {', '.join(changed)} differ from the checkpoint in {ckpt.path} ({values}); "
                         "drop those flags to resume with the run's own settings, or start a new --adapter-path")
    step, iters = ckpt.state.step, resolved["train"]["iters"]
    if iters <= step:  # nothing left to train: finishing "at" the checkpoint would hide the typo
        raise ValueError(f"--resume: --iters {iters} is not past the checkpoint's step {step} ({ckpt.path}); "
                         f"give --iters above {step} to train more")
    strategy.restore(ckpt)
    batches.load_state(ckpt.state.data_cursor, changed_ok=resolved["data"]["changed_ok"])
    return ckpt.state


def _drop_metrics_after(out: Path, step: int) -> None:
    """Forget reports past the checkpoint: the resumed run reports those steps again."""
    path = RunDir(out).metrics
    if path.exists():  # read_metrics leaves out a last record cut off mid-write
        keep = [r for r in read_metrics(out) if r.get("step", 0) <= step]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def vocabulary_size(model: nn.Module) -> int | None:
    """The model's vocabulary size, from its mlx-lm arguments; None where it has none."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def with_last_good(err: Exception, out: Path, cfg: Config, need: int) -> Exception:
    """The error a run that stopped in its loop ends with: its own line and the checkpoint to resume from
    (the newest that verifies; for a diverged loss, the newest saved before it diverged)."""
    if isinstance(err, Diverged):
        found = resumable_checkpoint(out, say=lambda _line: None, before=err.since)
        last = f"{found} (resume with --resume)" if found else "none before it diverged (start again)"
        return Diverged(err.step, err.what, since=err.since, last_good=last)
    found = resumable_checkpoint(out, say=lambda _line: None)
    last = f"{found} (resume with --resume)" if found else "none yet (start again)"
    if isinstance(err, (CheckpointWriteError, MetricsWriteError)):  # a full disk: and the room to make
        return type(err)(f"{err}; a save needs about {human_bytes(need)} free; last good checkpoint: {last}")
    if isinstance(err, OutOfMemory):
        return OutOfMemory(err.step, err.what, advice=fitting_advice(cfg), last_good=last)
    return NonFiniteStep(err.step, err.what, last_good=last, applied=isinstance(err, NonFiniteValues))
