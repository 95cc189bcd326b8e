"""The frozen base's matmul for adapter layers: quantized kernel or dequantize-then-dense.

A quantized base can be multiplied two ways with the same result (within float
rounding): `quantized_matmul` / `gather_qmm` on the packed weight, or dequantize the
weight on the fly and use the dense `matmul` / `gather_mm`. The quantized kernel wins at
a few tokens (generation reads 4x less memory); the dense kernel wins at training token
counts (docs/performance.md).
Where the crossover lies depends on the machine, the backend and the layer shape, so
`auto` measures it once per (shape, bits, group size, mode, dtype) with
`measure_crossover`; "quantized" and "dequantized" pin either path. A `BasePath`, built once
for a run and handed to every adapter layer, holds the mode and those crossovers.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

MODES = ("auto", "quantized", "dequantized")
NEVER = sys.maxsize  # crossover when dequantizing never won the measurement
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)

def is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, QUANTIZED)


def _dequantize(layer: nn.Module, weight: mx.array, scales: mx.array, biases: mx.array | None,
                global_scale: mx.array | None = None) -> mx.array:
    return mx.dequantize(weight, scales, biases, group_size=layer.group_size, bits=layer.bits,
                         mode=layer.mode, global_scale=global_scale)


def dequantized_weight(layer: nn.Module) -> mx.array:
    """The base weight as a dense array ((out, in), (num_embeddings, dims) or (E, out, in))."""
    if not is_quantized(layer):
        return layer.weight
    global_scale = layer.get("global_scale") if isinstance(layer, QuantizedSwitchLinear) else None
    if global_scale is None:
        return _dequantize(layer, layer.weight, layer.scales, layer.get("biases"))
    # nvfp4 experts carry one global scale each and dequantize accepts only a scalar.
    return mx.stack([_dequantize(layer, layer.weight[e], layer.scales[e], None, global_scale[e])
                     for e in range(layer.weight.shape[0])])


def _key(layer: nn.Module) -> tuple:
    experts = layer.weight.shape[0] if layer.weight.ndim == 3 else 0
    out_dims, packed = layer.weight.shape[-2:]
    # Affine scales carry the model's float dtype; the fp modes' are uint8 and dequantize to bf16.
    dtype = layer.scales.dtype if mx.issubdtype(layer.scales.dtype, mx.floating) else mx.bfloat16
    return (experts, out_dims, packed * 32 // layer.bits, layer.bits, layer.group_size, layer.mode, dtype)


class BasePath:
    """How one run's (or one loaded model's) quantized bases multiply: `mode`, and in "auto" the
    crossovers measured (or adopted from a run's folder), by layer shape.

    Built once (api.finetune from `adapter.base_path`, and on --resume the crossovers the run kept;
    load_for_inference for a model it adapts) and handed to apply_adapters, which gives it to every
    adapter layer and routed frozen layer: they multiply through its methods. `measure` is what
    "auto" calls for a shape it has no crossover for (measure_crossover's signature).
    """

    def __init__(self, mode: str = "auto", *, measure: Callable[..., int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"base path mode {mode!r} is not one of {', '.join(MODES)}; use auto unless "
                             "you have measured otherwise")
        self.mode = mode
        self._measure = measure or measure_crossover
        self._crossovers: dict[tuple, int] = {}

    def crossover_for(self, layer: nn.Module) -> int:
        """Token count from which the dequantized path is faster for this layer (measured once a shape)."""
        key = _key(layer)
        if key not in self._crossovers:
            experts, out_dims, in_dims, bits, group_size, mode, dtype = key
            self._crossovers[key] = self._measure(out_dims, in_dims, bits=bits, group_size=group_size, mode=mode,
                                                  num_experts=experts, dtype=dtype)
        return self._crossovers[key]

    def measured(self) -> dict[str, int]:
        """The crossovers measured or adopted, by layer shape: what a run keeps in its folder, so that a
        resumed run multiplies as the run did (a measurement can fall either way where the two paths are
        close, and their results differ in the last bits)."""
        return {",".join(map(str, key[:-1])) + f",{str(key[-1]).rpartition('.')[2]}": value
                for key, value in self._crossovers.items()}

    def adopt(self, saved: dict[str, int]) -> int:
        """Take crossovers a run kept (measured()'s), in place of measuring them; returns how many."""
        for text, value in saved.items():
            experts, out_dims, in_dims, bits, group_size, mode, dtype = text.split(",")
            key = (int(experts), int(out_dims), int(in_dims), int(bits), int(group_size), mode, getattr(mx, dtype))
            self._crossovers[key] = int(value)
        return len(saved)

    def warm(self, layer: nn.Module) -> None:
        """Measure the quantized/dense crossover now, at start-up, rather than in the first step."""
        if is_quantized(layer) and self.mode == "auto":
            self.crossover_for(layer)

    def use_dequantized(self, layer: nn.Module, tokens: int) -> bool:
        """Whether `layer` should multiply `tokens` rows through a dequantized weight."""
        if self.mode == "quantized" or not is_quantized(layer):
            return False
        # Per layer, once: this runs for every layer on every generated token.
        threshold = layer.__dict__.get("_dequantize_from")
        if threshold is None or threshold[0] is not self:
            if layer.get("global_scale") is not None:
                at = NEVER  # per-expert global scales: only the quantized kernel takes them as a batch
            else:
                at = 0 if self.mode == "dequantized" else self.crossover_for(layer)
            threshold = layer.__dict__["_dequantize_from"] = (self, at)
        return tokens >= threshold[1]

    def uses_dense_weight(self, layer: nn.Module, tokens: int) -> bool:
        """Whether `layer` multiplies `tokens` rows through a dense weight (its own, or dequantized)."""
        return not is_quantized(layer) or self.use_dequantized(layer, tokens)

    def dense_weight_for(self, layer: nn.Module, tokens: int) -> mx.array | None:
        """The dense (out, in) weight `layer` multiplies `tokens` rows by; None for the quantized kernel.

        A caller that needs more products with the same weight (DoRA's norm on A's r rows)
        reuses this one array instead of sending r rows through a quantized kernel or
        dequantizing twice.
        """
        if not self.uses_dense_weight(layer, tokens):
            return None
        return dequantized_weight(layer) if is_quantized(layer) else layer.weight

    def linear_forward(self, layer: nn.Module, x: mx.array, *, bias: bool = True) -> mx.array:
        """x @ W^T (+ bias) for Linear / QuantizedLinear, or a (quantized) embedding's as_linear."""
        if not is_quantized(layer):
            if bias and "bias" in layer:
                return layer(x)  # the layer's own addmm, so an adapter at step 0 is bit-exact
            return x @ layer.weight.T
        if self.use_dequantized(layer, x.size // x.shape[-1]):
            y = x @ dequantized_weight(layer).T
        else:
            y = mx.quantized_matmul(x, layer["weight"], scales=layer["scales"], biases=layer.get("biases"),
                                    transpose=True, group_size=layer.group_size, bits=layer.bits,
                                    mode=layer.mode)
        return y + layer["bias"] if bias and "bias" in layer else y

    def switch_forward(self, layer: nn.Module, x: mx.array, indices: mx.array, *, sorted_indices: bool = False,
                       bias: bool = True) -> mx.array:
        """The SwitchLinear / QuantizedSwitchLinear product on the model's own gather kernels."""
        if not is_quantized(layer):
            y = mx.gather_mm(x, layer["weight"].swapaxes(-1, -2), rhs_indices=indices,
                             sorted_indices=sorted_indices)
        elif self.use_dequantized(layer, indices.size * x.shape[-2]):
            y = mx.gather_mm(x, dequantized_weight(layer).swapaxes(-1, -2), rhs_indices=indices,
                             sorted_indices=sorted_indices)
        else:
            y = mx.gather_qmm(x, layer["weight"], layer["scales"], layer.get("biases"), rhs_indices=indices,
                              transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                              global_scale=layer.get("global_scale"), sorted_indices=sorted_indices)
        if bias and "bias" in layer:
            y = y + mx.expand_dims(layer["bias"][indices], -2)
        return y


MIN_TIMED_SECONDS = 2e-3  # a timing shorter than this is mostly launch and synchronisation jitter on a GPU
MAX_CALLS_A_TIMING = 64


def _calls_a_timing(fn: Callable[[], mx.array]) -> int:
    """How many calls of `fn` one timing runs: enough to last MIN_TIMED_SECONDS (one on a slow CPU)."""
    start = time.perf_counter()
    mx.eval(fn())
    once = time.perf_counter() - start
    return max(1, min(MAX_CALLS_A_TIMING, int(MIN_TIMED_SECONDS / max(once, 1e-9)) + 1))


def _seconds_a_call(fn: Callable[[], mx.array], calls: int) -> float:
    """Wall time of `calls` calls of `fn` queued back to back (each output dropped once queued,
    so memory holds one or two), divided by `calls`."""
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
        mx.async_eval(out)
    mx.eval(out)
    return (time.perf_counter() - start) / calls


def _runs(fn: Callable[[], mx.array]) -> bool:
    """Whether `fn` runs here, its first call made (allocation and kernel set-up kept out of the timings)."""
    try:
        mx.eval(fn())
        return True
    except RuntimeError:  # a kernel this backend lacks for the dtype (CPU gather_mm: float32 only)
        return False


def _dense_is_faster(dense: Callable[[], mx.array], quant: Callable[[], mx.array], repeats: int) -> bool:
    """Whether `dense` beats `quant`: the best of `repeats` interleaved timings each, every timing
    long enough that a GPU's launch jitter does not decide it."""
    dense_runs, quant_runs = _runs(dense), _runs(quant)
    if not (dense_runs and quant_runs):
        return dense_runs
    calls = _calls_a_timing(quant)
    best = {dense: float("inf"), quant: float("inf")}
    for _ in range(repeats):
        for fn in (dense, quant):
            best[fn] = min(best[fn], _seconds_a_call(fn, calls))
    return best[dense] < best[quant]


def measure_crossover(out_dims: int, in_dims: int, *, bits: int, group_size: int, mode: str = "affine",
                      num_experts: int = 0, dtype: mx.Dtype = mx.float32,
                      token_counts: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096),
                      repeats: int = 3) -> int:
    """Smallest token count at which dequantize + dense matmul beat the quantized kernel.

    Counts rise geometrically and the search stops at the second win in a row (the
    dense path's advantage grows with the token count, and one noisy win is not
    trusted), so large shapes are never timed far past their crossover. NEVER if the
    quantized kernel wins throughout. `num_experts` > 0 times the gather kernels.
    """
    # Own keys, never the global RNG: measuring must not shift a seeded run's initialisation.
    keys = iter(mx.random.split(mx.random.key(0), 2 * len(token_counts) + 1))
    shape = (num_experts, out_dims, in_dims) if num_experts else (out_dims, in_dims)
    w = mx.random.normal(shape, scale=in_dims ** -0.5, key=next(keys)).astype(dtype)
    try:
        packed, scales, *rest = mx.quantize(w, group_size, bits, mode=mode)
        biases = rest[0] if rest else None
        mx.eval(packed, scales, biases)
    except (RuntimeError, ValueError):
        return NEVER  # this backend cannot even quantize the shape: keep the layer's own kernel
    kw = dict(group_size=group_size, bits=bits, mode=mode)
    first_win = None
    for tokens in token_counts:
        if num_experts:
            x = mx.random.normal((tokens, 1, in_dims), key=next(keys)).astype(dtype)
            idx = mx.sort(mx.random.randint(0, num_experts, (tokens,), key=next(keys)).astype(mx.uint32))
            mx.eval(x, idx)
            quant = lambda: mx.gather_qmm(x, packed, scales, biases, rhs_indices=idx, transpose=True,
                                          sorted_indices=True, **kw)
            dense = lambda: mx.gather_mm(x, mx.dequantize(packed, scales, biases, **kw).swapaxes(-1, -2),
                                         rhs_indices=idx, sorted_indices=True)
        else:
            x = mx.random.normal((tokens, in_dims), key=next(keys)).astype(dtype)
            mx.eval(x)
            quant = lambda: mx.quantized_matmul(x, packed, scales, biases, transpose=True, **kw)
            dense = lambda: x @ mx.dequantize(packed, scales, biases, **kw).T
        if _dense_is_faster(dense, quant, repeats):
            if first_win is not None:
                return first_win
            first_win = tokens
        else:
            first_win = None
    return first_win if first_win is not None else NEVER
