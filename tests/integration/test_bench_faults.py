"""`meshtune bench faults` and `meshtune bench soak`: short versions of both, and the soak's memory check."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from meshtune.bench.faultkit import CLI, env
from meshtune.bench.soak import memory_growth


def _records(peaks: list[float], actives: list[float]) -> list[dict]:
    return [{"type": "train", "step": 10 * (i + 1), "peak_memory_gb": p, "active_memory_gb": a}
            for i, (p, a) in enumerate(zip(peaks, actives))]


def test_memory_growth_sees_a_leak_and_passes_a_flat_run():
    flat = memory_growth(_records([1.0] * 20, [0.5, 0.6] * 10), steps=200)
    assert flat["peak_growth"] == 0 and flat["active_growth"] == 0
    leak = memory_growth(_records([1.0 + 0.01 * i for i in range(20)], [0.5 + 0.01 * i for i in range(20)]), steps=200)
    assert leak["peak_growth"] > 0.05 and leak["active_growth"] > 0.05
    with pytest.raises(ValueError, match="too few reports"):
        memory_growth(_records([1.0] * 2, [1.0] * 2), steps=20)


@pytest.mark.serial  # times the exit after the kill
def test_bench_faults_kill_and_corrupt_cases_end_clean_and_resume_exactly():
    proc = subprocess.run([*CLI, "bench", "faults", "--case", "kill9_rank1", "--case", "corrupt_latest",
                           "--skip-badinput", "--json"], env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "case              | ranks | exit | s to exit" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kill, corrupt = result["cases"]
    assert kill["exit_code"] == 137 and kill["left_running"] == 0 and kill["seconds_to_exit"] < 5
    # The kill comes once rank 0 has reported step 6; rank 1 may have finished step 7 by then.
    said = re.search(r"meshtune launch: rank 1 stopped answering at step (\d+) \(killed by signal 9 \(SIGKILL\)\)",
                     kill["message"])
    assert said and 6 <= int(said.group(1)) < 12, kill["message"]
    assert kill["max_abs_diff"] == 0 and kill["reproduced"] == "exact"
    assert "does not match its sha256" in corrupt["message"] and corrupt["max_abs_diff"] == 0
    assert result["ok"] is True and result["badinput"] is None


def test_soak_short_version_passes():
    proc = subprocess.run([*CLI, "bench", "soak", "--steps", "80", "--repeats", "2", "--json"], env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "soak PASS" in proc.stdout and "2 ok, 0 hangs, 0 failures" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["pass"] and result["memory"]["peak_growth"] < 0.05
