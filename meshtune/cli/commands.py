"""The `meshtune` subcommands (train, demo, fuse, generate, bench) and the parser that routes to them.

Each command is a thin call into the Python API (meshtune.api, meshtune.demo,
meshtune.bench); `meshtune launch` has its own parser (meshtune.cli.launch), which
reads a rank's `meshtune train` command with this one. Nothing here imports MLX at
the top: the BLAS choice (meshtune.cli.main) happens before MLX loads.
"""

from __future__ import annotations

import argparse
from typing import Any


def _train_config(args: argparse.Namespace, rest: list[str]) -> Any:
    from ..config import load_config, parse_override_args

    overrides = parse_override_args(rest)
    if args.resume:
        overrides.append(("output.resume", "true"))
    # No config and no model: train the embedded default (the demo's settings).
    if args.config is None and not any(k in ("--model", "model.path", "--model.path") for k, _ in overrides):
        from ..demo import DEMO_CONFIG

        args.config = str(DEMO_CONFIG)
    cfg = load_config(args.config, overrides)
    for line in cfg.mapped:
        print(f"mlx-lm key mapped: {line}")
    for line in cfg.notes:
        print(f"note: {line}")
    return cfg


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    """0 finished, 3 stopped on request, 65 a non-finite step stopped it (docs/reliability.md, exit codes)."""
    import sys

    from ..api import finetune
    from ..training import NONFINITE_EXIT_CODE
    from ..training.loop import NonFiniteStep

    cfg = _train_config(args, rest)
    try:
        result = finetune(cfg, mesh=_mesh(cfg))
    except NonFiniteStep as err:  # every rank stops at the same step and says it
        print(f"meshtune: {err}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT_CODE
    return 0 if not result.stopped_early else 3


def _mesh(cfg: Any) -> Any:
    """Single process unless launched by mlx.launch / meshtune launch (then the world group)."""
    import os

    from ..parallel.mesh import Mesh

    if any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_HOSTFILE")):
        import mlx.core as mx

        return Mesh.from_world(mx.distributed.init(), pp=cfg.parallel.pp)
    return Mesh.single()


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from ..demo import run_demo

    return run_demo(adapter_path=args.adapter_path, overrides=rest)


def cmd_fuse(args: argparse.Namespace, rest: list[str]) -> int:
    _no_extra(rest)
    from ..api import fuse

    model = args.model or _model_from_adapters(args.adapter_path)
    fuse(model, args.adapter_path, args.save_path, dequantize=args.dequantize)
    return 0


def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    _no_extra(rest)
    from ..api import generate

    model = args.model or (_model_from_adapters(args.adapter_path) if args.adapter_path else _default_model())
    print(generate(model, args.prompt, adapter_path=args.adapter_path, max_tokens=args.max_tokens))
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from ..bench import run_bench

    return run_bench(args.suite, rest)


def _default_model() -> str:
    from ..config import Config

    return str(Config().resolved_model_path())


def _model_from_adapters(adapter_path: str) -> str:
    """The base model recorded in adapter_config.json (as mlx-lm records it)."""
    import json
    from pathlib import Path

    config = Path(adapter_path) / "adapter_config.json"
    if not config.exists():
        raise ValueError(f"{config} not found; pass --adapter-path of a trained run or --model")
    model = json.loads(config.read_text()).get("model")
    if not model:
        raise ValueError(f"{config} records no base model; pass --model")
    return model


def _no_extra(rest: list[str]) -> None:
    if rest:
        raise ValueError(f"unexpected arguments {' '.join(rest)}; see --help")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshtune", description="Fine-tune language models with MLX.")
    parser.add_argument("--no-system-blas", action="store_true",
                        help="Keep MLX's bundled BLAS on Linux instead of a system OpenBLAS.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="Fine-tune (LoRA or full) from YAML and flags.",
                           description="Extra options: mlx_lm.lora flags (--model, --data, --iters, ...) "
                                       "and --section.key value for any config key.")
    train.add_argument("-c", "--config", help="YAML config (meshtune sections or an mlx-lm lora config).")
    train.add_argument("--resume", action="store_true", help="Continue the run in --adapter-path.")
    train.set_defaults(func=cmd_train)
    demo = sub.add_parser("demo", help="LoRA on the embedded model with before/after loss and accuracy.")
    demo.add_argument("--adapter-path", default="runs/demo", help="Where the demo run writes.")
    demo.set_defaults(func=cmd_demo)
    fuse = sub.add_parser("fuse", help="Merge adapters into the base model.")
    fuse.add_argument("--model", help="Base model (default: the one in adapter_config.json).")
    fuse.add_argument("--adapter-path", default="adapters", help="Folder with adapters.safetensors.")
    fuse.add_argument("--save-path", default="fused_model", help="Where to write the fused model.")
    fuse.add_argument("--dequantize", action="store_true", help="Write a dense model instead of requantizing.")
    fuse.set_defaults(func=cmd_fuse)
    gen = sub.add_parser("generate", help="Greedy completion of a prompt.")
    gen.add_argument("--model", help="Base model (default: from adapter_config.json or the embedded one).")
    gen.add_argument("--adapter-path", help="Adapters to apply.")
    gen.add_argument("--prompt", required=True, help="The user message.")
    gen.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate at most.")
    gen.set_defaults(func=cmd_generate)
    sub.add_parser("launch", help="Start N local ranks on the ring backend (see meshtune launch -h).")
    from ..bench import SUITES  # names only: no MLX import before the BLAS choice

    bench = sub.add_parser("bench", help="Benchmarks that run their peer in the same invocation.")
    bench.add_argument("suite", choices=list(SUITES),
                       help="peer: stock mlx_lm.lora vs meshtune; adapters: LoRA/DoRA step and generation, "
                            "stock mlx-lm vs meshtune, dense and 4-bit bases; badinput: bad inputs "
                            "must each fail with one clean error line; faults: kill/stop/cut/corrupt real "
                            "runs, then resume; soak: long run memory and repeated short runs.")
    bench.set_defaults(func=cmd_bench)
    return parser
