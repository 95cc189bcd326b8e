"""Pipeline parallelism: the `Pipeline` strategy, its stages and their schedule of transfers.

`Pipeline` is the strategy (training/strategy.py) for a mesh with pp > 1. This rank's stage is
stage.py's PipelineStage (its blocks, its hand-written backward, the links to its neighbours); the
cut into stages is split.py's and stage_cut.py's, the checkpoints and gathered weights state.py's.
Here `run_schedule` runs a stage's actions (schedules.py), `apply_gradients` makes the one update,
and `evaluate_stages` evaluates through the stages as training does. Reports give `bubble_share`,
measured: the share of the step a stage spends in its schedule's sends and receives (waiting for a
neighbour, the transfers included). docs/parallel/pipeline.md says what users see.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ...adapters import StepContext, trainable_parameters
from ...run_dir import RunDir
from ...training.checkpoint import LoadedCheckpoint, TrainingState
from ...training.evaluation import summed_loss
from ...training.losses import masked_ce_sum, target_mask
from ...training.strategy import WaitClock
from ...training.update import StepVerdict, apply_update, local_square_sum
from ...runtime.mesh import Mesh
from .peers import sum_on_peers
from .state import load_stage_checkpoint, resumable_step, save_stages, write_gathered
from .schedules import Schedule, build as build_schedule
from .stage import PipelineStage
from .stage_model import write_stage_model
from .split import check_pipeline_layout

if TYPE_CHECKING:
    from ...config import Config


MESSAGES = ("recv_act", "send_act", "recv_grad", "send_grad")


def run_schedule(stage: PipelineStage, actions: list, micro: list[tuple[mx.array, mx.array]],
                 clock: WaitClock | None = None) -> tuple[mx.array, Any]:
    """Run this stage's actions on micro-batches [(tokens, lengths)]; (loss sum, summed grads).

    Each action is evaluated on its own, in order: a send and a recv never share an eval.
    `clock` gets the seconds spent in sends and receives.
    """
    rank = stage.mesh.rank
    inputs: dict[int, mx.array] = {}
    outputs: dict[int, mx.array] = {}
    grads_in: dict[int, mx.array] = {}
    dxs: dict[int, mx.array] = {}
    total_grads, loss_sum = None, mx.array(0.0)
    for act in actions:
        tic = time.perf_counter() if clock is not None and act.kind in MESSAGES else None
        tokens, lengths = micro[act.mb]
        if act.kind == "recv_act":
            shape, dtype = stage.hidden_spec(tokens)
            inputs[act.mb] = stage.links.recv(shape, dtype, rank - 1)
            mx.eval(inputs[act.mb])
        elif act.kind == "fwd":
            x = tokens[:, :-1] if stage.first else inputs[act.mb]
            inputs[act.mb] = x
            if not stage.last:
                outputs[act.mb] = stage.forward(x, lengths)
                mx.eval(outputs[act.mb])
        elif act.kind == "send_act":
            mx.eval(stage.links.send(outputs.pop(act.mb), rank + 1))
        elif act.kind == "recv_grad":
            shape, dtype = stage.hidden_spec(tokens)
            grads_in[act.mb] = stage.links.recv(shape, dtype, rank + 1)
            mx.eval(grads_in[act.mb])
        elif act.kind == "bwd":
            value, grads, dx = stage.backward(inputs.pop(act.mb), tokens[:, 1:], lengths, grads_in.pop(act.mb, None))
            total_grads = grads if total_grads is None else tree_map(mx.add, total_grads, grads)
            if stage.last:
                loss_sum = loss_sum + value
            if dx is not None:
                dxs[act.mb] = dx
            mx.eval(total_grads, loss_sum, dx if dx is not None else [])
        elif act.kind == "send_grad":
            mx.eval(stage.links.send(dxs.pop(act.mb), rank - 1))
        if tic is not None:
            clock.add(time.perf_counter() - tic)
    return loss_sum, total_grads


def evaluate_stages(stage: PipelineStage, batches: Iterable[Any], beat: Callable[[], None] = lambda: None
                    ) -> tuple[float, int]:
    """Token-weighted loss over `batches` through the stages: (loss, global tokens), on every rank.

    Each batch's hidden states go forward stage by stage, as in training; the last stage of
    each replica adds its loss and target tokens, and one world all_sum shares them.
    """
    rank = stage.mesh.rank
    stage.model.eval()
    total, tokens = mx.array(0.0), mx.array(0)
    for batch in batches:
        x = batch.tokens[:, :-1]
        if not stage.first:
            shape, dtype = stage.hidden_spec(batch.tokens)
            x = stage.links.recv(shape, dtype, rank - 1)
            mx.eval(x)
        h = stage.hidden(x, batch.lengths)
        if stage.last:
            ce, n = masked_ce_sum(stage.head(stage.inner.norm(h)), batch.tokens[:, 1:], batch.lengths)
            total, tokens = total + ce, tokens + n
            mx.eval(total, tokens)
        else:
            mx.eval(stage.links.send(h, rank + 1))
        beat()
    stage.model.train()
    return summed_loss(stage.mesh, total, tokens)


def split_micro_batches(tokens: mx.array, lengths: mx.array, count: int) -> list[tuple[mx.array, mx.array]]:
    """The local batch cut into `count` equal micro-batches along the batch axis."""
    if tokens.shape[0] % count:
        raise ValueError(f"parallel.micro_batches={count} does not divide the local batch of {tokens.shape[0]}")
    size = tokens.shape[0] // count
    return [(tokens[i * size:(i + 1) * size], lengths[i * size:(i + 1) * size]) for i in range(count)]


def target_tokens(lengths: mx.array, width: int) -> mx.array:
    """Target tokens of a batch, from lengths alone (every stage can count them)."""
    return target_mask(lengths, width - 1).sum()


def sum_shared(stage: PipelineStage, grads: Any) -> Any:
    """Sum gradients over a stage's data-parallel peers and over the tied table's two copies.

    Where the backend splits groups (NCCL, MPI), each sum runs on its sub-group
    (peers.py). Ring and JACCL have no Group.split, so one world all_sum runs over a
    buffer with a slot for every trained parameter of the model (with dp 1, only the
    tied table's): each rank fills the slots of what it trains and leaves the rest zero,
    so each slot adds up exactly the ranks that hold that parameter. A tied table is held
    by the first and the last stage of every replica, so it gets the total of both uses.
    """
    keys = set(stage.tied_keys) if stage.mesh.dp == 1 else {k for k, _, _ in stage.all_params}
    if not keys:
        return grads
    if stage.peers is not None:
        return tree_unflatten(list(sum_on_peers(stage.peers, dict(tree_flatten(grads)), stage.tied_keys).items()))
    own = dict(tree_flatten(grads))
    slots = [(k, shape) for k, shape, _ in stage.all_params if k in keys]
    parts = [own[k].reshape(-1).astype(mx.float32) if k in own else mx.zeros((int(np.prod(shape)),), mx.float32)
             for k, shape in slots]
    total = stage.mesh.all_sum(mx.concatenate(parts))
    if not any(k in own for k, _ in slots):
        # Nothing of this rank's is in the sum (a stage that trains nothing), so nothing returned
        # depends on it; every rank must still take part in it, or the others wait for ever.
        mx.eval(total)
    out, start = dict(own), 0
    for k, shape in slots:
        size = int(np.prod(shape))
        if k in own:
            out[k] = total[start:start + size].reshape(shape).astype(own[k].dtype)
        start += size
    return tree_unflatten(list(out.items()))


def stage_gradients(stage: PipelineStage, schedule: Schedule, tokens: mx.array, lengths: mx.array,
                    micro_batches: int, clock: WaitClock | None = None) -> tuple[mx.array, Any, mx.array]:
    """(loss sum, summed gradients, local target tokens) of one batch through this stage."""
    micro = split_micro_batches(tokens, lengths, micro_batches)
    loss_sum, grads = run_schedule(stage, schedule[stage.stage], micro, clock)
    return loss_sum, grads, target_tokens(lengths, tokens.shape[1]).astype(mx.float32)


def apply_gradients(stage: PipelineStage, grads: Any, n_local: mx.array, optimizer: Any,
                    max_grad_norm: float = 0.0) -> StepVerdict:
    """Sum shared gradients, then the one update (training/update.py); returns its verdict.

    The global count adds every replica's tokens: each pipeline's last stage
    contributes its count to one world all_sum. The norm (for clipping and for the
    verdict, so taken every step) adds every stage's squares once (replica 0's, the
    tied table's first copy), as one process would: every rank sees the same norm.
    """
    mesh = stage.mesh
    n = mesh.all_sum(n_local if stage.last else mx.zeros_like(n_local)) if mesh.dp > 1 else n_local

    def square_sum(grads: Any) -> mx.array:
        counted = [g for k, g in tree_flatten(grads)
                   if mesh.dp_rank == 0 and (stage.first or k not in stage.tied_keys)]
        # each gradient's squares summed as one process sums them; the stages' parts added in float32
        return mesh.all_sum(mx.array(0.0) + local_square_sum(counted))

    grads = sum_shared(stage, grads)
    # Collectives pair up by the order each rank runs them. A replica other than the first
    # adds no squares, so its norm's all_sum would depend on nothing and could run before
    # the sums above: those finish first, on every rank.
    mx.eval(n, grads)
    def all_ranks(finite: mx.array) -> mx.array:
        # each stage checks the values it makes; one rank's non-finite value holds back every stage's update
        return mesh.all_sum((~finite).astype(mx.int32)) == 0

    verdict = apply_update(stage.model, optimizer, grads, n, max_grad_norm=max_grad_norm, square_sum=square_sum,
                           all_ranks=all_ranks)
    mx.eval(stage.model.state, optimizer.state, verdict.arrays())
    return verdict


def holdings_line(stage: PipelineStage) -> str:
    """What this rank's stage holds: its blocks, the end parts, and the bytes of all its weights."""
    parts = [f"blocks [{stage.start}, {stage.end})"]
    if "embed_tokens" in stage.inner and stage.first:
        parts.append("the embedding")
    if stage.last:
        parts.append("the norm and head" + (" (the tied embedding table)" if "lm_head" not in stage.model else ""))
    held = sum(v.nbytes for _, v in tree_flatten(stage.model.parameters()))
    return f"pipeline stage {stage.stage} holds {', '.join(parts)}: {held / 1e6:.3f} MB of weights and adapters"


class Pipeline:
    """The strategy of a mesh with pipeline stages: this rank trains its stage's blocks.

    Stage s of S owns blocks [start, end), balanced by parameter count or as
    `parallel.stage_layers` says; stage 0 also embeds, the last stage also norms, applies
    the head and computes the loss. Every rank holds only its stage's parts (stage_cut.py
    drops the others from the lazily loaded model before any weight is read; parameter names
    stay the whole model's), so the single-stage code (loss, optimizer, adapters) is reused.
    Supports mlx-lm decoder models laid out as model.model.{embed_tokens, layers, norm} with a
    head `model.lm_head` or a tied embedding (a trained tied table lives on the first and the
    last stage, its two gradients summed each step).

    Each step runs the schedule on every one of the step's batches (micro-batches
    inside each), adds up gradients and token counts, and updates with the last
    batch, so the step equals one process accumulating the same batches. Only the
    last stage returns non-zero loss sums (the reports add them over all ranks).
    """

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, mesh: Mesh, *, schedule: str,
                 micro_batches: int, stage_layers: list[int] | None = None, accumulation: int = 1,
                 max_grad_norm: float = 0.0, overlap: bool = False, transfer: str | None = None,
                 compile: bool = False, model_from: Path | str | None = None, step_context: StepContext | None = None):
        """`model_from`: with full fine-tuning, the base model (a folder or a hub id) whose config and
        tokenizer the trained model's folder takes (stage_model.py); None writes the adapters file alone."""
        self.model, self.optimizer, self.mesh, self.model_from = model, optimizer, mesh, model_from
        self.accumulation, self.max_grad_norm, self.overlap = accumulation, max_grad_norm, overlap
        self.keys = list(trainable_parameters(model))  # every stage's: taken before the stage freezes the others
        self.stage = PipelineStage(model, mesh.pp_rank, mesh.pp, mesh, stage_layers=stage_layers, transfer=transfer,
                                   compile=compile, step_context=step_context or StepContext())
        self.schedule, self.micro_batches = build_schedule(schedule, mesh.pp, micro_batches), micro_batches
        self.clock = WaitClock()

    @staticmethod
    def check(cfg: "Config", mesh: Mesh, model_path: Path) -> None:
        """Raise what this layout cannot run as `cfg` asks, before the model loads."""
        check_pipeline_layout(cfg, mesh.pp, mesh.world_size, model_path)

    @classmethod
    def from_config(cls, cfg: "Config", mesh: Mesh, model: nn.Module, optimizer: optim.Optimizer, *,
                    overlap: bool, say: Callable[[str], None], step_context: StepContext) -> "Pipeline":
        _, _, micro_batches = cfg.parallel_sizes(mesh.world_size)
        pipeline = cls(model, optimizer, mesh, schedule=cfg.parallel.schedule, micro_batches=micro_batches,
                       stage_layers=cfg.parallel.stage_layers, accumulation=cfg.train.grad_accumulation_steps,
                       max_grad_norm=cfg.train.max_grad_norm, overlap=overlap, compile=cfg.train.compile,
                       model_from=cfg.resolved_model_path() if cfg.adapter.fine_tune_type == "full" else None,
                       step_context=step_context)
        say(f"pipeline: {mesh.pp} stages, {cfg.parallel.schedule} schedule, {micro_batches} micro-batches")
        say("pipeline blocks per stage: " + ", ".join(f"{e - s} [{s}, {e})" for s, e in pipeline.stage.bounds))
        if mesh.dp_rank == 0:  # every stage says what it holds, so a launcher's log shows the division
            print(holdings_line(pipeline.stage), flush=True)
        return pipeline

    def step(self, batches: Iterator[Any]) -> tuple[list[tuple[mx.array, mx.array]], StepVerdict]:
        stage = self.stage
        grads, tokens, losses, verdict = None, mx.array(0.0), [], None
        for k in range(self.accumulation):
            batch = next(batches)
            loss, g, n = stage_gradients(stage, self.schedule, batch.tokens, batch.lengths, self.micro_batches,
                                         self.clock)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            tokens = tokens + n
            mx.eval(grads, tokens)
            if k == self.accumulation - 1:
                verdict = apply_gradients(stage, grads, tokens, self.optimizer, self.max_grad_norm)
            # The loss is the last stage's; the others report zeros.
            losses.append((loss, n.astype(mx.int32)) if stage.last else (mx.array(0.0), mx.array(0)))
            mx.eval(losses[-1])
        return losses, verdict

    def take_waits(self) -> dict[str, float]:
        return {"bubble": self.clock.take()}

    def evaluate(self, batches: Iterable[Any], beat: Callable[[], None] = lambda: None) -> tuple[float, int]:
        return evaluate_stages(self.stage, batches, beat)

    def write_weights(self, path: Path) -> None:
        write_gathered(path, self.stage, self.keys)
        if self.model_from is not None:  # full fine-tuning: the trained model too, each stage its shard
            write_stage_model(RunDir(path.parent).model, self.stage, self.model_from)

    def save(self, out: Path, state: TrainingState, *, config: dict[str, Any], keep: int) -> None:
        save_stages(out, self.stage, self.optimizer, state=state, config=config, keep=keep)  # each stage its shard

    def latest_checkpoint(self, out: Path, say: Callable[[str], None]) -> LoadedCheckpoint | None:
        found = resumable_step(out, self.stage, say)
        return None if found is None else load_stage_checkpoint(*found, self.stage)

    def restore(self, ckpt: LoadedCheckpoint) -> None:
        own = set(dict(tree_flatten(self.model.trainable_parameters())))
        # What this stage trains; the others' tensors of a whole-model checkpoint stay unread.
        self.model.load_weights([(k, v) for k, v in ckpt.trainable.items() if k in own], strict=False)
        self.optimizer.state = ckpt.optimizer_state
        self.optimizer.init(self.model.trainable_parameters())
