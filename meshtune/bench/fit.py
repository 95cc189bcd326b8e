"""Which model size a bench runs here: the device and memory found, and each size's need computed from its shapes.

Every suite that builds a model asks `choose_preset` (or, for a fixed model, `describe_fixed`) and
prints the one line it returns. A size's need (`model_need`) is rough on purpose: it only has to
tell a 1B model on a 24 GB CPU from one on a 140 GB GPU. An explicit --preset always wins, with a
warning when it will not fit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..runtime.device_memory import GB, Machine, detect
from .models import BITS, GROUP_SIZE, PRESETS, Shape

# A bench may plan with this share of the memory found; the rest is the OS's, Python's, MLX's caches' and
# other processes'.
HEADROOM = 0.8
ORDER = ("tiny", "small", "1b")  # smallest first
# 1b needs a GPU: on a CPU it takes tens of minutes per invocation.
CPU_PRESETS = ("tiny", "small")


@dataclass(frozen=True)
class Load:
    """How a suite holds a model at its peak."""

    dense: float = 1.0  # dense copies alive at once
    quantized: int = 0  # 4-bit copies (group 64) alive at once
    full: bool = False  # every weight trains: gradients and two Adam moments per weight
    processes: int = 1  # ranks sharing this memory, each holding all of the above
    stages: int = 1  # pipeline stages splitting one copy (each rank holds 1/stages of it)
    dtype_bytes: int = 4  # bytes per dense weight and activation value


def model_need(shape: Shape, batch: int, seq: int, load: Load) -> int:
    """Bytes the suite needs for `shape` trained on batch x seq tokens, as `load` holds it.

    Parameters times bytes per weight for every copy held at once, plus gradients and Adam moments
    when every weight trains, plus the activations a training step keeps for its backward: per token
    and layer about 10 x hidden + 4 x intermediate + heads x sequence values, and three
    vocabulary-wide rows for the loss.
    """
    params = shape.params()
    weights = params * load.dtype_bytes * load.dense
    # 4-bit weights plus a scale and a bias per group of 64, in the dense dtype.
    weights += load.quantized * params * (BITS / 8 + 2 * load.dtype_bytes / GROUP_SIZE)
    state = 3 * params * load.dtype_bytes if load.full else 0  # gradients + Adam's two moments
    per_token = shape.layers * (10 * shape.hidden + 4 * shape.intermediate + shape.heads * seq) + 3 * shape.vocab
    activations = batch * seq * per_token * load.dtype_bytes
    return int(load.processes * (weights + state + activations) / load.stages)


def preset_shape(name: str, arch: str = "qwen3", presets: dict[str, dict[str, int]] | None = None) -> Shape:
    """The dimensions of a preset of bench/models.py (or of `presets`, a suite's own table of the same keys)."""
    p = (presets or PRESETS)[name]
    return Shape(arch=arch, **{k: p[k] for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")})


def preset_need(name: str, load: Load, batch: int | None = None, seq: int | None = None,
                presets: dict[str, dict[str, int]] | None = None) -> int:
    """A preset's need under `load`, at its own batch and sequence length unless given."""
    p = (presets or PRESETS)[name]
    return model_need(preset_shape(name, presets=presets), batch or p["batch_size"], seq or p["seq_len"], load)


def fits(need: int, machine: Machine) -> bool:
    return need <= HEADROOM * machine.memory


def choose_preset(requested: str | None, load: Load, machine: Machine, *, batch: int | None = None,
                  seq: int | None = None, candidates: tuple[str, ...] | None = None,
                  presets: dict[str, dict[str, int]] | None = None) -> tuple[str, str]:
    """(preset, the line that says why): the largest candidate that fits `machine`, or `requested`.

    The line reads, e.g.

        preset: small (CPU AMD EPYC, 23.7 GB RAM available, small needs ~0.1 GB; 1b needs ~38.7 GB
        and a GPU: pass --preset 1b to force)

    On a CPU only CPU_PRESETS are candidates; when none fits, the smallest runs. `batch`
    and `seq` are the flags that override the presets' own (None: the preset's). `presets`
    is a suite's own table, smallest first (default: bench/models.py's, in ORDER).
    """
    order = tuple(presets) if presets else ORDER
    candidates = candidates or order
    needs = {name: preset_need(name, load, batch, seq, presets) for name in order}
    gb = {name: f"~{needs[name] / GB:.1f} GB" for name in order}
    if requested is not None:
        line = f"preset: {requested} (--preset; {machine.describe()}, {requested} needs {gb[requested]})"
        if not fits(needs[requested], machine):
            print(f"meshtune bench: warning: --preset {requested} needs {gb[requested]}, more than "
                  f"{HEADROOM:.0%} of this {machine.kind}'s {machine.memory / GB:.1f} GB: it may run out of memory; "
                  "leave --preset out to pick a size that fits", file=sys.stderr, flush=True)
        return requested, line
    allowed = [n for n in candidates if machine.kind == "GPU" or n in CPU_PRESETS]
    fitting = [n for n in allowed if fits(needs[n], machine)]
    chosen = fitting[-1] if fitting else allowed[0]
    line = f"preset: {chosen} ({machine.describe()}, {chosen} needs {gb[chosen]}"
    larger = [n for n in candidates if order.index(n) > order.index(chosen)]
    if larger:
        bigger = larger[0]
        why = gb[bigger] + (" and a GPU" if machine.kind == "CPU" and bigger not in CPU_PRESETS else "")
        line += f"; {bigger} needs {why}: pass --preset {bigger} to force"
    elif not fitting:
        line += ", more than fits: it may run out of memory"
    return chosen, line + ")"


def describe_fixed(what: str, shape: Shape, batch: int, seq: int, load: Load, machine: Machine) -> str:
    """The line of a suite whose model is fixed, e.g. the embedded tiny model."""
    need = model_need(shape, batch, seq, load)
    ranks = f" for {load.processes} ranks" if load.processes > 1 else ""
    verdict = "" if fits(need, machine) else ": more than fits, it may run out of memory"
    return f"model: {what} ({machine.describe()}, needs ~{need / GB:.2f} GB{ranks}{verdict})"


def embedded_shape() -> Shape:
    """The embedded tiny model's dimensions, from its config.json."""
    import json
    from pathlib import Path

    c = json.loads((Path(__file__).resolve().parents[1] / "assets" / "tiny-llama" / "config.json").read_text())
    return Shape(arch="llama", layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                 intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                 kv_heads=c["num_key_value_heads"], vocab=c["vocab_size"])


def embedded_line(batch: int, seq: int, load: Load, machine: Machine | None = None) -> str:
    """describe_fixed for the embedded tiny model on this machine."""
    return describe_fixed("the embedded tiny model", embedded_shape(), batch, seq, load, machine or detect())
