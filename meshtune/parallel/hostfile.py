"""mlx.launch's hostfile, as `meshtune launch --hostfile` and `meshtune plan --hostfile` read it.

Plain Python (no MLX): the launcher reads it before any rank starts, the planner
to count ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_hostfile(path: Path) -> list[dict[str, Any]]:
    """mlx.launch's hostfile: a JSON list with one {"ssh": host, "ips": [ip, ...]} per rank."""
    try:
        hosts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--hostfile {path}: cannot read it as JSON ({' '.join(str(err).split())}); give a "
                         'list like [{"ssh": "mac1", "ips": ["10.0.0.1"]}, ...], one entry per rank') from None
    ok = isinstance(hosts, list) and hosts and all(
        isinstance(h, dict) and isinstance(h.get("ssh"), str) and h["ssh"] and isinstance(h.get("ips"), list)
        and h["ips"] and all(isinstance(ip, str) for ip in h["ips"]) for h in hosts)
    if not ok:
        raise ValueError(f'--hostfile {path}: every entry needs "ssh" (a host name) and "ips" (a non-empty list '
                         'of addresses), e.g. [{"ssh": "mac1", "ips": ["10.0.0.1"]}]')
    return hosts
