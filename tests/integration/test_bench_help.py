"""What `meshtune bench` says before it measures: each suite's own flags under --help, the list of
suites without one, and the model size a suite picks for this machine when --preset is left out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import mlx.core as mx
import pytest

from support import ROOT, run_cli

from meshtune.bench import SUITES

# Per suite, flags of its own parser (the generic bench help has none of them).
OWN_FLAGS = {
    "peer": ["--report-every", "--max-seq-length"],
    "adapters": ["--combine", "--base-path", "--gen-tokens"],
    "scaling": ["--in-process", "--rounds", "--local-batch"],
    "pipeline": ["--micro-batches", "--data-parallel"],
    "badinput": ["--subprocess"],
    "faults": ["--skip-badinput", "--watchdog"],
    "soak": ["--repeats"],
    "packing": ["--steps", "--max-seq-length"],
    "plan": ["--layouts", "--quantize"],
    "torch": ["--kinds", "--matmul-size"],
    "startup": ["--runs-per-cache", "--kinds"],
}


@pytest.mark.parametrize("suite", sorted(SUITES))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_each_suite_prints_its_own_flags(suite, flag):
    proc = run_cli("bench", suite, flag, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: meshtune bench {suite} ")
    for own in OWN_FLAGS[suite]:  # a new suite names its own flags here
        assert own in proc.stdout, own


def test_the_flag_table_covers_the_suites_it_names():
    assert set(OWN_FLAGS) <= set(SUITES)


def test_bench_help_lists_every_suite_with_one_line():
    proc = run_cli("bench", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert sorted(listed) == sorted(SUITES)
    assert all(len(line.split()) > 3 for line in listed.values())  # a name and a sentence
    none = run_cli("bench", timeout=120)
    assert none.returncode == 2 and none.stderr.count("\n") == 1 and "meshtune bench --help" in none.stderr


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="the CPU's choice")
def test_bench_adapters_without_a_preset_picks_a_cpu_size_and_says_so():
    """The first line names the choice; the run is stopped once it has said it (the choice is all this checks)."""
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "meshtune.cli", "bench", "adapters", "--steps", "1", "--rounds",
                             "1", "--warmup", "1", "--gen-tokens", "2"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        first = proc.stdout.readline()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert first.startswith(("preset: small (CPU", "preset: tiny (CPU")), first
    assert "RAM available" in first and "pass --preset 1b to force" in first, first
