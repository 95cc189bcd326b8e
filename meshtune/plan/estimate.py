"""One layout's figures per rank: memory by part for each stage, bubble and traffic per step.

Every rank of a pipeline holds only its stage's parts (parallel/pipeline/stage_cut.py): its blocks'
weights and adapters, the embedding on the first stage, the final norm and head on the last
(a tied table on both ends), and their gradients, optimizer state and activations. The peak adds the static
part (weights, adapters, optimizer state, gradient-sum buffers) to the larger of two
moments. The backward frees a block's activations as that block's gradients appear, so it
holds the larger of all activations and all gradients, plus one block's overlap of the two.
The update holds the gradients and, beside them, the larger of their squares for the norm
and the new copies of what does not update in place (training/update.py: Adam's update of
a tensor under IN_PLACE_FROM elements, and any other optimizer's, makes new weights and
state before the old ones go); for full fine-tuning with short batches that is the peak.
"""

from __future__ import annotations

from typing import Any

from ..training import IN_PLACE_FROM
from .layouts import Layout, bubble, micro_in_flight, ring_allreduce_bytes
from .memory import FP32, Trained, activations, elements_of, optimizer_bytes
from .model_facts import EMBEDDINGS, ModelFacts, block_of


def _stage_of(t: Trained, bounds: tuple[int, int], stage: int, stages: int, tied: bool) -> bool:
    """Whether stage `stage` trains `t` (the embedding on the first, the head on the last, a tied table on both)."""
    if t.block is not None:
        return bounds[0] <= t.block < bounds[1]
    head = "lm_head" in t.name
    if head:
        return stage == stages - 1
    return stage == 0 or (tied and stage == stages - 1)


def stage_weight_bytes(facts: ModelFacts, bounds: tuple[int, int], first: bool, last: bool) -> int:
    """Bytes of the base weights a stage holds (parallel/pipeline/stage_cut.py's cut): its blocks, the embedding on
    the first stage, the final norm and head on the last, a tied table there too."""
    total = 0
    for t in facts.tensors:
        block = block_of(t.name)
        if block is not None:
            total += t.nbytes if bounds[0] <= block < bounds[1] else 0
        elif any(e in t.name for e in EMBEDDINGS):
            total += t.nbytes if first or (last and facts.tied) else 0
        elif last:  # the final norm and the head
            total += t.nbytes
    return total


def _not_in_place(items: list[Trained], optimizer: str) -> list[Trained]:
    """The trained tensors whose update makes new copies of them and their state (training/update.py)."""
    if optimizer not in ("adam", "adamw"):
        return items
    out = []
    for t in items:
        small = tuple(shape for shape in t.shapes or ((t.params,),) if elements_of(shape) < IN_PLACE_FROM)
        if small:
            out.append(Trained(t.name, sum(map(elements_of, small)), t.bytes_per_param, t.block, t.extra, small))
    return out


def update_extra(items: list[Trained], optimizer: str, options: dict[str, Any]) -> float:
    """Bytes the update holds beside the gradients: the larger of the gradients' squares (the norm's) and
    the new weights and optimizer state of the tensors not updated in place."""
    copied = _not_in_place(items, optimizer)
    copies = sum(t.params * t.bytes_per_param for t in copied) + optimizer_bytes(optimizer, copied, options)
    return max(sum(t.params * t.bytes_per_param for t in items), copies)


def layout_figures(layout: Layout, facts: ModelFacts, cfg: Any, items: list[Trained], *, seq: int,
                   link_bytes_s: float, fused_backward: bool = False) -> dict[str, Any]:
    """Memory per rank (one entry per stage), bubble, bytes sent per rank per step and their time."""
    p, t = cfg.parallel, cfg.train
    local = t.batch_size // layout.dp
    micro = max(local // layout.micro_batches, 1)
    flight = micro_in_flight(p.schedule, layout.pp, layout.micro_batches)
    act_bytes = facts.activation_dtype_bytes
    boundary = micro * seq * facts.hidden * act_bytes  # one micro-batch's hidden states at a stage cut
    starts = [sum(layout.stage_layers[:s]) for s in range(layout.pp + 1)]
    stages = []
    for s in range(layout.pp):
        bounds = (starts[s], starts[s + 1])
        mine = [i for i in items if _stage_of(i, bounds, s, layout.pp, facts.tied)]
        last = s == layout.pp - 1
        weights = stage_weight_bytes(facts, bounds, s == 0, last) if layout.pp > 1 else facts.total_bytes()
        adapters = sum(i.params * i.bytes_per_param for i in mine if i.extra)
        if cfg.adapter.fine_tune_type == "dora":  # DoRA keeps each layer's squared row norms (frozen, float32)
            adapters += sum(i.shapes[-1][0] * i.shapes[-1][1] * FP32 for i in mine if i.shapes)
        trained = sum(i.params * i.bytes_per_param for i in mine)
        grads = trained * (2 if t.grad_accumulation_steps > 1 else 1)
        optimizer = optimizer_bytes(cfg.optimizer.name, mine, cfg.optimizer.options)
        update = trained + update_extra(mine, cfg.optimizer.name, cfg.optimizer.options)
        blocks = range(*bounds)
        examples = micro if layout.pp > 1 else local
        act, per_block = activations(facts, adapter=cfg.adapter, examples=examples, seq=seq, blocks=blocks,
                                     last=last, checkpoint=False, fused_backward=fused_backward)
        ckpt = activations(facts, adapter=cfg.adapter, examples=examples, seq=seq, blocks=blocks,
                           last=last, checkpoint=True, fused_backward=fused_backward)[0] if layout.pp == 1 else None
        if layout.pp > 1:
            # Inputs kept between each in-flight micro-batch's forward and backward (token ids on
            # stage 0), and the cotangent received for the one in its backward.
            kept = micro * seq * 4 if s == 0 else boundary
            act += flight[s] * kept + (0 if last else boundary)
        comm_buffer = 0.0
        if layout.pp == 1 and layout.dp > 1:  # a packed gradient bucket beside the gradients
            comm_buffer = min(grads, p.bucket_mb * 2**20)
        elif layout.pp > 1 and layout.dp > 1:  # the world buffer with a slot per trained parameter, and its sum
            comm_buffer = 2 * sum(i.params for i in items) * FP32
        # With train.grad_checkpoint the step keeps each block's input and recomputes one block at a time
        # (training/grad_checkpoint.py), its update built apart from its backward (data_parallel_step.build_step).
        kept = ckpt if ckpt is not None and t.grad_checkpoint else act
        block_grads = grads / max(len(blocks), 1)
        # The backward walks the blocks from the last: a block's activations are freed as its gradients
        # appear, so the peak holds the larger of the two, plus one block's overlap of them.
        backward = max(kept, grads) + min(per_block, block_grads)
        total = weights + adapters + optimizer + comm_buffer + max(backward, update)
        stages.append({"stage": s, "blocks": [bounds[0], bounds[1]], "weights": weights, "adapters": adapters,
                       "grads": grads, "optimizer": optimizer, "activations": kept, "activations_ckpt": ckpt,
                       "backward": backward, "update": update,
                       "comm_buffers": comm_buffer, "in_flight": flight[s] if layout.pp > 1 else 1, "total": total})
    sent = _sent_per_rank(layout, items, boundary, t.grad_accumulation_steps, facts.tied)
    return {"stages": stages, "total": max(st["total"] for st in stages),
            "bubble": bubble(p.schedule, layout.pp, layout.micro_batches), "comm_bytes": sent,
            "comm_ms": 1e3 * sent / link_bytes_s, "micro_batch": micro}


def _sent_per_rank(layout: Layout, items: list[Trained], boundary: float, accumulation: int, tied: bool) -> float:
    """Bytes the busiest rank sends per optimizer step."""
    if layout.ranks == 1:
        return 0.0
    if layout.pp == 1:
        grads = sum(i.params * i.bytes_per_param for i in items) + FP32  # the token count rides along
        return ring_allreduce_bytes(grads, layout.dp)
    # A middle stage sends activations forward and gradients back; an end stage one of the two.
    directions = 2 if layout.pp > 2 else 1
    p2p = directions * boundary * layout.micro_batches * accumulation
    # On backends without Group.split (ring, the default of meshtune launch) shared gradients go through
    # one world all_sum of every trained parameter; with dp 1 only a trained tied table's.
    table = [i for i in items if tied and i.block is None and "lm_head" not in i.name]
    shared = items if layout.dp > 1 else table
    return p2p + ring_allreduce_bytes(sum(i.params for i in shared) * FP32, layout.ranks)
