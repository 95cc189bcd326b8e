"""Benchmarks that run their peer in the same invocation and print both.

`meshtune bench peer`: stock `mlx_lm.lora` and meshtune on the same model, data,
batch, sequence length and iteration count, each in its own process under the same
BLAS, measured the same way (tokens over compute seconds of every report window
after the first, which holds compilation).

`meshtune bench adapters`: training step time and unfused generation speed of stock
mlx-lm LoRA/DoRA and meshtune LoRA/DoRA on a dense and a 4-bit base, side by side.

`meshtune bench badinput`: a corpus of bad inputs, each of which must exit 2 with one
error line naming the file or option and leave the output folder untouched.

`meshtune bench faults`: kill, stop, cut off or corrupt real 2- and 3-rank runs; each
must end cleanly with one line naming the lost rank, and `--resume` must reproduce an
uninterrupted run's weights.

`meshtune bench soak`: thousands of steps with memory growth checked, and repeated
short 3-rank runs that must never hang.
"""

from __future__ import annotations


def run_bench(suite: str, args: list[str]) -> int:
    """Dispatch `meshtune bench <suite> [options]`."""
    if suite == "peer":
        from .peer import main

        return main(args)
    if suite == "adapters":
        from .adapters import main

        return main(args)
    if suite == "pipeline":
        from .pipeline import main

        return main(args)
    if suite == "badinput":
        from .bad_input import main

        return main(args)
    if suite == "faults":
        from .faults import main

        return main(args)
    if suite == "soak":
        from .soak import main

        return main(args)
    if suite == "scaling":
        from .scaling import main

        return main(args)
    raise ValueError(f"unknown bench suite '{suite}'; choose peer, adapters, pipeline, scaling, badinput, faults or soak")
