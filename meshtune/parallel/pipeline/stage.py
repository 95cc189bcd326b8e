"""One rank's pipeline stage: the blocks it owns, the links to its neighbours and the tied table it shares.

`split_stages` cuts a model's blocks into stages (balanced by parameter count, or as
`parallel.stage_layers` says); `PipelineStage` is what pipeline.py's schedules run and
pipeline_state.py saves and restores, so both import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...adapters import StepContext
from ...data.packing import packed_caches
from ...training import HEAD_CHUNK_TOKENS
from ...training.head_loss import head_ce_sum, split_head
from ...training.losses import masked_ce_sum, target_mask
from ...runtime.mesh import Mesh
from .p2p import Links
from .peers import peer_groups
from .stage_cut import keep_stage
from .split import balanced_split, check_stage_layers, stage_bounds


def _size(module: nn.Module) -> int:
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
                         f"layers/norm; {type(model).__name__} is not; use --parallel.pp 1")
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        raise ValueError("pipeline parallelism does not handle sliding-window attention layers yet; "
                         "use --parallel.pp 1")
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
    compile: bool = False
    """Compile the forward and the backward with mx.compile (`train.compile`, as one process's step):
    one graph per micro-batch shape, traced once, with its elementwise operations fused."""
    step_context: StepContext = field(default_factory=StepContext)
    """The run's adapters' per-step work (adapters/per_step.py), around each backward of the stage's blocks."""
    head_chunk_tokens: int = HEAD_CHUNK_TOKENS
    """Tokens the last stage's head and its loss take at a time (training/head_loss.py)."""

    def __post_init__(self) -> None:
        self.inner, _ = _parts(self.model)
        self.links = Links(self.mesh, self.transfer)
        # Every trained parameter of the whole model, in one order all ranks share: names, shapes
        # and dtypes only, taken from the (lazily loaded) whole model before the cut below.
        self.all_params = [(k, v.shape, v.dtype) for k, v in tree_flatten(self.model.trainable_parameters())]
        self.all_weights = [(k, v.nbytes) for k, v in tree_flatten(self.model.parameters())]  # names and bytes
        self.bounds = split_stages(self.model, self.stages, self.stage_layers)
        self.start, self.end = self.bounds[self.stage]
        self.width = (self.inner.norm.weight.shape[0], self.inner.norm.weight.dtype)  # what crosses a cut
        # A tied table is the first stage's lookup and the last stage's head: both train
        # their copy, and their gradients are summed every step (sum_shared) so the copies stay equal.
        tied = "lm_head" not in self.model
        embedding = [k for k, _, _ in self.all_params if k.startswith("model.embed_tokens.")]
        self.tied_keys = embedding if tied and self.stages > 1 else []
        # This rank keeps only its stage's parts: the others' are dropped before any is read.
        if self.stages > 1:
            keep_stage(self.model, self.inner, (self.start, self.end), first=self.first, last=self.last, tied=tied)
        self.head = _parts(self.model)[1] if self.last else None
        # Sub-groups for sum_shared where the backend can split (None on ring and JACCL).
        self.peers = peer_groups(self.mesh, bool(self.tied_keys)) if self.mesh.dp > 1 or self.tied_keys else None
        # --num-layers short of the blocks can leave the first stages nothing to train.
        self.trains = bool(tree_flatten(self.model.trainable_parameters()))
        # The compiled functions read the model's current weights and the random state at each call.
        state = [self.model.state, mx.random.state]
        wrap = partial(mx.compile, inputs=state, outputs=state) if self.compile else (lambda f: f)
        self.forward, self._value_and_grads = wrap(self.hidden), wrap(self._differentiate)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def hidden(self, x: mx.array, lengths: mx.array | None = None) -> mx.array:
        """Token ids (stage 0) or hidden states in, this stage's hidden states out.

        Packed rows (3-D `lengths`, data.pack) attend within each example (data/packing.py)."""
        from mlx_lm.models.base import create_attention_mask

        h = self.inner.embed_tokens(x) if self.first else x
        cache = None
        if lengths is not None and lengths.ndim == 3:
            cache = packed_caches(1, lengths, h.shape[1])[0]
        mask = create_attention_mask(h, cache)
        for layer in self.inner.layers[self.start:self.end]:
            h = layer(h, mask) if cache is None else layer(h, mask, cache=cache)
        return h

    def loss(self, h: mx.array, targets: mx.array, lengths: mx.array) -> mx.array:
        """The last stage's summed target-token cross entropy (the single-process loss), the head
        and its loss a chunk of tokens at a time where the model allows (training/head_loss.py)."""
        head, h = split_head(self.model), self.inner.norm(h)
        if head is None:
            return masked_ce_sum(self.head(h), targets, lengths)[0]
        mask = target_mask(lengths, targets.shape[1])
        return head_ce_sum(head, h, targets, mask, chunk_tokens=self.head_chunk_tokens)

    def backward(self, x: mx.array, targets: mx.array, lengths: mx.array, dy: mx.array | None
                 ) -> tuple[mx.array, Any, mx.array | None]:
        """(value, parameter gradients, input gradient or None) for one micro-batch.

        No backend differentiates through send/recv, so a stage's backward is written by hand: the
        last stage differentiates its loss; the others differentiate the surrogate
        sum(y * stop_gradient(dy)) with the cotangent dy received from the next stage, and send dx
        back. The backward recomputes the stage's forward (activation recomputation), so only each
        micro-batch's stage input is kept between its forward and backward.
        """
        out = self._value_and_grads(x, targets, lengths, *([] if dy is None else [dy]))
        return out if len(out) == 3 else (*out, None)

    def _differentiate(self, x: mx.array, targets: mx.array, lengths: mx.array, *dy: mx.array) -> tuple:
        """(value, gradients) on the first stage, (value, gradients, dx) on the others; `dy` is
        the received cotangent, absent on the last stage, which differentiates its loss."""
        model = self.model

        def fn(params: Any, inp: mx.array) -> mx.array:
            model.update(params)
            h = self.hidden(inp, lengths)
            if self.last:
                return self.loss(h, targets, lengths)
            return (h * mx.stop_gradient(dy[0])).sum()  # seeds the reverse pass with the received cotangent

        params = model.trainable_parameters()
        if self.first and not self.trains:
            # Token ids have no gradient, and nothing here is trained (--num-layers leaves the first
            # blocks frozen): no backward to run. The value is unused off the last stage.
            return mx.array(0.0), params
        # Adapters' per-step work on the stage's blocks (DoRA's norms on CUDA).
        with self.step_context(self.inner.layers[self.start:self.end], x.shape[0] * x.shape[1]):
            if self.first:  # token ids have no gradient
                return mx.value_and_grad(fn)(params, x)
            value, (grads, dx) = mx.value_and_grad(fn, argnums=(0, 1))(params, x)
        return value, grads, dx

    def hidden_spec(self, tokens: mx.array) -> tuple[tuple[int, ...], mx.Dtype]:
        """Shape and dtype of the hidden states that cross a stage boundary."""
        return (tokens.shape[0], tokens.shape[1] - 1, self.width[0]), self.width[1]
