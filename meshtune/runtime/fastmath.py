"""Fast SiLU for MLX's CPU backend, swapped into mlx-lm's SwiGLU when training on the CPU.

MLX's CPU build evaluates `exp`/`sigmoid` one element at a time through libm, so on a
small model SwiGLU's activation costs more than the matmuls around it. Here exp is
range-reduced to 2^n * 2^f with |f| <= 1/2, 2^f taken from its degree-7 Taylor
polynomial (relative error ~1e-7, float32 rounding level) and 2^n built from the
exponent bits, all plain arithmetic that MLX's compiler fuses. SiLU's derivative is
given in closed form (s (1 + x (1 - s)), s = sigmoid(x)) so autodiff never touches the
bit trick. Only float32 takes the fast path; other dtypes keep `nn.silu`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .model_modules import replace_in_models

_LOG2E = 1.4426950408889634
# Taylor coefficients of 2^f = exp(f ln 2): (ln 2)^k / k!, highest degree last.
_POW2 = (1.0, 0.6931471805599453, 0.2402265069591007, 0.05550410866482158, 0.009618129107628477,
         0.0013333558146428443, 0.00015403530393381609, 1.525273380405984e-05)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x, to ~1e-7 relative, from arithmetic MLX vectorises."""
    t = mx.clip(x * _LOG2E, -126.0, 126.0)  # 2^t stays a normal float32
    n = mx.floor(t + 0.5)
    f = t - n
    p = mx.array(_POW2[-1], dtype=x.dtype)
    for c in reversed(_POW2[:-1]):
        p = p * f + c
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # the float with exponent n
    return p * two_n


def _sigmoid(x: mx.array) -> mx.array:
    return 1.0 / (1.0 + fast_exp(-x))


@mx.custom_function
def fast_silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) through `fast_exp`, with a closed-form derivative."""
    return x * _sigmoid(x)


@fast_silu.vjp
def _fast_silu_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> tuple[mx.array]:
    x = primals[0] if isinstance(primals, (list, tuple)) else primals
    s = _sigmoid(x)
    return (cotangent * s * (1.0 + x * (1.0 - s)),)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's swiglu (silu(gate) * x) with the fast SiLU for float32."""
    if gate.dtype != mx.float32:
        return nn.silu(gate) * x
    return fast_silu(gate) * x


def install_fast_swiglu() -> int:
    """Point every loaded mlx-lm model module's `swiglu` at ours; returns how many.

    Called after the model is loaded, so its module and switch_layers are imported.
    """
    from mlx_lm.models import activations

    return replace_in_models("swiglu", swiglu, lambda f: f is activations.swiglu)


def uninstall_fast_swiglu() -> None:
    """Undo `install_fast_swiglu` (stock activation everywhere again)."""
    from mlx_lm.models import activations

    replace_in_models("swiglu", activations.swiglu, lambda f: f is swiglu)
