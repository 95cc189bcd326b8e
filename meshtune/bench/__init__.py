"""Benchmarks that run their peer in the same invocation and print both.

`meshtune bench peer`: stock `mlx_lm.lora` and meshtune on the same model, data,
batch, sequence length and iteration count, each in its own process under the same
BLAS, measured the same way (tokens over compute seconds of every report window
after the first, which holds compilation).

`meshtune bench adapters`: training step time and unfused generation speed of stock
mlx-lm LoRA/DoRA and meshtune LoRA/DoRA on a dense and a 4-bit base, side by side.

`meshtune bench scaling`: 1 rank against N ranks, gradient sync after the backward
against overlapped with it (`--in-process` measures inside one distributed job).

`meshtune bench pipeline`: the naive, GPipe and 1F1B schedules at P stages for several
micro-batch counts, with per-stage peak memory.

`meshtune bench badinput`: a corpus of bad inputs, each of which must exit 2 with one
error line naming the file or option and leave the output folder untouched.

`meshtune bench faults`: kill, stop, cut off or corrupt real 2- and 3-rank runs; each
must end cleanly with one line naming the lost rank, and `--resume` must reproduce an
uninterrupted run's weights.

`meshtune bench packing`: target tokens/s and padding share of the same steps with and
without data.pack.

`meshtune bench soak`: thousands of steps with memory growth checked, and repeated
short 3-rank runs that must never hang.

`meshtune bench plan`: `meshtune plan`'s memory estimate for each rank beside the peak
memory a real run of the same layout reports.

`meshtune bench torch`: meshtune beside PyTorch + transformers + PEFT on the same model,
batch and adapters: tokens/s, peak memory and useful TFLOP/s against each one's matmul peak.

`meshtune bench long-rows`: `meshtune train` with gradient checkpointing on rows of thousands of
tokens at batch 1 beside PyTorch + PEFT: tokens/s and peak memory per row length.

`meshtune bench serve`: decode tokens/s of `meshtune serve` beside `mlx_lm.server` on the same
LoRA and DoRA adapters, over a dense and a 4-bit base.

`meshtune bench startup`: seconds from process start to the first optimizer step of
`meshtune train`, per phase, with a cold and a warm MLX CUDA kernel cache (MLX_PTX_CACHE_DIR).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

# Suite name -> module of this package whose main(argv) runs it.
SUITES = {"peer": "peer", "adapters": "adapters", "scaling": "scaling", "pipeline": "pipeline",
          "badinput": "bad_input", "faults": "faults", "soak": "soak", "packing": "packing",
          "plan": "plan", "torch": "torch_peer", "startup": "startup", "long-rows": "long_rows",
          "serve": "serve_peer"}


def run_bench(suite: str | None, args: list[str]) -> int:
    """Dispatch `meshtune bench <suite> [options]`; with no suite, --help lists the suites."""
    if suite is None:
        if "-h" in args or "--help" in args:
            print(suites_help())
            return 0
        raise ValueError(f"no bench suite given; run meshtune bench SUITE with one of {', '.join(SUITES)} "
                         "(meshtune bench --help says what each measures)")
    if suite not in SUITES:
        raise ValueError(f"unknown bench suite '{suite}'; choose {', '.join(SUITES)}")
    return importlib.import_module(f".{SUITES[suite]}", __name__).main(args)


def suites_help() -> str:
    """Every suite with one line: the first line of its module's docstring, read without importing it."""
    lines = ["usage: meshtune bench SUITE [options]   (meshtune bench SUITE --help: that suite's options)", "",
             "suites:"]
    for name, module in SUITES.items():
        source = Path(__file__).with_name(f"{module}.py").read_text(encoding="utf-8")
        first = (ast.get_docstring(ast.parse(source)) or "").strip().splitlines()[:1] or [""]
        summary = re.sub(r"^`meshtune bench [^`]*`:\s*", "", first[0])
        lines.append(f"  {name:<10}{summary}")
    return "\n".join(lines)
