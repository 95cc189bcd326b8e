"""`meshtune launch`: start N ranks and fail loudly and together (parallel/launcher.py does it).

    meshtune launch -n 2 -- meshtune train -c run.yaml
    meshtune launch -n 2 --no-pin -- python my_script.py   # ranks share every core
    meshtune launch --hostfile hosts.json -- meshtune train -c run.yaml   # one rank per host, over ssh
    meshtune launch -n 2 --backend nccl -- meshtune train -c run.yaml     # one rank per GPU of this machine
    meshtune launch --hostfile hosts.json --backend jaccl -- meshtune train   # RDMA over Thunderbolt 5

Each rank's output is prefixed `[rank i]`; when a rank is lost or fails, one line names it and the
others are stopped. Local ring ranks are pinned one core each when there are no more ranks than
cores. Every address a hostfile host lists is one link of the ring.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from ..parallel.launcher import BACKENDS, check_hosts, launch_ranks
from ..parallel.link_check import check_links
from ..runtime.hostfile import JACCL_BACKENDS, read_hostfile
from ..runtime.relaunch import LAUNCH_ENV


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="meshtune launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-ranks", type=int, default=None,
                   help="Ranks to start (on this machine, or one per --hostfile entry).")
    p.add_argument("--hostfile", default=None,
                   help='mlx.launch\'s JSON hostfile: [{"ssh": host, "ips": [ip, ...]}, ...]; rank i runs on entry i '
                        "through ssh; each address a host lists is one link (cable) the ring stripes over.")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="One core and one BLAS thread per local rank (default: on for ring ranks when there "
                        "are no more ranks than cores; --no-pin turns it off).")
    p.add_argument("--timeout", type=float, default=None, help="Stop all ranks after this many seconds.")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="ring (CPU, Thunderbolt, Ethernet), nccl (one rank per GPU of this machine, MLX's CUDA "
                        "build), jaccl or jaccl-ring (RDMA over Thunderbolt 5, hosts from --hostfile with their "
                        '"rdma" devices). Default: the hostfile\'s "backend", else ring.')
    p.add_argument("--link-check", action=argparse.BooleanOptionalAction, default=True,
                   help="With --hostfile on the ring: before any rank starts, check over ssh that every address is "
                        "its host's, answers from the host before it, and has an interface of its own "
                        "(parallel/link_check.py). --no-link-check skips it.")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs.")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if command[:1] == ["meshtune"]:
        command = [sys.executable, "-m", "meshtune.cli", *command[1:]]
    hostfile = read_hostfile(Path(a.hostfile)) if a.hostfile else None
    backend = a.backend or (hostfile.backend if hostfile and hostfile.backend else "ring")
    if backend not in BACKENDS:
        raise ValueError(f'--hostfile {a.hostfile}: "backend" {backend!r} is not one meshtune launch starts; give '
                         f"--backend {' or '.join(BACKENDS)}")
    if hostfile is not None and backend in JACCL_BACKENDS:
        hostfile.check_jaccl(backend)
    elif hostfile is not None:
        hostfile.check_ring()
    n = a.num_ranks if a.num_ranks is not None else (len(hostfile.hosts) if hostfile else None)
    if n is None:
        raise ValueError("give -n N (ranks on this machine) or --hostfile hosts.json (one rank per entry)")
    if not command:
        raise ValueError("no command to run; give it after --, e.g. meshtune launch -n 2 -- meshtune train")
    check_hosts(n, hostfile)
    if hostfile is None and shutil.which(command[0]) is None:
        if Path(command[0]).is_file():
            raise ValueError(f"command {command[0]!r} is not executable; chmod +x {command[0]}, or run it through "
                             f"its interpreter (e.g. -- bash {command[0]})")
        raise ValueError(f"command {command[0]!r} not found (not a file, nor on PATH); e.g. "
                         "meshtune launch -n 2 -- meshtune train ...")
    if backend == "nccl" and "meshtune.cli" in command and not _nccl_built():  # the ranks' own check, once
        raise ValueError("--backend nccl: this MLX has no NCCL (MLX's CUDA build has it: pip install mlx[cuda]); "
                         "use --backend ring")
    preflight(n, command)
    if hostfile is not None and backend == "ring" and n > 1 and a.link_check:
        check_links(hostfile, cwd=os.getcwd(), python=sys.executable, env=dict(os.environ))
    # How the ranks' resume line says to start them again (runtime/relaunch.resume_command).
    again = (f"meshtune launch --hostfile {shlex.quote(str(Path(a.hostfile).resolve()))}" if a.hostfile
             else f"meshtune launch -n {n}") + (f" --backend {backend}" if backend != "ring" else "")
    pin, note = pin_choice(n, a.pin, remote=hostfile is not None, backend=backend)
    if note:
        print(f"meshtune launch: note: {note}", file=sys.stderr, flush=True)
    return launch_ranks(n, command, pin=pin, timeout=a.timeout, hostfile=hostfile, backend=backend,
                        env={**os.environ, LAUNCH_ENV: again})


def _runs_on(cfg: Any, n: int) -> bool:
    """Whether `cfg`'s layout runs on n ranks."""
    from ..config import ConfigError

    try:
        cfg.validate(world_size=n)
    except ConfigError:
        return False
    return True


def _nccl_built() -> bool:
    import mlx.core as mx

    return mx.distributed.is_available("nccl")


def pin_choice(n: int, requested: bool | None, *, remote: bool, backend: str = "ring",
               cores: int | None = None) -> tuple[bool, str]:
    """(pin the ranks, a note to print or ""): --pin/--no-pin when given, else pin n <= cores local ring ranks.

    Remote ranks (--hostfile) are never pinned from here. `cores` defaults to the cores this
    process may run on.
    """
    if remote:
        return False, ""
    if requested is not None:
        return requested, ""
    if backend != "ring":  # a GPU rank's CPU work is not BLAS-bound: leave it every core
        return False, ""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if n > cores:
        return False, (f"{n} ranks on {cores} cores: ranks not pinned (they share the cores; "
                       "--no-pin silences this)")
    return True, ""


def preflight(n: int, command: list[str]) -> None:
    """Check a `meshtune train` command's config for n ranks before any rank starts.

    The layout rules (batch divisible by the data-parallel ranks, pp dividing n, no
    more stages than blocks) need the world size, which only the launcher knows up
    front; without this each rank would load the model first and fail n times.
    """
    if "meshtune.cli" not in command or "train" not in command:
        return
    from ..config import ConfigError
    from ..parallel.pipeline.split import check_pipeline_layout
    from .commands import _train_config, build_parser

    args, rest = build_parser().parse_known_args(command[command.index("meshtune.cli") + 1:])
    if args.command != "train":
        return
    cfg = _train_config(args, rest, say=lambda _line: None)  # as the ranks will read it: --resume, the demo
    try:
        cfg.validate(world_size=n)
    except ConfigError as err:
        fits = [m for m in range(1, 4 * n + 1) if _runs_on(cfg, m)] if cfg.output.resume else []
        if not fits or not all("train.batch_size" in problem for problem in err.problems):
            raise  # the hint is for the checkpoint's own batch, which a resume keeps
        ranks = f"-n {fits[0]}" if len(fits) == 1 else f"-n N, N one of {fits}"
        raise ValueError(f"{' | '.join(err.problems)}; a resumed run keeps its own settings, so give {ranks} "
                         "instead") from None
    if cfg.parallel.pp > 1:  # as each rank's Pipeline.check would, once
        check_pipeline_layout(cfg, cfg.parallel.pp, n, cfg.resolved_model_path())
