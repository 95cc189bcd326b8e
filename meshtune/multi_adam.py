"""Adam's and AdamW's update of many parameters in a few CUDA launches, the division by the tokens inside.

MLX's optimizers update each parameter with its own elementwise kernel (compiled together with the
gradient's division by the step's token count, train.build_step). An adapter step updates hundreds of
small parameters: the 1B bench's LoRA 224 (A and B of 112 layers), its DoRA 336 (and m), a few
thousand to fifty thousand floats each, and each update a launch of ~6 us of GPU time (ncu,
docs/bench/adapters_h200_23.txt) with as much of the host's time to dispatch it. On MLX's CUDA build
the float32 parameters go here GROUP to a launch: each block finds its tensor among the launch's by
a search of the blocks' starts and updates ITEMS x THREADS elements of it, in the arithmetic of
mlx.optimizers.Adam / AdamW's apply_single, in float32.

The optimizer's state stays mlx's (step, learning_rate, and m and v by parameter), so checkpoints,
resume and schedules see no difference. Other dtypes (a bfloat16 full fine-tune) and other optimizers
take mlx's own update; so does everything off CUDA (CPU, Metal).

Off unless MESHTUNE_MULTI_ADAM=1: on one H200 the 1B bench's steps did not get faster with it (LoRA
57.1 against 54.7 ms with mlx's Adam, DoRA 67.7 against 68.1, two models each in one process:
scripts/probes/adam_paths.py, docs/bench/adam_paths_h200_27.txt). The steps there are the host's, and
the grouped launches cost the host about what the launches they replace did.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from .cuda import kernel as _kernel, kernel_constant, on_cuda
from .env import choice

GROUP = 64  # tensors a launch: 7 pointers each (p, g, m, v in; p, m, v out) keep the parameters under 4 KB
THREADS = 256
ITEMS = 4  # elements a thread, THREADS apart

_SOURCE = """
    // The block's tensor: the last t with starts[t] <= block (layout = starts[0..N], then sizes[0..N-1]).
    const int block = blockIdx.x;
    int lo = 0, hi = N;
    while (hi - lo > 1) {{
      int mid = (lo + hi) / 2;
      if (layout[mid] <= block) lo = mid; else hi = mid;
    }}
    const float *p, *g, *m, *v;
    float *p_new, *m_new, *v_new;
    switch (lo) {{
{cases}
      default: return;
    }}
    const int size = layout[N + 1 + lo];
    const float tokens = coef[0], lr = coef[1], c1 = coef[2], c2 = coef[3], decay = coef[4];
    const float b1 = hyper[0], one_b1 = hyper[1], b2 = hyper[2], one_b2 = hyper[3], eps = hyper[4];
    const int first = (block - layout[lo]) * ({items} * {threads}) + threadIdx.x;
    for (int k = 0; k < {items}; ++k) {{
      const int i = first + k * {threads};
      if (i >= size) break;
      const float grad = g[i] / tokens;
      const float mi = b1 * m[i] + one_b1 * grad;
      const float vi = b2 * v[i] + one_b2 * (grad * grad);
      const float pi = DECAY ? p[i] * decay : p[i];
      m_new[i] = mi;
      v_new[i] = vi;
      p_new[i] = BIAS_CORRECTION ? pi - (c1 * mi) / (sqrtf(vi) * c2 + eps) : pi - (lr * mi) / (sqrtf(vi) + eps);
    }}
"""


def _names(n: int) -> tuple[list[str], list[str]]:
    inputs = [f"{kind}{i}" for i in range(n) for kind in ("p", "g", "m", "v")] + ["layout", "coef", "hyper"]
    outputs = [f"{kind}_new{i}" for i in range(n) for kind in ("p", "m", "v")]
    return inputs, outputs


def _group_kernel(n: int):
    cases = "\n".join(f"      case {i}: p = p{i}; g = g{i}; m = m{i}; v = v{i}; "
                      f"p_new = p_new{i}; m_new = m_new{i}; v_new = v_new{i}; break;" for i in range(n))
    inputs, outputs = _names(n)
    return _kernel(f"meshtune_multi_adam_{n}", inputs, outputs,
                   _SOURCE.format(cases=cases, items=ITEMS, threads=THREADS))


ENV = "MESHTUNE_MULTI_ADAM"


def _setting(value: str) -> bool:
    return choice(ENV, value, {"1": True, "0": False}, f"1 (Adam's and AdamW's float32 updates {GROUP} tensors to a "
                  "CUDA launch) or 0 (the default: mlx's update, a launch a parameter)")


ENABLED = _setting(os.environ.get(ENV, "0"))


def supports(optimizer: optim.Optimizer) -> bool:
    """Whether `update` takes this optimizer here: MESHTUNE_MULTI_ADAM=1, and Adam or AdamW (not a subclass)
    on MLX's CUDA build."""
    return ENABLED and on_cuda() and type(optimizer) in (optim.Adam, optim.AdamW)


def _coefficients(optimizer: optim.Adam, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """(coef, hyper): this step's [tokens, lr, c1, c2, weight decay's factor] and the constants [b1, 1 - b1, b2, 1 - b2, eps].

    As Adam.apply_single forms them for a float32 gradient; both arrays are over 8 bytes, out of MLX's managed pool
    of small arrays (meshtune.cuda.kernel_constant)."""
    b1, b2 = optimizer.betas
    lr = optimizer.learning_rate.astype(mx.float32)
    step = optimizer.step
    one = mx.array(1.0, mx.float32)
    if optimizer.bias_correction:
        c1 = (lr / (1 - b1 ** step)).astype(mx.float32)
        c2 = mx.rsqrt(1 - b2 ** step).astype(mx.float32)
    else:
        c1 = c2 = one
    decay = 1 - lr * optimizer.weight_decay if isinstance(optimizer, optim.AdamW) else one
    coef = mx.stack([tokens.astype(mx.float32), lr, c1, c2, decay.astype(mx.float32)])
    hyper = kernel_constant([b1, 1 - b1, b2, 1 - b2, optimizer.eps], mx.float32)
    return coef, hyper


def _launch(items: list[tuple[mx.array, mx.array, dict]], coef: mx.array, hyper: mx.array,
            bias_correction: bool, decay: bool) -> list[mx.array]:
    """New parameters of one group, its states' m and v replaced in place."""
    per_block = ITEMS * THREADS
    starts, sizes = [0], []
    for _, p, _ in items:
        starts.append(starts[-1] + -(-p.size // per_block))
        sizes.append(p.size)
    inputs = [a for g, p, s in items for a in (p, g, s["m"], s["v"])]
    layout = kernel_constant(starts + sizes, mx.int32)
    shapes = [a.shape for _, p, _ in items for a in (p, p, p)]
    out = _group_kernel(len(items))(
        inputs=inputs + [layout, coef, hyper], template=[("N", len(items)), ("BIAS_CORRECTION", bias_correction),
                                                         ("DECAY", decay)],
        grid=(starts[-1] * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=shapes,
        output_dtypes=[mx.float32] * len(shapes))
    new = []
    for k, (_, _, state) in enumerate(items):
        p, m, v = out[3 * k: 3 * k + 3]
        state["m"], state["v"] = m, v
        new.append(p)
    return new


MAX_ELEMENTS = 1 << 26  # a tensor's; larger ones (a full fine-tune's embedding) are one launch each anyway


def _fused(g: mx.array, p: mx.array, state: dict) -> bool:
    """Whether this leaf goes in a group: float32 throughout, and small enough that a group's indices stay in int32."""
    return (all(a.dtype == mx.float32 for a in (g, p, state["m"], state["v"])) and g.shape == p.shape
            and 0 < p.size <= MAX_ELEMENTS)


def apply_gradients(optimizer: optim.Adam, grads: Any, parameters: Any, tokens: mx.array) -> Any:
    """optimizer.apply_gradients(grads / tokens, parameters) for Adam or AdamW, float32 leaves GROUP to a launch."""
    if not optimizer._initialized:
        optimizer.init(grads)
    for name, scheduler in optimizer._schedulers.items():
        optimizer.state[name] = scheduler(optimizer.step)
    optimizer.state["step"] = optimizer.step + 1
    leaves: list[tuple[mx.array, mx.array, dict]] = []

    def collect(g: mx.array, p: mx.array, state: dict) -> int:
        leaves.append((g, p, state))
        return len(leaves) - 1

    where = tree_map(collect, grads, parameters, optimizer.state)
    new: list[mx.array | None] = [None] * len(leaves)
    fused = [i for i, leaf in enumerate(leaves) if _fused(*leaf)]
    if fused:
        coef, hyper = _coefficients(optimizer, tokens)
        decay = isinstance(optimizer, optim.AdamW) and optimizer.weight_decay != 0
        for at in range(0, len(fused), GROUP):
            group = fused[at: at + GROUP]
            for i, p in zip(group, _launch([leaves[i] for i in group], coef, hyper,
                                           bool(optimizer.bias_correction), decay)):
                new[i] = p
    for i, (g, p, state) in enumerate(leaves):
        if new[i] is None:
            new[i] = optimizer.apply_single(g / tokens.astype(g.dtype), p, state)
    return tree_map(lambda i: new[i], where)


def update(optimizer: optim.Adam, model: nn.Module, grads: Any, tokens: mx.array) -> None:
    """optimizer.update(model, grads / tokens), by `apply_gradients` (supports(optimizer) must hold)."""
    model.update(apply_gradients(optimizer, grads, model, tokens))


def update_if_supported(optimizer: optim.Optimizer, model: nn.Module, grads: Any, tokens: mx.array,
                        max_grad_norm: float) -> bool:
    """`update` where it applies (Adam or AdamW on CUDA, no clipping: the clip needs every divided gradient
    first); False, nothing done, where the caller updates by mlx's own path."""
    if max_grad_norm > 0 or not supports(optimizer):
        return False
    update(optimizer, model, grads, tokens)
    return True
