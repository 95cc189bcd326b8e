"""The `meshtune` subcommands (train, config, plan, demo, fuse, eval, report, bench) and the parser that routes to them.

generate, serve and export, which use a finished run, are in inference_commands.py.

Each command is a thin call into the Python API (meshtune.api, meshtune.demo,
meshtune.bench); `meshtune launch` has its own parser (meshtune.cli.launch), which
reads a rank's `meshtune train` command with this one. Nothing here imports MLX at
the top: the BLAS choice (meshtune.cli.main) happens before MLX loads.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from ..run_dir import ADAPTER_FILE, CONFIG_FILE, METRICS_FILE, PLOT_FILE, REPORT_FILE, RunDir
from ..runtime.relaunch import resume_command
from .run_args import check_adapter_folder, check_run_config, model_from_adapters, no_extra


def _train_config(args: argparse.Namespace, rest: list[str], say: Callable[[str], None] = print,
                  reads_data: bool = True) -> Any:
    """The run's config from -c, flags and (with --resume) the run's checkpoint; `say` gets the notes
    (`plan`, which reads no data, is not told which data it would train on).

    No -c, --model or --data (a bare `meshtune train`): the demo's settings. With --resume
    and a checkpoint in the adapter folder, the checkpoint's settings, flags checked against them.
    """
    from ..config import MLX_LM_FLAGS, load_config, parse_override_args
    from ..config.load import flag_spellings
    from ..config.resume import resume_config, saved_run_config

    overrides = parse_override_args(rest)
    if getattr(args, "resume", False):
        overrides.append(("output.resume", "true"))
    named = {MLX_LM_FLAGS.get(k, k).removeprefix("--").replace("-", "_") for k, _ in overrides}
    bare = args.config is None and not named & {"model.path", "data.path"}
    cfg = load_config(args.config, overrides)
    saved = saved_run_config(cfg.output.adapter_path) if cfg.output.resume else None
    if saved is not None:
        cfg = resume_config(cfg, *saved, spelled=flag_spellings(overrides))
        say(f"note: resuming with the settings saved in {saved[1]}")
    elif bare:
        from ..demo import DEMO_CONFIG

        cfg = load_config(DEMO_CONFIG, overrides)
        if not cfg.output.resume:  # a --resume with nothing to resume is an error (the run's), not a demo
            say(f"note: no --model/--data/-c given: the embedded tiny model on the arithmetic data, "
                f"with the demo's settings ({Path(DEMO_CONFIG).relative_to(Path(DEMO_CONFIG).parents[2])})")
    elif not cfg.data.path and reads_data:
        say("note: no --data given: training on the embedded arithmetic data; pass --data with a folder "
            "or a hub dataset id for your own")
    accumulate, iters = cfg.train.grad_accumulation_steps, cfg.train.iters
    if accumulate > 1 and reads_data and saved is None:
        say(f"note: train.iters counts optimizer updates, each of {accumulate} batches (grad_accumulation_steps): "
            f"{iters} updates read {iters * accumulate} batches; mlx_lm.lora's --iters counts batches, so for "
            f"its {iters} give --iters {max(iters // accumulate, 1)}")
    for line in cfg.mapped:
        say(f"mlx-lm key mapped: {line}")
    for line in cfg.notes:
        say(f"note: {line}")
    return cfg


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    """0 finished, 3 stopped on request, 65 a non-finite step stopped it, 71 out of memory, 128 + n stopped by
    signal n during set-up (docs/reliability.md, exit codes)."""
    from ..api import finetune
    from ..runtime.stop_signals import StopSignals
    from ..training import NONFINITE_EXIT_CODE, OUT_OF_MEMORY_EXIT_CODE, STOPPED_EXIT_CODE
    from ..training.divergence import Diverged
    from ..training.loop import NonFiniteStep, OutOfMemory, StoppedBeforeTraining

    cfg = _train_config(args, rest)
    mesh = _mesh(cfg)
    # Held from set-up to the exit: a signal at any moment is a stop request, never a traceback.
    with StopSignals() as stop:
        try:
            result = finetune(cfg, mesh=mesh, stop=stop)
        except StoppedBeforeTraining as err:
            print(f"meshtune: {err}", file=sys.stderr, flush=True)
            stop.keep_until_exit()
            return 128 + err.signum
        except (NonFiniteStep, Diverged) as err:  # every rank stops at the same step and says it
            print(f"meshtune: {err}", file=sys.stderr, flush=True)
            return NONFINITE_EXIT_CODE
        except OutOfMemory as err:
            print(f"meshtune: {err}", file=sys.stderr, flush=True)
            return OUT_OF_MEMORY_EXIT_CODE
        if not result.stopped_early:
            return 0
        line = continue_line(result, mesh)
        if line is not None:
            print(line, flush=True)
        # A request that comes late (a launcher passing on a signal its rank has already acted on) must not
        # turn this exit 3 into a kill while the interpreter shuts down.
        stop.keep_until_exit()
        return STOPPED_EXIT_CODE


def continue_line(result: Any, mesh: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """The line a run stopped on request ends with: the command that continues it on the ranks it ran on
    (started as `environ` says). Said once, by the writer (rank 0); None on the other ranks."""
    if not mesh.is_writer:
        return None
    return f"to continue from step {result.step}: {resume_command(result.adapter_path, mesh, environ)}"


def _mesh(cfg: Any) -> Any:
    """Single process unless launched by mlx.launch / meshtune launch (then the world group)."""
    from ..runtime.mesh import Mesh

    if any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "MLX_HOSTFILE")):
        import mlx.core as mx

        try:
            group = mx.distributed.init()
        except RuntimeError as err:  # the ring's sockets: MLX says "[ring] Couldn't bind socket (error: 99)"
            raise ValueError(backend_error(str(err), os.environ.get("MLX_RANK", "?"),
                                           os.environ.get("MLX_HOSTFILE", ""))) from None
        expected = os.environ.get("MLX_WORLD_SIZE", "")
        if expected.isdigit() and int(expected) != group.size():  # else each rank would train alone
            raise ValueError(world_mismatch(int(expected), group.size(), mx.distributed.is_available("nccl")))
        cfg.validate(world_size=group.size())  # a layout this world cannot run: the error names the flag
        return Mesh.from_world(group, pp=cfg.parallel.pp)
    return Mesh.single()


SOCKET_ERRORS = {
    98: "the address is already in use (another run, or a stale one, holds the port): pick other ports in the "
        "hostfile, or stop that process",
    99: "the address is not one of this host's: give this host's own IP in its hostfile entry (\"ips\")",
    111: "the peer refused the connection (not started, or a firewall): start every rank, and check the ports",
    113: "no route to the peer's address: check the hostfile's IPs and the link",
}


def backend_error(message: str, rank: str, hostfile: str) -> str:
    """The one line for a distributed backend that could not start: the socket error in words."""
    found = re.search(r"error:? (\d+)", message)
    why = SOCKET_ERRORS.get(int(found.group(1))) if found else None
    where = f" (hostfile {hostfile})" if hostfile else ""
    return (f"rank {rank}: the distributed backend could not start{where}: {' '.join(message.split())}"
            + (f"; {why}" if why else ""))


def world_mismatch(expected: int, formed: int, nccl_built: bool) -> str:
    """The error of a rank whose backend formed a smaller world than its launcher started."""
    why = ("" if nccl_built else "; this MLX has no NCCL (its CUDA build has): use --backend ring, or install "
           "mlx[cuda] on an NVIDIA machine")
    return (f"MLX_WORLD_SIZE={expected} ranks were started but the distributed backend formed a world of {formed}"
            f"{why}")


def cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    """Memory per rank and traffic per step of each layout (meshtune/plan; docs/plan.md)."""
    from ..plan import plan
    from ..runtime.hostfile import read_hostfile
    from ..plan.report import as_json, table

    # The config exactly as `meshtune train` reads it (the demo's with no -c, --model or --data).
    cfg = _train_config(args, rest, say=lambda line: print(line, file=sys.stderr if args.json else sys.stdout),
                        reads_data=False)
    if cfg.data.path:  # the same check, and the same error, as train's before its model loads
        from ..data import check_source
        from ..run_data import split_names

        check_source(str(cfg.resolved_data_path()), split_names(cfg))
    hostfile = read_hostfile(Path(args.hostfile)) if args.hostfile else None
    ranks = len(hostfile.hosts) if hostfile else args.ranks
    links = args.links if args.links is not None else hostfile.links if hostfile else 1
    seq_len, seq_len_from = args.seq_len, None
    if cfg.data.path and seq_len is None:  # the lengths the data has (packed: its rows), as train reads it
        from ..plan.data_lengths import data_row_length

        seq_len, seq_len_from = data_row_length(cfg)
    result = plan(cfg, ranks, args.memory_gb, args.link, seq_len=seq_len, seq_len_from=seq_len_from, links=links)
    print(as_json(result) if args.json else table(result))
    return 0


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from ..demo import run_demo

    return run_demo(adapter_path=args.adapter_path, overrides=rest)


def cmd_fuse(args: argparse.Namespace, rest: list[str]) -> int:
    no_extra(rest)
    from ..inference import fuse

    check_adapter_folder(args.adapter_path)
    model = args.model or model_from_adapters(args.adapter_path, "")
    fuse(model, args.adapter_path, args.save_path, dequantize=args.dequantize, overwrite=args.overwrite)
    return 0


def cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    """Score trained adapters on a split: the run's own settings, flags on top."""
    from ..config import load_config, parse_override_args

    check_adapter_folder(args.adapter_path)
    check_run_config(args.adapter_path, " (or a data-parallel run's checkpoint)")
    if args.batches == 0 or args.batches < -1:
        raise ValueError(f"--batches {args.batches}: give a count of at least 1, or -1 for every full batch")
    cfg = load_config(str(RunDir(args.adapter_path).config), parse_override_args(rest))
    for line in cfg.notes:
        print(f"note: {line}", file=sys.stderr)
    cfg.validate()
    from ..inference import evaluate_adapters

    evaluate_adapters(cfg, args.adapter_path, split=args.split, batches=args.batches)
    return 0


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    """Print the config `meshtune train` would run with these arguments, as YAML that -c reads back."""
    from ..config.show import config_yaml
    from ..training.trackers import tracker_names

    cfg = _train_config(args, rest, say=lambda line: print(line, file=sys.stderr))
    # What train would refuse, refused here too, on the fewest ranks the layout runs on.
    cfg.validate(world_size=max(cfg.parallel.pp, 1) * max(cfg.parallel.dp, 1))
    tracker_names(cfg.output.report_to)  # the names; whether their libraries import is the run's machine's
    print(config_yaml(cfg), end="")
    return 0


def cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    """report.md, loss.png and the summary line of a run from its metrics.jsonl (a killed run's too)."""
    no_extra(rest)
    from ..report import main as report_main

    return report_main([args.adapter_path])


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from ..bench import run_bench

    return run_bench(args.suite, rest)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: `plan --rank 2` must not be read as --ranks 2 (train's options are --section.key).
    parser = argparse.ArgumentParser(prog="meshtune", description="Fine-tune language models with MLX.",
                                     allow_abbrev=False)
    parser.add_argument("--no-system-blas", action="store_true",
                        help="Keep MLX's bundled BLAS on Linux instead of a system OpenBLAS.")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    from ..config.show import options_help

    every_option = options_help()  # the epilog of train, config and plan
    _add_train(sub, every_option)
    _add_plan(sub, every_option)
    _add_run_tools(sub)
    from .inference_commands import add_export, add_generate, add_serve

    add_generate(sub)
    add_serve(sub)
    add_export(sub)
    sub.add_parser("launch", help="Start N local ranks on the ring backend (see meshtune launch -h).")
    from ..bench import SUITES  # names only: no MLX import before the BLAS choice

    # -h/--help goes to the suite (its own flags) or, with no suite, to run_bench (the list of suites).
    bench = sub.add_parser("bench", help="Benchmarks that run their peer in the same invocation "
                                         "(meshtune bench --help lists them).", add_help=False)
    bench.add_argument("suite", nargs="?", choices=list(SUITES), help="The suite (meshtune bench --help).")
    bench.set_defaults(func=cmd_bench)
    return parser


def _add_train(sub: Any, every_option: str) -> None:
    """`meshtune train` and `meshtune config`: the same options, one runs them and one prints them."""
    for name, func, doc in (
        ("train", cmd_train, "Fine-tune (LoRA, DoRA or full) from YAML and flags."),
        ("config", cmd_config, "Print the resolved config of a train command as YAML (-c reads it back)."),
    ):
        cmd = sub.add_parser(name, help=doc, epilog=every_option,
                             formatter_class=argparse.RawDescriptionHelpFormatter,
                             description=f"{doc} Options: mlx_lm.lora flags (--model, --data, --iters, ...) and "
                                         "--section.key VALUE for any config key, listed below. With none of "
                                         "-c, --model and --data: the demo's settings (meshtune/configs/demo.yaml).")
        cmd.add_argument("-c", "--config", help="YAML config (meshtune sections or an mlx-lm lora config).")
        cmd.add_argument("--resume", action="store_true",
                         help="Continue the run in --adapter-path with the settings its checkpoint saved.")
        cmd.set_defaults(func=func)


def _add_plan(sub: Any, every_option: str) -> None:
    """`meshtune plan`: train's options, and the machines to plan for."""
    plan = sub.add_parser("plan", help="Memory per rank, bubble and traffic of each layout; which fits.",
                          epilog=every_option, formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="Takes `meshtune train`'s options (-c, mlx_lm.lora flags, --section.key "
                                      "value); reads config.json and safetensors headers, no weights, and with "
                                      "--data the train split, tokenized as train reads it.")
    plan.add_argument("-c", "--config", help="YAML config (meshtune sections or an mlx-lm lora config).")
    ranks = plan.add_mutually_exclusive_group()
    ranks.add_argument("--ranks", type=int, default=1, help="Ranks to plan for (default 1).")
    ranks.add_argument("--hostfile", help="mlx.launch's hostfile, as meshtune launch reads it: one rank per entry.")
    plan.add_argument("--memory-gb", type=float, default=16.0, help="Memory of one rank in GB (default 16).")
    plan.add_argument("--link", default="10gbit", help="One link's bandwidth between ranks: 1gbit, 10gbit, 100mbit, "
                                                       "5GB/s ... (default 10gbit).")
    plan.add_argument("--links", type=int, default=None,
                      help="Links (cables) each rank has; MLX's ring stripes over them (default: the addresses "
                           "each --hostfile host lists, else 1).")
    plan.add_argument("--seq-len", type=int, default=None,
                      help="Tokens per example after padding (default: with --data, the widest batch the data "
                           "makes, with data.pack the packed row train would take; else data.pack_length or "
                           "data.max_seq_length, the worst case).")
    plan.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    plan.set_defaults(func=cmd_plan)


def _add_run_tools(sub: Any) -> None:
    """The commands around a run: the demo, and fuse, eval and report of a run's folder."""
    demo = sub.add_parser("demo", help="LoRA on the embedded model with before/after loss and accuracy.")
    demo.add_argument("--adapter-path", default="runs/demo", help="Where the demo run writes.")
    demo.set_defaults(func=cmd_demo)
    fuse = sub.add_parser("fuse", help="Merge adapters into the base model.")
    fuse.add_argument("--model", help=f"Base model (default: the one in {CONFIG_FILE}).")
    fuse.add_argument("--adapter-path", default="adapters", help=f"Folder with {ADAPTER_FILE}.")
    fuse.add_argument("--save-path", default="fused_model", help="Where to write the fused model.")
    fuse.add_argument("--dequantize", action="store_true", help="Write a dense model instead of requantizing.")
    fuse.add_argument("--overwrite", action="store_true", help="Write into a --save-path that already holds files.")
    fuse.set_defaults(func=cmd_fuse)
    ev = sub.add_parser("eval", help="Loss and perplexity of trained adapters on a data split (mlx_lm.lora --test "
                                     "without --train).",
                        description=f"Reads the run's settings from ADAPTER_PATH/{CONFIG_FILE} (meshtune's or "
                                    "mlx-lm's); flags override them, e.g. --data, --batch-size, --max-seq-length, "
                                    "--model.")
    ev.add_argument("--adapter-path", default="adapters", help="A run folder, or one of its checkpoints.")
    ev.add_argument("--split", choices=["test", "valid"], default="test", help="The split to score (default test).")
    ev.add_argument("--batches", type=int, default=-1, help="Batches to score, -1 (the default) every full one.")
    ev.set_defaults(func=cmd_eval)
    rep = sub.add_parser("report", help=f"Write {REPORT_FILE} and {PLOT_FILE} of a run from its {METRICS_FILE}, "
                                        "e.g. one cut off by kill -9, and print its summary line.")
    rep.add_argument("--adapter-path", default="adapters", help="The run's folder.")
    rep.set_defaults(func=cmd_report)
