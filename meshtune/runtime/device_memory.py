"""The device MLX runs on and the memory a rank may use there: what a run's plan must fit, and a bench's preset."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Machine:
    """The device MLX runs on and the memory it may use, in bytes."""

    kind: str  # "CPU" or "GPU"
    name: str
    memory: int  # CPU: RAM available now; GPU: free memory (CUDA) or the recommended working set (Metal)

    def describe(self) -> str:
        return f"{self.kind}{' ' + self.name if self.name else ''}, {self.memory / GB:.1f} GB " + \
            ("RAM available" if self.kind == "CPU" else "memory")


def detect() -> Machine:
    """MLX's default device and the memory it may use."""
    import mlx.core as mx

    info = device_info(mx)
    if mx.default_device().type == mx.DeviceType.gpu:
        memory = next((int(info[k]) for k in ("free_memory", "max_recommended_working_set_size", "total_memory",
                                              "memory_size") if info.get(k)), 0)
        return Machine("GPU", str(info.get("device_name", "")), memory or available_ram())
    return Machine("CPU", str(info.get("device_name", "")), available_ram())


def device_info(mx: Any) -> dict[str, Any]:
    """MLX's report of the default device (mx.device_info, else mx.metal's), {} where it has none."""
    for get in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        try:
            return dict(get()) if get else {}
        except (RuntimeError, AttributeError):
            continue
    return {}


def available_ram() -> int:
    """RAM a new allocation can get now: MemAvailable on Linux, the installed RAM on macOS."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True,
                                      timeout=10).stdout)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0
