"""Where the host's threads run, and pinning them, for probe_dora_step.py --pin (Linux only).

Development probe (adapters issue): on an H200 the 1B step is the host's (the GPU waits), and the
same code's host time moved by ~20% from one process to the next (docs/bench/adapters_h200_24.txt,
block 5). Two readings this tests: the main thread (which builds and dispatches the step) sharing
its core's second hardware thread with another thread of the process, or running far from the GPU
(another NUMA node).

    node: every thread on the CPUs of the GPU's NUMA node (of those the process may use)
    main: the main thread alone on one core of that node (its sibling hardware threads left idle),
          every other thread on the rest
    none: as started

`threads()` lists each thread's name, CPU time and where it may run, to see which of them spin.
"""
from __future__ import annotations

import os
import subprocess
import threading

_ALLOWED = os.sched_getaffinity(0)  # the CPUs the process was started with, before any pinning here


def _cpulist(text: str) -> set[int]:
    cpus = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def gpu_node_cpus() -> set[int]:
    """CPUs of the first GPU's NUMA node that this process may use (all it may use where unknown)."""
    allowed = _ALLOWED
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return allowed
    bus = bus.lower()
    bus = bus[4:] if bus.count(":") == 2 and len(bus.split(":")[0]) == 8 else bus  # 00000000:19:00.0 -> 0000:19:00.0
    local = _cpulist(_read(f"/sys/bus/pci/devices/{bus}/local_cpulist"))
    return (local & allowed) or allowed


def siblings(cpu: int) -> set[int]:
    return _cpulist(_read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")) or {cpu}


def describe() -> str:
    """The machine as the pinning sees it: CPUs allowed, the GPU's node, NUMA nodes, hardware-thread pairs."""
    allowed = sorted(_ALLOWED)
    nodes = sorted(p for p in os.listdir("/sys/devices/system/node") if p.startswith("node")) \
        if os.path.isdir("/sys/devices/system/node") else []
    lines = [f"allowed cpus {allowed}", f"gpu node cpus {sorted(gpu_node_cpus())}"]
    lines += [f"{n}: cpus {_read(f'/sys/devices/system/node/{n}/cpulist').strip()}" for n in nodes]
    pairs = sorted({tuple(sorted(siblings(c))) for c in allowed})
    lines.append(f"hardware-thread groups {pairs}")
    gov = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").strip()
    lines.append(f"cpu0 governor {gov or '?'}; model {_model()}")
    return "\n".join(lines)


def _model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def _tids() -> list[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def pin(mode: str) -> str:
    """Pin this process's threads (see the module doc); returns what was done, in words."""
    if mode == "none":
        return "threads as started"
    local = sorted(gpu_node_cpus())
    main = threading.get_native_id()
    if mode == "node":
        for tid in _tids():
            os.sched_setaffinity(tid, local)
        return f"every thread on cpus {local}"
    if mode != "main":
        raise ValueError(f"--pin {mode}: give none, node or main")
    core = local[-1]
    rest = [c for c in local if c not in siblings(core)] or local
    for tid in _tids():
        os.sched_setaffinity(tid, {core} if tid == main else rest)
    return f"main thread on cpu {core} (siblings {sorted(siblings(core))} left idle), others on {rest}"


def threads() -> str:
    """Each thread: id, name, CPU seconds (user + system), the CPU it last ran on, where it may run."""
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for tid in _tids():
        stat = _read(f"/proc/self/task/{tid}/stat")
        name = _read(f"/proc/self/task/{tid}/comm").strip()
        fields = stat.rsplit(")", 1)[-1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / tick if len(fields) > 36 else float("nan")
        last = fields[36] if len(fields) > 36 else "?"
        try:
            may = sorted(os.sched_getaffinity(tid))
        except OSError:
            may = []
        may_text = f"{may[0]}-{may[-1]}" if may and may == list(range(may[0], may[-1] + 1)) else str(may)
        rows.append(f"  tid {tid:>8} {name:<16} cpu {cpu_s:8.2f} s  last cpu {last:>3}  may run on {may_text}")
    return "\n".join(rows)
