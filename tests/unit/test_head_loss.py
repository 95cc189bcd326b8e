"""The chunked head loss (training/head_loss.py): the plain loss's values and gradients, less memory.

Tolerances: float32 gradients agree to 1e-5 of each tensor's largest entry (the chunks
sum in another order); in bfloat16 the chunked loss's gradients are as close to a float32
reference as the plain loss's are.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from functools import partial

from meshtune.training.head_loss import HEAD_THEN_LOGITS, split_head
from meshtune.training.model_loss import loss_terms, training_loss_terms

CONFIG = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, vocab_size=96, max_position_embeddings=64,
              rope_theta=1e4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
              query_pre_attn_scalar=8, sliding_window=16, sliding_window_pattern=2, no_rope_layers=[1, 1],
              n_routed_experts=4, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
              qk_nope_head_dim=4, v_head_dim=8, topk_group=1, n_group=1, first_k_dense_replace=1,
              moe_layer_freq=1, routed_scaling_factor=1.0, partial_rotary_factor=0.5, norm_epsilon=1e-5,
              attention_bias=False, mlp_bias=False)


def make(model_type: str = "qwen3", tie: bool = True, dtype=mx.float32, **config) -> nn.Module:
    cls, args = _get_classes({"model_type": model_type})
    mx.random.seed(0)
    model = cls(args.from_dict({**CONFIG, **config, "model_type": model_type, "tie_word_embeddings": tie}))
    model.set_dtype(dtype)
    return model


def batch(vocab: int = 96, rows: int = 3, width: int = 41, packed: bool = False) -> tuple[mx.array, mx.array]:
    tokens = mx.random.randint(0, vocab, (rows, width), key=mx.random.key(1))
    if packed:  # two examples a row: (start, first target, end) slots
        slots = [[[0, 2, 20], [20, 23, width]], [[0, 1, 30], [30, 31, 35]], [[0, 5, width], [0, 0, 0]]]
        return tokens, mx.array(slots[:rows])
    return tokens, mx.array(([[0, width], [3, 30], [5, width]] * rows)[:rows])


def chunked(tokens: int):
    """training_loss_terms with the head's loss `tokens` tokens at a time."""
    return partial(training_loss_terms, chunk_tokens=tokens)


def grads_of(model: nn.Module, loss, tokens, lengths, compiled: bool = False):
    value_and_grad = nn.value_and_grad(model, loss)
    if compiled:
        run = mx.compile(lambda t, l: value_and_grad(model, t, l), inputs=model.state, outputs=model.state)
        (ce, n), grads = run(tokens, lengths)
    else:
        (ce, n), grads = value_and_grad(model, tokens, lengths)
    mx.eval(ce, n, grads)
    return ce.item(), n.item(), {k: v.astype(mx.float32) for k, v in tree_flatten(grads)}


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("model_type", sorted(HEAD_THEN_LOGITS))
def test_each_listed_family_s_logits_are_its_head_of_its_body(model_type, tie):
    model = make(model_type, tie)
    model.freeze()  # any frozen head is taken; a trained one must be a plain weight (the tests below)
    head = split_head(model)
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    assert head is not None
    assert mx.array_equal(head.apply(head.body(x)), model(x)).item()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("frozen_head", [False, True])
@pytest.mark.parametrize("tie", [True, False])
def test_values_and_gradients_equal_the_plain_loss_s(tie, frozen_head, packed, compiled):
    model = make(tie=tie)
    if frozen_head:
        model.freeze()
        model.model.layers[1].unfreeze()
    assert split_head(model) is not None
    tokens, lengths = batch(packed=packed)
    ce, n, want = grads_of(model, loss_terms, tokens, lengths)
    ce2, n2, got = grads_of(model, chunked(24), tokens, lengths, compiled)  # 120 tokens: five chunks
    assert n2 == n and ce2 == pytest.approx(ce, rel=1e-5)
    assert sorted(got) == sorted(want)
    for k in want:
        scale = mx.abs(want[k]).max().item()
        assert scale > 0, k
        assert mx.abs(got[k] - want[k]).max().item() <= 1e-5 * scale, k


@pytest.mark.parametrize("tie", [True, False])
def test_in_bfloat16_its_gradients_are_as_close_to_float32_s_as_the_plain_loss_s(tie):
    tokens, lengths = batch()
    _, _, reference = grads_of(make(tie=tie), loss_terms, tokens, lengths)
    model = make(tie=tie, dtype=mx.bfloat16)
    _, _, plain = grads_of(model, loss_terms, tokens, lengths)
    _, _, chunks = grads_of(model, chunked(24), tokens, lengths)

    def error(grads):
        return max((mx.linalg.norm(grads[k] - reference[k]) / mx.linalg.norm(reference[k])).item() for k in reference)

    assert error(plain) < 0.05
    assert error(chunks) <= 1.25 * error(plain)


@pytest.mark.parametrize("tie", [True, False])
def test_over_many_chunks_a_trained_head_s_gradient_is_as_close_to_float32_s_as_the_plain_loss_s(tie):
    """64 chunks: the head weight's gradient is summed in float32 (SUM_IN_FLOAT32_ABOVE); summed in
    bfloat16 chunk by chunk its error grew to 1.6x the plain loss's."""
    tokens, lengths = batch(vocab=512, rows=8, width=513)
    key = "model.embed_tokens.weight" if tie else "lm_head.weight"
    reference = grads_of(make(tie=tie, vocab_size=512), loss_terms, tokens, lengths)[2][key]
    model = make(tie=tie, vocab_size=512, dtype=mx.bfloat16)
    plain = grads_of(model, loss_terms, tokens, lengths)[2][key]
    chunks = grads_of(model, chunked(64), tokens, lengths, compiled=True)[2][key]

    def error(g):
        return (mx.linalg.norm(g - reference) / mx.linalg.norm(reference)).item()

    assert error(chunks) <= 1.1 * error(plain)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_a_float32_head_on_a_bfloat16_model_gives_the_plain_gradients(frozen_head):
    model = make(tie=False, dtype=mx.bfloat16)
    model.lm_head.set_dtype(mx.float32)
    if frozen_head:
        model.lm_head.freeze()
    tokens, lengths = batch()
    ce, _, want = grads_of(model, loss_terms, tokens, lengths)
    ce2, _, got = grads_of(model, chunked(24), tokens, lengths, compiled=True)
    assert ce2 == pytest.approx(ce, rel=1e-3)
    for k in want:
        assert (mx.linalg.norm(got[k] - want[k]) / mx.linalg.norm(want[k])).item() < 2e-2, k


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("tie", [True, False])
def test_a_pipeline_s_last_stage_gives_the_plain_loss_s_gradients(tie, kind):
    """PipelineStage.loss over five chunks against the same stage's backward with the plain loss (the whole
    batch's logits at once): the value, the parameter gradients and the gradient sent back to the stage before."""
    from meshtune.adapters import apply_adapters
    from meshtune.runtime.mesh import Mesh
    from meshtune.parallel.pipeline.stage import PipelineStage
    from meshtune.training.losses import masked_ce_sum

    tokens, lengths = batch()
    targets = tokens[:, 1:]

    def adapted():
        model = make("llama", tie=tie, num_hidden_layers=4)
        apply_adapters(model, fine_tune_type=kind, num_layers=-1, keys=None, rank=4, scale=10.0, dropout=0.0)
        for _, module in model.named_modules():
            if "lora_b" in module:  # so every adapter tensor has a gradient
                module.lora_b = mx.full(module.lora_b.shape, 0.01)
        return model

    first = PipelineStage(adapted(), 0, 2, Mesh(group=None, world_size=1, rank=0, dp=1, pp=2))
    hidden = first.forward(tokens[:, :-1], lengths)

    def last_stage():
        return PipelineStage(adapted(), 1, 2, Mesh(group=None, world_size=1, rank=1, dp=1, pp=2), compile=True,
                             head_chunk_tokens=24)

    last = last_stage()
    value, grads, dx = last.backward(hidden, targets, lengths, None)
    mx.eval(value, grads, dx)

    last = last_stage()

    def plain_loss(params, h):  # the stage's own differentiation, its loss the plain one
        last.model.update(params)
        return masked_ce_sum(last.head(last.inner.norm(last.hidden(h, lengths))), targets, lengths)[0]

    plain_value, (plain_grads, plain_dx) = mx.value_and_grad(plain_loss, argnums=(0, 1))(
        last.model.trainable_parameters(), hidden)
    grads, plain_grads = dict(tree_flatten(grads)), dict(tree_flatten(plain_grads))
    assert value.item() == pytest.approx(plain_value.item(), rel=1e-5)
    assert sorted(grads) == sorted(plain_grads) and grads
    for k, want in plain_grads.items():
        assert mx.abs(grads[k] - want).max().item() <= 1e-5 * mx.abs(want).max().item(), k
    assert mx.abs(dx - plain_dx).max().item() <= 1e-5 * mx.abs(plain_dx).max().item()


def test_a_quantized_tied_head_which_is_frozen_gives_the_plain_gradients():
    model = make(hidden_size=64, head_dim=16)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Embedding))
    model.freeze()
    model.model.layers[0].unfreeze()
    assert split_head(model) is not None
    tokens, lengths = batch()
    ce, _, want = grads_of(model, loss_terms, tokens, lengths)
    ce2, _, got = grads_of(model, chunked(24), tokens, lengths, compiled=True)
    assert ce2 == pytest.approx(ce, rel=1e-5)
    for k in want:
        assert mx.abs(got[k] - want[k]).max().item() <= 1e-5 * mx.abs(want[k]).max().item(), k


def test_heads_it_does_not_handle_take_the_plain_loss():
    assert split_head(make("gemma2", tie=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)) is None
    # gemma2 soft-caps its logits: not head(body(x)), so not listed
    model = make(tie=False)
    model.lm_head = nn.Linear(32, 96, bias=True)  # a trainable head with a bias
    assert split_head(model) is None
    model.lm_head.freeze()
    assert split_head(model) is not None  # frozen, any head computes its logits


def test_the_whole_batch_s_logits_are_never_alive_at_once():
    """Peak memory of a compiled step over 2048 tokens x a 32,768 vocabulary (float32 logits
    268 MB): the plain loss holds several logits-sized arrays; the chunked loss, 128 tokens at
    a time, each chunk after the one before, stays under 30% of that (about 20%; with the
    chunks left to run in any order, about 40%)."""
    model = make(vocab_size=32768, num_hidden_layers=1)
    tokens = mx.random.randint(0, 32768, (2, 1025), key=mx.random.key(2))
    lengths = mx.array([[0, 1025]] * 2)

    def peak(loss) -> float:
        value_and_grad = nn.value_and_grad(model, loss)
        run = mx.compile(lambda t, l: value_and_grad(model, t, l), inputs=model.state, outputs=model.state)
        mx.eval(run(tokens, lengths))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = run(tokens, lengths)
        mx.eval(out)
        del out
        return mx.get_peak_memory() - base

    plain, chunks = peak(loss_terms), peak(chunked(128))
    logits = 2048 * 32768 * 4
    assert plain > 2 * logits
    assert chunks < 0.3 * plain
