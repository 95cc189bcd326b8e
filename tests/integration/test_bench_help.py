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
    "scaling": ["--in-process", "--rounds", "--local-batch", "--links", "--kinds"],
    "pipeline": ["--micro-batches", "--data-parallel"],
    "badinput": ["--subprocess"],
    "faults": ["--skip-badinput", "--watchdog"],
    "soak": ["--repeats"],
    "packing": ["--steps", "--max-seq-length"],
    "plan": ["--layouts", "--quantize"],
    "torch": ["--kinds", "--matmul-size"],
    "startup": ["--runs-per-cache", "--kinds"],
    "long-rows": ["--seq-lens", "--spread", "--train-args", "--step"],
    "serve": ["--bases", "--requests", "--tokens"],
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


# A flag no run can take is one line naming it (exit 2), before anything runs: these were a division
# by zero, a floating point exception or a child's traceback minutes in, or argparse's usage block.
NONSENSE = [
    ("adapters", ["--rank", "0"], "--rank 0: must be at least 1"),
    ("adapters", ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    ("adapters", ["--warmup", "-1"], "--warmup -1: must be at least 0"),
    ("peer", ["--iters", "0"], "--iters 0: must be at least 1"),
    ("peer", ["--repeats", "0"], "--repeats 0: must be at least 1"),
    ("packing", ["--steps", "0"], "--steps 0: must be at least 1"),
    ("pipeline", ["--iters", "0"], "--iters 0: must be at least 1"),
    ("pipeline", ["--fine-tune-type", "bogus"], "--fine-tune-type: invalid choice: 'bogus'"),
    ("pipeline", ["--micro-batches", "3"], "--micro-batches 3 does not divide each pipeline's batch of 16 "
                                           "(--batch-size 16 / --data-parallel 1); give counts from 1,2,4,8,16"),
    ("scaling", ["--ranks", "1"], "--ranks 1: must be at least 2"),
    ("scaling", ["--local-batch", "0"], "--local-batch 0: must be at least 1"),
    ("scaling", ["--bucket-mb", "-1"], "--bucket-mb -1: must be above 0"),
    ("scaling", ["--link", "bogus"], "--link 'bogus': rate 'bogus': give it as tc does"),
    ("scaling", ["--link", "infbit"], "--link 'infbit': rate 'infbit': give it as tc does"),
    ("scaling", ["--links", "0,2"], "--links '0,2': give link counts like 1,2"),
    ("scaling", ["--links", "1,2"], "--links needs the shaped-link bed: give --link RATE"),
    ("scaling", ["--kinds", "dora"], "--kinds 'dora': give lora, full or lora,full"),
    ("startup", ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    ("torch", ["--steps", "0"], "--steps 0: must be at least 1"),
    ("long-rows", ["--seq-lens", "10"], "--seq-lens 10: must be at least 64"),
    ("long-rows", ["--steps", "0"], "--steps 0: must be at least 1"),
]


@pytest.mark.parametrize("suite, args, said", NONSENSE, ids=[f"{s}{''.join(a)}" for s, a, _ in NONSENSE])
def test_a_number_no_run_can_take_is_one_error_naming_the_flag(suite, args, said):
    proc = run_cli("bench", suite, *args, timeout=60)
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-1000:]
    assert proc.stderr.startswith("meshtune: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert said in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
