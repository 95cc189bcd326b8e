"""Memory one rank needs, by part: weights, adapters, gradients, optimizer state, activations.

Every figure is a formula of the model's shapes (model_facts.py) and the run's config;
nothing is fitted per model. Activations count what the autodiff graph keeps per token and
per block until the backward needs it (`block_activation_elems`), once per stage the head
and its loss (`head_bytes`), and what a block's backward holds beside them
(`backward_transient_elems`); `activations` adds them up as a step holds them. docs/plan.md
gives the same accounting for users ("The table") and how close it comes ("Measured error").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.sections import full_needs_dense
from ..training import ATTENTION_CHUNK, ATTENTION_CHUNKED_FROM, HEAD_CHUNK_TOKENS, HEAD_THEN_LOGITS
from .model_facts import Linear, ModelFacts

FP32 = 4
# mlx.optimizers' state per parameter: arrays shaped like it (adafactor: see optimizer_bytes).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1, "muon": 1}
CHUNK_SCORES = 7
"""Arrays of one chunk's scores (heads x ATTENTION_CHUNK x L, float32) alive at once in chunked attention's
backward: scores, probabilities, their cotangents and casts (tests/unit/test_attention.py measures 6.7)."""


def attention_kind(seq: int, fused_backward: bool) -> str:
    """How a step's attention holds its scores: "fused" (MLX's fused backward: NVIDIA GPUs in bfloat16 or
    float16), "chunked" (training/attention.py, rows of ATTENTION_CHUNKED_FROM and more elsewhere) or "whole"."""
    if fused_backward:
        return "fused"
    return "chunked" if seq - 1 >= ATTENTION_CHUNKED_FROM else "whole"


@dataclass(frozen=True)
class Trained:
    """One trained tensor group: its parameters, where it lives and whether it adds memory."""

    name: str
    params: int
    bytes_per_param: int
    block: int | None
    """Block index, None for model-level layers (embedding, head)."""
    extra: bool
    """True for adapter parameters (new memory); False for base weights trained in place (full)."""
    shapes: tuple[tuple[int, ...], ...] = ()


def chosen_blocks(facts: ModelFacts, num_layers: int) -> range:
    """The last `num_layers` blocks; -1, or more than the model has, all (as adapters/apply.py picks them)."""
    n = facts.num_blocks
    return range(n) if num_layers < 0 or num_layers >= n else range(n - num_layers, n)


def _relative(name: str) -> tuple[int | None, str]:
    from .model_facts import block_of

    b = block_of(name)
    if b is None:
        return None, name
    return b, name.split(f".{b}.", 1)[1] if f".{b}." in name else name.split(f"{b}.", 1)[1]


def trained(facts: ModelFacts, adapter: Any) -> list[Trained]:
    """What training changes: adapter tensors per targeted layer, or the targeted layers themselves (full)."""
    blocks = set(chosen_blocks(facts, adapter.num_layers))
    keys = adapter.keys
    out = []
    for layer in facts.layers:
        block, rel = _relative(layer.name)
        if keys is None:
            hit = block in blocks
        else:
            hit = (block in blocks and rel in keys) or (block is None and layer.name in keys)
        if hit:
            if adapter.fine_tune_type == "full" and layer.quantized:
                raise ValueError(full_needs_dense(f"layer {layer.name} of {facts.path}"))
            out.append(_trained_of(layer, block, adapter))
    if adapter.fine_tune_type == "full" and keys is None:
        out += _rest_of_blocks(facts, blocks, {layer.name for layer in facts.layers})
    if not out:
        raise ValueError(f"no layers matched adapter.keys={keys} in the last {adapter.num_layers} blocks; "
                         "name modules relative to a block, e.g. --adapter.keys '[self_attn.q_proj]'")
    return out


def _rest_of_blocks(facts: ModelFacts, blocks: set[int], layers: set[str]) -> list[Trained]:
    """Full fine-tuning trains the chosen blocks whole: their tensors outside the linear layers too
    (norms, a router's bias), as adapters/apply.py unfreezes them."""
    from .model_facts import DTYPE_BYTES, FLOAT_DTYPES, block_of

    out = []
    for t in facts.tensors:
        block = block_of(t.name)
        if block in blocks and t.dtype in FLOAT_DTYPES and t.name.rsplit(".", 1)[0] not in layers:
            out.append(Trained(t.name, elements_of(t.shape), DTYPE_BYTES[t.dtype], block, extra=False, shapes=(t.shape,)))
    return out


def _trained_of(layer: Linear, block: int | None, adapter: Any) -> Trained:
    e, r = layer.experts, adapter.rank
    if adapter.fine_tune_type == "full":
        # A quantized layer's words, scales and biases stay frozen when unfrozen (MLX's QuantizedLinear).
        params = 0 if layer.quantized else layer.nbytes // max(1, _itemsize(layer))
        return Trained(layer.name, params, _itemsize(layer), block, extra=False,
                       shapes=((e, layer.out_dims, layer.in_dims),) if params else ())
    shapes = [(e, r, layer.in_dims), (e, layer.out_dims, r)]
    if adapter.fine_tune_type == "dora":  # the magnitude m: one per output row (per token for an embedding)
        shapes.append((e, layer.in_dims if layer.embedding else layer.out_dims))
    params = sum(elements_of(s) for s in shapes)
    return Trained(layer.name, params, FP32, block, extra=True, shapes=tuple(shapes))


def _itemsize(layer: Linear) -> int:
    count = layer.experts * layer.in_dims * layer.out_dims
    return max(1, min(FP32, round(layer.nbytes / max(count, 1)))) if not layer.quantized else 2


def elements_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def optimizer_bytes(name: str, items: list[Trained], options: dict[str, Any]) -> int:
    """Optimizer state bytes for the trained tensors, as mlx.optimizers allocates it."""
    if name != "adafactor":
        # SGD keeps its "v" even without momentum (mlx 0.32 allocates it in init_single).
        return OPTIMIZER_STATES[name] * sum(t.params * t.bytes_per_param for t in items)
    total = 0
    for t in items:
        for shape in t.shapes or ((t.params,),):
            dims = [d for d in shape if d != 1] or [1]
            # Factored second moment for a matrix: one value per row plus one per column.
            total += (elements_of(tuple(dims[:-1])) + elements_of(tuple(dims[:-2] + dims[-1:]))) if len(dims) >= 2 \
                else elements_of(tuple(dims))
            if options.get("beta_1") is not None:
                total += elements_of(shape)
    return total * (items[0].bytes_per_param if items else FP32)


def block_activation_elems(facts: ModelFacts, seq: int, adapted: list[Linear], variant: str, rank: int,
                           attention: str = "whole") -> float:
    """Activation elements one token keeps in one block until its backward:

        block input, norm outputs, attention output, o_proj output, residual   6 h
        q, k, v and rotated q, k; attention output and its transposed copy      4 q + 3 kv
        attention probabilities over L keys (softmax's backward needs no more) heads L
        MLP gate, up, sigmoid(gate), SiLU, product (per routed expert for MoE)  5 I
        adapter inner products x A (LoRA; DoRA also its unscaled product)       r (+ out) per layer
    """
    h, q, kv = facts.hidden, facts.heads * facts.head_dim, facts.kv_heads * facts.head_dim
    # The probabilities over L keys, or (fused, chunked) each row's log-sum-exp only.
    attention_elems = 6 * h + 4 * q + 3 * kv + facts.heads * (seq if attention == "whole" else 1)
    if facts.experts:
        k = facts.experts_per_token
        # router logits and probabilities; each routed copy: gathered input, 5 I_moe, expert output
        mlp = 2 * facts.experts + k * (2 * h + 5 * facts.moe_intermediate)
        mlp += 5 * facts.shared_intermediate + (h if facts.shared_intermediate else 0)
    else:
        mlp = 5 * facts.intermediate
    extra = 0.0
    if variant != "full":
        for layer in adapted:
            routed = facts.experts_per_token if layer.experts > 1 else 1
            inner = layer.out_dims if layer.embedding else rank  # an embedding's LoRA gathers rows of A
            extra += routed * (inner + (layer.out_dims if variant == "dora" else 0))
    return attention_elems + mlp + extra


def backward_transient_elems(facts: ModelFacts, seq: int, attention: str = "whole", headless: bool = False) -> int:
    """Per token, the cotangents a block's backward holds beside its activations: its MLP's, and (whole)
    the attention's for the probabilities and the scores.

    `headless`: the stage has no head (a pipeline's earlier stages). There a block's backward is the
    stage's peak, and it also holds SiLU's backward beside the MLP's cotangents: sigmoid(gate), its
    complement and their products with the cotangent (4 I more; one block of the small preset measures
    28.5k floats a token kept and transient, meshtune bench plan's pp rows). Where the stage also
    differentiates the head's loss, that moment and the head's part set its peak instead, which the
    head's term covers."""
    width = facts.experts_per_token * facts.moe_intermediate if facts.experts else facts.intermediate
    return (7 if headless else 3) * width + 2 * facts.hidden + (2 * facts.heads * seq if attention == "whole" else 0)


def head_elems(facts: ModelFacts) -> tuple[int, int]:
    """Per token on the last stage: (activation-dtype elements, float32 elements) of norm and loss."""
    return 2 * facts.hidden, 3 * facts.vocab


def head_bytes(facts: ModelFacts, adapter: Any, tokens: int) -> float:
    """Bytes of the last stage's final norm and loss on `tokens` tokens (one chunk of the loss where chunked).

    The final norm (2 h) and the logits with the cross entropy's softmax and gradient (3 vocab,
    float32), for one chunk of 1024 tokens where the step takes the head's loss a chunk at a time
    (training/head_loss.py; `chunked_loss`), else for every token.
    """
    norm, loss = head_elems(facts)
    loss_tokens = min(tokens, HEAD_CHUNK_TOKENS) if chunked_loss(facts, adapter) else tokens
    return tokens * norm * facts.activation_dtype_bytes + loss_tokens * loss * FP32


def chunked_loss(facts: ModelFacts, adapter: Any) -> bool:
    """Whether the step takes the head's loss a chunk of tokens at a time (training/head_loss.split_head):
    a listed family whose head is frozen or, trained in full, a plain weight without a bias."""
    if facts.get("model_type") not in HEAD_THEN_LOGITS:
        return False
    head = "model.embed_tokens" if facts.tied else "lm_head"
    if head not in {t.name for t in trained(facts, adapter)}:
        return True
    return adapter.fine_tune_type == "full" and not any(t.name == f"{head}.bias" for t in facts.tensors)


def activations(facts: ModelFacts, *, adapter: Any, examples: int, seq: int, blocks: range,
                last: bool, checkpoint: bool, fused_backward: bool = False) -> tuple[float, float]:
    """(bytes the forward keeps for `blocks` on `examples` x `seq` tokens, per-block part of it).

    `fused_backward`: the device's attention has a fused backward (attention_kind).

    The head's loss is done (its chunks freed, only its gradient to the hidden states left) before
    the first block's backward begins, so the peak holds the larger of the head and a block's
    backward transients, not both. A quantized base multiplied through its dequantized weights keeps
    one dense copy per layer for the backward."""
    kind = attention_kind(seq, fused_backward)
    tokens = examples * seq
    act = facts.activation_dtype_bytes
    adapted_by_block: dict[int, list[Linear]] = {}
    if adapter.fine_tune_type != "full":
        from .model_facts import block_of

        chosen = set(chosen_blocks(facts, adapter.num_layers))
        for layer in facts.layers:
            b = block_of(layer.name)
            if b in chosen and (adapter.keys is None or _relative(layer.name)[1] in adapter.keys):
                adapted_by_block.setdefault(b, []).append(layer)
    per_block = [block_activation_elems(facts, seq, adapted_by_block.get(b, []), adapter.fine_tune_type,
                                        adapter.rank, kind)
                 * tokens * act for b in blocks]
    head = head_bytes(facts, adapter, tokens) if last else 0.0
    transient = backward_transient_elems(facts, seq, kind, headless=not last) * tokens * act
    if kind == "chunked":
        transient += CHUNK_SCORES * facts.heads * ATTENTION_CHUNK * seq * examples * FP32
    if adapter.base_path != "quantized":
        # The dequantized base path (adapters/base_path.py; "auto" takes it for many tokens) multiplies by
        # each quantized layer's dense weight, and the backward needs that weight again for dx: one per layer.
        from .model_facts import block_of

        transient += sum(layer.out_dims * layer.in_dims * act for layer in facts.layers
                         if layer.quantized and layer.experts == 1 and block_of(layer.name) in blocks)
    if checkpoint:  # only each block's input stays; one block is recomputed at a time
        kept = facts.hidden * tokens * act * len(per_block) + max(per_block, default=0.0)
        return kept + max(head, transient), max(per_block, default=0.0)
    return sum(per_block) + max(head, transient), max(per_block, default=0.0)
