"""Run a probe as 2 pinned ranks on the shaped-link bed (root, Linux):

    python scripts/probes/run_shaped.py scripts/probes/spin_probe.py      # ring all_sum: CPU time vs wall time
    python scripts/probes/run_shaped.py scripts/probes/overlap_probe.py   # compute alone, all_sum alone, both
    python scripts/probes/run_shaped.py scripts/probes/sock_probe.py      # the same with a plain blocking socket
"""
import os
import sys

from meshtune.bench.netbed import shaped_link
from meshtune.launch import launch_local

with shaped_link(2, rate=os.environ.get("RATE", "1gbit"), delay="20us", burst=os.environ.get("BURST", "")) as bed:
    sys.exit(launch_local(2, [sys.executable, sys.argv[1]], pin=True, hosts=bed.ips, wrap=bed.wrap))
