"""What every parallel strategy's step and evaluation share: the loss, evaluation, one step in flight.

`loss_terms` is the one loss (summed token cross entropy and its token count) that
evaluation reports; `training_loss_terms`, which the data-parallel step differentiates,
computes the same with the head a chunk of tokens at a time where the model allows
(training/head_loss.py); a pipeline's last stage computes the same (training/losses.py). `OneInFlight` lets the host build the
next step while the device runs this one (runtime.overlap_steps).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..data.packing import packed_caches
from ..runtime.mesh import Mesh
from .head_loss import head_ce_sum, split_head
from .losses import masked_ce_sum, target_mask


def loss_terms(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of target-token cross entropy, number of target tokens) for one batch.

    Packed rows (3-D `lengths`, data.pack) go through the model with a pass-through cache per
    block whose mask keeps attention inside each example (data/packing.py)."""
    inputs, cache = _model_inputs(model, tokens, lengths)
    return masked_ce_sum(model(inputs) if cache is None else model(inputs, cache=cache), tokens[:, 1:], lengths)


def training_loss_terms(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """`loss_terms` as the training step differentiates it: where the model's head allows
    (training/head_loss.py), the head and its loss run a chunk of tokens at a time with their
    gradient taken on the way, so the step never holds the whole batch's logits."""
    head = split_head(model)
    if head is None:
        return loss_terms(model, tokens, lengths)
    inputs, cache = _model_inputs(model, tokens, lengths)
    mask = target_mask(lengths, inputs.shape[1])
    hidden = head.body(inputs) if cache is None else head.body(inputs, cache)
    return head_ce_sum(head, hidden, tokens[:, 1:], mask), mask.sum()


def _model_inputs(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, list | None]:
    """(the model's inputs, all but each row's last token; packed rows' caches or None)."""
    inputs = tokens[:, :-1]
    if lengths.ndim == 3:
        return inputs, packed_caches(len(model.layers), lengths, inputs.shape[1])
    return inputs, None


class OneInFlight:
    """Evaluates a loop's outputs one iteration behind where `overlap` (runtime.overlap_steps):
    `run` dispatches this iteration's outputs, then waits for the previous iteration's `wait_on`
    arrays, so the host builds the next iteration while the device runs this one. MLX signals an
    evaluation's arrays together, at its end, so waiting on a few of them waits for all of it.
    Without `overlap`, `run` evaluates and returns."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._pending: list[mx.array] = []

    def run(self, outputs: Any, wait_on: list[mx.array]) -> None:
        if not self.overlap:
            mx.eval(outputs)
            return
        mx.async_eval(outputs)
        self.finish()
        self._pending = list(wait_on)

    def finish(self) -> None:
        """Wait for the iteration still in flight, if any."""
        mx.eval(self._pending)
        self._pending = []


def overlaps_steps(setting: bool | str) -> bool:
    """runtime.overlap_steps as the strategies take it: "auto" is on where arrays live on a GPU."""
    if setting == "auto":
        return mx.default_device().type == mx.DeviceType.gpu
    return setting is True


def evaluate(model: nn.Module, batches: Iterable[Any], mesh: Mesh,
             beat: Callable[[], None] = lambda: None, counts: bool = True,
             overlap: bool = False) -> tuple[float, int]:
    """Token-weighted loss over `batches` on every rank: (loss, global tokens).

    A rank with `counts` false computes but adds nothing (a pipeline stage whose
    replica's first stage already counts the same batches). With `overlap`
    (runtime.overlap_steps) each batch is dispatched before the previous one is waited for.
    """
    model.eval()
    total, tokens = mx.array(0.0), mx.array(0)
    in_flight = OneInFlight(overlap)
    for batch in batches:
        ce, n = loss_terms(model, batch.tokens, batch.lengths)
        total, tokens = total + ce, tokens + n
        in_flight.run([total, tokens], [total, tokens])
        beat()
    in_flight.finish()
    model.train()
    if not counts:
        total, tokens = mx.zeros_like(total), mx.zeros_like(tokens)
    total, tokens = mesh.all_sum(total), mesh.all_sum(tokens)
    n = int(tokens.item())
    return (total.item() / n if n else float("nan")), n


def enable_grad_checkpoint(block: nn.Module) -> None:
    """Recompute every block of this type in the backward pass instead of storing activations.

    A block keeps only its input; its forward runs again when the backward reaches it. The
    recomputation waits for the cotangent of the block's output (`mx.depends`), so it cannot run
    before the backward gets there, however MLX orders the step's graph. mx.checkpoint waits only
    for the forward's output, so a scheduler may recompute every block early and hold all their
    activations at once; torch's non-reentrant checkpoint also recomputes when the gradient arrives.
    """
    fn = type(block).__call__

    def checkpointed(module: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        flat = tree_flatten(module.trainable_parameters())
        names, params = [k for k, _ in flat], [v for _, v in flat]

        def forward(x: mx.array, *params: mx.array) -> mx.array:
            module.update(tree_unflatten(list(zip(names, params))))
            return fn(module, x, *args, **kwargs)

        @mx.custom_function
        def block_forward(x: mx.array, *params: mx.array) -> mx.array:
            return forward(x, *params)

        @block_forward.vjp
        def recompute_then_backward(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple:
            inputs = mx.depends(list(primals), [cotangent])
            return tuple(mx.vjp(lambda *p: [forward(*p)], inputs, [cotangent])[1])

        return block_forward(x, *params)

    checkpointed.recomputes_in_backward = True  # adapters/step_norms.py asks
    type(block).__call__ = checkpointed
