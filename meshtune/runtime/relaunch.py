"""How this run's processes were started, as the command that starts them again on --resume.

meshtune launch tells its ranks its own command line (LAUNCH_ENV); ranks of another
launcher are recognised by MLX's variables. The writer records the command in the run's
metrics.jsonl at start, so report.md and `python -m meshtune.report` can name it
for a run that was killed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

# Set by meshtune launch for its ranks: how to start them again ("meshtune launch --hostfile /abs/hosts.json").
LAUNCH_ENV = "MESHTUNE_LAUNCH_COMMAND"


def resume_command(adapter_path: Any, mesh: Any, environ: Any = os.environ) -> str:
    """The command that continues a stopped run on the ranks it ran on.

    One process: `meshtune train --adapter-path X --resume`. Ranks started by meshtune launch:
    the same behind the launch it gave them (LAUNCH_ENV). Ranks of another launcher (MLX_RANK
    set): behind `meshtune launch --hostfile FILE --` when MLX_HOSTFILE is an mlx.launch hostfile
    (one {"ssh", "ips"} entry per rank), else `meshtune launch -n <world size> --`.
    """
    train = resume_on_ranks(adapter_path, 1)
    size = getattr(mesh, "world_size", 1) or 1
    if "MLX_RANK" not in environ or size < 2:
        return train
    if environ.get(LAUNCH_ENV):
        return f"{environ[LAUNCH_ENV]} -- {train}"
    hostfile = environ.get("MLX_HOSTFILE")
    if hostfile and _is_launch_hostfile(hostfile):
        return f"meshtune launch --hostfile {shlex.quote(hostfile)} -- {train}"
    return resume_on_ranks(adapter_path, size)


def resume_on_ranks(adapter_path: Any, ranks: int) -> str:
    """`meshtune train --adapter-path X --resume`, behind `meshtune launch -n <ranks> --` for more than one."""
    train = f"meshtune train --adapter-path {shlex.quote(str(adapter_path))} --resume"
    return train if ranks < 2 else f"meshtune launch -n {ranks} -- {train}"


def _is_launch_hostfile(path: str) -> bool:
    """Whether `path` is an mlx.launch hostfile ([{"ssh": host, "ips": [...]}, ...]) that can be read here."""
    from .hostfile import read_hostfile

    try:
        read_hostfile(Path(path))
    except ValueError:
        return False
    return True
