"""Command line: a thin layer from flags and YAML to the Python API.

`main` runs `meshtune COMMAND ...`: `meshtune --help` lists the commands, `meshtune COMMAND --help`
gives each one's flags, and README.md and docs/getting-started.md show them in use. On Linux the
command re-executes itself once with a system OpenBLAS preloaded when one is installed
(`--no-system-blas` or MESHTUNE_SYSTEM_BLAS=0 turns that off), and where MLX batches 100 operations
a CUDA graph (H100, H200, B200) it has MLX batch 50 (runtime/gpu_batches.py). This package must not
import MLX at the top: both choices happen before MLX loads. The subcommands and their parser are in
commands.py (generate, serve and export in inference_commands.py), `meshtune launch` in launch.py;
`python -m meshtune.cli` runs `main` (__main__.py).
"""

from __future__ import annotations

import argparse
import sys

from ..runtime.blas import ensure_fast_blas
from ..runtime.gpu_batches import use_smaller_gpu_batches
from .commands import build_parser

__all__ = ["build_parser", "main", "one_line"]

GPU_FREE_COMMANDS = ("config", "plan")  # they never compute on a GPU: no CUDA driver query for them


def _config_allows_system_blas(args: argparse.Namespace, rest: list[str]) -> bool:
    """runtime.system_blas from the train config (read without MLX); errors surface later."""
    if args.command != "train":
        return True
    from ..config import load_config, parse_override_args

    try:
        return load_config(args.config, parse_override_args(rest)).runtime.system_blas
    except ValueError:
        return True


def main(argv: list[str] | None = None) -> int:
    """Run `meshtune ARGV...` (default: sys.argv[1:]); the exit code (2: one error line on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # the rest belongs to the ranks' command, untouched
        from .launch import main as launch_main

        try:
            return launch_main(argv[1:])
        except ValueError as err:
            print(f"meshtune: error: {one_line(err)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before any rank started (its checks): nothing to stop
            return 130
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        ensure_fast_blas(enabled=not args.no_system_blas and _config_allows_system_blas(args, rest),
                         argv=["meshtune", *argv])
        if args.command not in GPU_FREE_COMMANDS:
            use_smaller_gpu_batches()
        return args.func(args, rest)
    except ValueError as err:
        print(f"meshtune: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (train's config being read, generate)
        print(f"meshtune: {args.command}: interrupted (SIGINT)", file=sys.stderr)
        return 130


def one_line(err: ValueError) -> str:
    """The error as the one stderr line a failed command promises (several config problems joined)."""
    problems = getattr(err, "problems", None)
    if problems and len(problems) > 1:
        return f"{len(problems)} configuration problems: " + " | ".join(problems)
    return " ".join(str(err).split())
