"""Benchmarks that run their peer in the same invocation and print both.

`meshtune bench peer`: stock `mlx_lm.lora` and meshtune on the same model, data,
batch, sequence length and iteration count, each in its own process under the same
BLAS, measured the same way (tokens over compute seconds of every report window
after the first, which holds compilation).
"""

from __future__ import annotations


def run_bench(suite: str, args: list[str]) -> int:
    """Dispatch `meshtune bench <suite> [options]`."""
    if suite == "peer":
        from .peer import main

        return main(args)
    raise ValueError(f"unknown bench suite '{suite}'; choose peer")
