"""Pipeline stages: cut a model into contiguous blocks and run a schedule of transfers.

Stage s of S owns blocks [start, end), balanced by parameter count or as
`parallel.stage_layers` says; stage 0 also embeds, the last stage also norms, applies
the head and computes the loss.
Every rank keeps the full model object but trains only its own blocks (the others'
adapters are frozen), so the single-stage code (loss, optimizer, adapters) is reused.
No backend differentiates through send/recv, so a stage's backward is written by
hand: the last stage differentiates its loss; the others differentiate the surrogate
sum(y * stop_gradient(dy)) with the cotangent dy received from the next stage, and
send dx back. The backward recomputes the stage's forward (activation recomputation),
so only each micro-batch's stage input is kept between its forward and backward.
Supports mlx-lm decoder models laid out as model.model.{embed_tokens, layers, norm}
with a head `model.lm_head` or a tied embedding (a trained tied table lives on the
first and the last stage, its two gradients summed each step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from .mesh import Mesh
from ..adapters.step_norms import step_row_norms
from ..training.losses import masked_ce_sum, target_mask
from .p2p import Links
from .peers import peer_groups, sum_on_peers
from .schedules import Schedule


def balanced_split(costs: list[float], stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage, contiguous and none empty, that minimise the costliest stage.

    `costs` are the blocks' costs; the first stage also pays `first_extra` (the
    embedding) and the last `last_extra` (final norm and head), so with a large
    embedding or head those stages get fewer blocks. Exact (dynamic programming over
    cut points); ties go to the split with the smaller sum of squared stage costs.
    """
    n = len(costs)
    assert 1 <= stages <= n, (stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holding blocks [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    # best[s][j]: (max stage cost, sum of squares, cut) placing blocks [0, j) on stages 0..s
    best: list[dict[int, tuple[float, float, int]]] = [{j: (cost(0, 0, j), cost(0, 0, j) ** 2, 0)
                                                       for j in range(1, n - stages + 2)}]
    for s in range(1, stages):
        row = {}
        for j in range(s + 1, n - stages + s + 2):
            row[j] = min((max(best[-1][i][0], cost(s, i, j)), best[-1][i][1] + cost(s, i, j) ** 2, i)
                         for i in range(s, j))
        best.append(row)
    counts, j = [], n
    for s in range(stages - 1, -1, -1):
        i = best[s][j][2]
        counts.append(j - i)
        j = i
    return counts[::-1]


def check_stage_layers(stage_layers: list[int] | None, stages: int, num_layers: int) -> None:
    """Raise a ValueError naming the option when `stages` cannot hold `num_layers` blocks as asked."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"parallel.pp={stages} stages for a model of {num_layers} blocks; "
                         f"use between 1 and {num_layers} stages")
    if stage_layers is None:
        return
    if len(stage_layers) != stages or min(stage_layers) < 1:
        raise ValueError(f"parallel.stage_layers={stage_layers}: give {stages} block counts (one per stage), "
                         f"each at least 1")
    if sum(stage_layers) != num_layers:
        raise ValueError(f"parallel.stage_layers={stage_layers} sums to {sum(stage_layers)} but the model has "
                         f"{num_layers} blocks; make the counts add up to {num_layers} or unset it")


def stage_bounds(counts: list[int]) -> list[tuple[int, int]]:
    """Block ranges [start, end) from blocks per stage."""
    starts = np.cumsum([0, *counts]).tolist()
    return [(starts[s], starts[s + 1]) for s in range(len(counts))]


def _size(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(module.parameters()))


def split_stages(model: nn.Module, stages: int, stage_layers: list[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's block range: `stage_layers` when given, else balanced by parameter count.

    The embedding counts on the first stage, the final norm and head on the last (a
    tied head counts the table again: it computes there as well).
    """
    inner, _ = _parts(model)
    check_stage_layers(stage_layers, stages, len(inner.layers))
    if stage_layers is None:
        head = _size(model.lm_head) if "lm_head" in model else _size(inner.embed_tokens)
        stage_layers = balanced_split([_size(layer) for layer in inner.layers], stages,
                                      first_extra=_size(inner.embed_tokens), last_extra=_size(inner.norm) + head)
    return stage_bounds(stage_layers)


def _parts(model: nn.Module) -> tuple[nn.Module, Any]:
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, k) for k in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"pipeline parallelism needs an mlx-lm decoder laid out as model.model.embed_tokens/"
                         f"layers/norm; {type(model).__name__} is not; use parallel.pp 1")
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        raise ValueError("pipeline parallelism does not handle sliding-window attention layers yet; "
                         "use parallel.pp 1")
    head = model.lm_head if "lm_head" in model else inner.embed_tokens.as_linear
    return inner, head


@dataclass
class PipelineStage:
    """This rank's slice of the model and how it computes."""

    model: nn.Module
    stage: int
    stages: int
    mesh: Mesh
    stage_layers: list[int] | None = None
    """Blocks per stage; None balances them by parameter count (split_stages)."""
    transfer: str | None = None
    """Stage-to-stage transfers: "send", "all_sum" (for backends without send) or None
    to pick by the mesh's backend (p2p.Links)."""

    def __post_init__(self) -> None:
        from mlx.utils import tree_flatten

        self.inner, self.head = _parts(self.model)
        self.links = Links(self.mesh, self.transfer)
        # Every trained parameter of the whole model, in one order all ranks share.
        self.all_params = [(k, v.shape, v.dtype) for k, v in tree_flatten(self.model.trainable_parameters())]
        self.bounds = split_stages(self.model, self.stages, self.stage_layers)
        self.start, self.end = self.bounds[self.stage]
        # Train only this stage's blocks (and the embedding/head only where they live).
        for i, layer in enumerate(self.inner.layers):
            if not self.start <= i < self.end:
                layer.freeze()
        # A tied table is the first stage's lookup and the last stage's head: both train
        # their copy, and their gradients are summed every step (sum_shared) so the copies stay equal.
        embedding = [k for k, _, _ in self.all_params if k.startswith("model.embed_tokens.")]
        self.tied_keys = embedding if "lm_head" not in self.model and self.stages > 1 else []
        if not self.first and not (self.last and self.tied_keys):
            self.inner.embed_tokens.freeze()
        if not self.last:
            self.inner.norm.freeze()
            if "lm_head" in self.model:
                self.model.lm_head.freeze()
        # Sub-groups for sum_shared where the backend can split (None on ring and JACCL).
        self.peers = peer_groups(self.mesh, bool(self.tied_keys)) if self.mesh.dp > 1 or self.tied_keys else None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def hidden(self, x: mx.array) -> mx.array:
        """Token ids (stage 0) or hidden states in, this stage's hidden states out."""
        from mlx_lm.models.base import create_attention_mask

        h = self.inner.embed_tokens(x) if self.first else x
        mask = create_attention_mask(h, None)
        for layer in self.inner.layers[self.start:self.end]:
            h = layer(h, mask)
        return h

    def loss(self, h: mx.array, targets: mx.array, lengths: mx.array) -> mx.array:
        """The last stage's summed target-token cross entropy (the single-process loss)."""
        return masked_ce_sum(self.head(self.inner.norm(h)), targets, lengths)[0]

    def backward(self, x: mx.array, targets: mx.array, lengths: mx.array, dy: mx.array | None
                 ) -> tuple[mx.array, Any, mx.array | None]:
        """(value, parameter gradients, input gradient or None) for one micro-batch."""
        model = self.model

        def fn(params: Any, inp: mx.array) -> mx.array:
            model.update(params)
            h = self.hidden(inp)
            if self.last:
                return self.loss(h, targets, lengths)
            return (h * mx.stop_gradient(dy)).sum()  # seeds the reverse pass with the received cotangent

        # DoRA's row norms for the stage's layers first (a few launches on CUDA, none elsewhere).
        with step_row_norms(self.inner.layers[self.start:self.end], x.shape[0] * x.shape[1]):
            if self.first:  # token ids have no gradient
                value, grads = mx.value_and_grad(fn)(model.trainable_parameters(), x)
                return value, grads, None
            value, (grads, dx) = mx.value_and_grad(fn, argnums=(0, 1))(model.trainable_parameters(), x)
        return value, grads, dx

    def hidden_spec(self, tokens: mx.array) -> tuple[tuple[int, ...], mx.Dtype]:
        """Shape and dtype of the hidden states that cross a stage boundary."""
        return (tokens.shape[0], tokens.shape[1] - 1, self.inner.norm.weight.shape[0]), self.inner.norm.weight.dtype


def run_schedule(stage: PipelineStage, actions: list, micro: list[tuple[mx.array, mx.array]]
                 ) -> tuple[mx.array, Any]:
    """Run this stage's actions on micro-batches [(tokens, lengths)]; (loss sum, summed grads).

    Each action is evaluated on its own, in order: a send and a recv never share an eval.
    """
    rank = stage.mesh.rank
    inputs: dict[int, mx.array] = {}
    outputs: dict[int, mx.array] = {}
    grads_in: dict[int, mx.array] = {}
    dxs: dict[int, mx.array] = {}
    total_grads, loss_sum = None, mx.array(0.0)
    for act in actions:
        tokens, lengths = micro[act.mb]
        if act.kind == "recv_act":
            shape, dtype = stage.hidden_spec(tokens)
            inputs[act.mb] = stage.links.recv(shape, dtype, rank - 1)
            mx.eval(inputs[act.mb])
        elif act.kind == "fwd":
            x = tokens[:, :-1] if stage.first else inputs[act.mb]
            inputs[act.mb] = x
            if not stage.last:
                outputs[act.mb] = stage.hidden(x)
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
    return loss_sum, total_grads


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
    from mlx.utils import tree_flatten, tree_unflatten

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
    out, start = dict(own), 0
    for k, shape in slots:
        size = int(np.prod(shape))
        if k in own:
            out[k] = total[start:start + size].reshape(shape).astype(own[k].dtype)
        start += size
    return tree_unflatten(list(out.items()))


def stage_gradients(stage: PipelineStage, schedule: Schedule, tokens: mx.array, lengths: mx.array,
                    micro_batches: int) -> tuple[mx.array, Any, mx.array]:
    """(loss sum, summed gradients, local target tokens) of one batch through this stage."""
    micro = split_micro_batches(tokens, lengths, micro_batches)
    loss_sum, grads = run_schedule(stage, schedule[stage.stage], micro)
    return loss_sum, grads, target_tokens(lengths, tokens.shape[1]).astype(mx.float32)


def apply_gradients(stage: PipelineStage, grads: Any, n_local: mx.array, optimizer: Any,
                    max_grad_norm: float = 0.0) -> mx.array:
    """Sum shared gradients, divide by the global token count, clip, update; returns that count.

    The global count adds every replica's tokens: each pipeline's last stage
    contributes its count to one world all_sum. The clipping norm adds every stage's
    squares once (replica 0's, the tied table's first copy), as one process would.
    """
    mesh = stage.mesh
    n = mesh.all_sum(n_local if stage.last else mx.zeros_like(n_local)) if mesh.dp > 1 else n_local
    grads = sum_shared(stage, grads)
    grads = tree_map(lambda g: g / n.astype(g.dtype), grads)
    if max_grad_norm > 0:
        from mlx.utils import tree_flatten, tree_unflatten

        flat = dict(tree_flatten(grads))
        counted = [g for k, g in flat.items() if mesh.dp_rank == 0 and (stage.first or k not in stage.tied_keys)]
        square = sum((g.astype(mx.float32).square().sum() for g in counted), mx.array(0.0))
        scale = mx.minimum(max_grad_norm / (mx.sqrt(mesh.all_sum(square)) + 1e-6), 1.0)  # optim.clip_grad_norm's
        grads = tree_unflatten([(k, g * scale.astype(g.dtype)) for k, g in flat.items()])
    optimizer.update(stage.model, grads)
    mx.eval(stage.model.state, optimizer.state)
    return n


def pipeline_step(stage: PipelineStage, schedule: Schedule, tokens: mx.array, lengths: mx.array,
                  micro_batches: int, optimizer: Any) -> tuple[mx.array, mx.array]:
    """One optimizer step on one batch; (global token-weighted loss, local tokens)."""
    loss_sum, grads, n_local = stage_gradients(stage, schedule, tokens, lengths, micro_batches)
    n = apply_gradients(stage, grads, n_local, optimizer)
    # Only last stages have the loss; a world all_sum gives it to everyone.
    loss = stage.mesh.all_sum(loss_sum if stage.last else mx.zeros_like(loss_sum)) / n
    mx.eval(loss)
    return loss, n_local


def stage_runner(stage: PipelineStage, schedule: Schedule, micro_batches: int, optimizer: Any, *,
                 accumulation: int = 1, max_grad_norm: float = 0.0) -> Any:
    """batch -> (loss sum, tokens) for the training loop; only the last stage's are non-zero.

    The loop calls it `accumulation` times per optimizer step: gradients and token
    counts add up over those batches and the update comes with the last, so the step
    equals one process accumulating the same batches.
    """
    pending: dict[str, Any] = {"grads": None, "tokens": mx.array(0.0), "batches": 0}

    def run(batch: Any) -> tuple[mx.array, mx.array]:
        loss_sum, grads, n = stage_gradients(stage, schedule, batch.tokens, batch.lengths, micro_batches)
        acc = pending["grads"]
        pending["grads"] = grads if acc is None else tree_map(mx.add, acc, grads)
        pending["tokens"] = pending["tokens"] + n
        pending["batches"] += 1
        mx.eval(pending["grads"], pending["tokens"])
        if pending["batches"] == accumulation:
            apply_gradients(stage, pending["grads"], pending["tokens"], optimizer, max_grad_norm)
            pending.update(grads=None, tokens=mx.array(0.0), batches=0)
        if not stage.last:
            return mx.array(0.0), mx.array(0)
        return loss_sum, n.astype(mx.int32)

    return run
