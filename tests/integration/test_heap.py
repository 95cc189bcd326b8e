"""meshtune.runtime.heap: with freed memory kept, a step's large MLX arrays reuse the pages of the step before."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

# One large MLX array freed, then another of the same size: the minor page faults the second costs.
_PROBE = textwrap.dedent("""
    import resource, sys
    import mlx.core as mx
    from meshtune.runtime.heap import keep_freed_memory
    if sys.argv[1] == "keep":
        print("applied", keep_freed_memory(), keep_freed_memory())
    def faults():
        n = 16 * 2**20  # 64 MB of float32: past glibc's largest mmap threshold (32 MB)
        a = mx.full((n,), 1.0)
        mx.eval(a)
        del a
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b = mx.full((n,), 2.0)
        mx.eval(b)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults()
    print("faults", faults())
""")


def _run(mode: str) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_kept_memory_spares_a_large_arrays_page_faults():
    default = int(_run("default")["faults"][0])
    kept = _run("keep")
    assert kept["applied"] == ["True", "True"]  # applied, and applied again: the same setting
    # Without it every 64 MB array is a fresh mapping (16384 pages of 4 KiB, fewer where huge
    # pages back it); with it the freed block is reused as it is.
    assert default >= 16
    assert int(kept["faults"][0]) <= default // 8


def test_keep_freed_memory_is_a_runtime_option_on_by_default():
    from meshtune.config import Config, ConfigError, field_help, load_config

    assert Config().runtime.keep_freed_memory is True
    # An option: set from a config file's runtime section and from the command line, with help text, type-checked.
    assert Config.from_dict({"runtime": {"keep_freed_memory": False}}).runtime.keep_freed_memory is False
    assert load_config(None, [("runtime.keep_freed_memory", "false")]).runtime.keep_freed_memory is False
    assert "malloc" in field_help("runtime", "keep_freed_memory")
    with pytest.raises(ConfigError, match="runtime.keep_freed_memory"):
        Config.from_dict({"runtime": {"keep_freed_memory": 0}})
