"""`meshtune launch -n N` pins local ranks to cores by default (one core and one BLAS thread each) when
N fits the cores, `--no-pin` leaves every core to every rank, and more ranks than cores are not pinned."""

from __future__ import annotations

import ast
import os
import re

import pytest

from support import run_cli

from meshtune.cli.launch import pin_choice

CORES = sorted(os.sched_getaffinity(0))
SHOW = "import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('OPENBLAS_NUM_THREADS'))"


def _ranks(stdout: str) -> dict[int, tuple[list[int], str]]:
    """Each rank's printed (cores, OPENBLAS_NUM_THREADS)."""
    found = {}
    for rank, cores, threads in re.findall(r"^\[rank (\d+)\] (\[[\d, ]*\]) (\S+)$", stdout, re.M):
        found[int(rank)] = (ast.literal_eval(cores), threads)
    return found


@pytest.mark.skipif(len(CORES) < 2, reason="one core: nothing to pin two ranks to")
@pytest.mark.parametrize("flags", [[], ["--pin"]], ids=["default", "pin"])
def test_two_ranks_get_one_distinct_core_each_by_default(flags):
    proc = run_cli("launch", "-n", "2", *flags, "--", "python", "-c", SHOW, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout
    cores = [ranks[i][0] for i in (0, 1)]
    assert all(len(c) == 1 and c[0] in CORES for c in cores) and cores[0] != cores[1], cores
    assert all(ranks[i][1] == "1" for i in (0, 1))  # one BLAS thread each
    assert "note" not in proc.stderr


def test_no_pin_leaves_every_core_to_every_rank():
    proc = run_cli("launch", "-n", "2", "--no-pin", "--", "python", "-c", SHOW, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout
    assert all(ranks[i][0] == CORES for i in (0, 1)), ranks


def test_more_ranks_than_cores_are_not_pinned_and_one_note_says_so():
    n = len(CORES) + 1
    proc = run_cli("launch", "-n", str(n), "--", "python", "-c", SHOW, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _ranks(proc.stdout)
    assert sorted(ranks) == list(range(n)) and all(ranks[i][0] == CORES for i in ranks), ranks
    notes = [line for line in proc.stderr.splitlines() if "note" in line]
    assert len(notes) == 1 and f"{n} ranks on {len(CORES)} cores" in notes[0], proc.stderr


def test_pin_choice():
    assert pin_choice(2, None, remote=False, cores=2) == (True, "")
    assert pin_choice(2, False, remote=False, cores=2) == (False, "")
    pin, note = pin_choice(3, None, remote=False, cores=2)
    assert not pin and "3 ranks on 2 cores" in note
    assert pin_choice(3, True, remote=False, cores=2) == (True, "")  # an explicit --pin wins
    assert pin_choice(2, None, remote=True, cores=2) == (False, "")  # --hostfile: never from here
    assert pin_choice(2, True, remote=True, cores=2) == (False, "")
    assert pin_choice(2, None, remote=False, backend="nccl", cores=8) == (False, "")
