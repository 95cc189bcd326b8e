"""`meshtune bench faults`' cases about what a run saves: never a non-finite value, never two runs in one
folder, never a cut record on a full disk, and one save however many signals come.

Each case is a function of the same name, whose docstring says what it does and checks; CASES is the
list `meshtune bench faults` runs after its own (faults.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..run_dir import CheckpointDir, RunDir
from ..training.checkpoint import verify_checkpoint
from .faultkit import (CLI, FAULT_AFTER, SAVE_EVERY, Bench, FaultRun, Outcome, env, max_abs_diff,
                       survivors, through_fault)

LONG = ("--iters", "100000")  # a run that is still training when the case acts on it


def overflow_step(b: Bench) -> Outcome:
    """Step 7 at an infinite learning rate (MESHTUNE_TEST_OVERFLOW_STEP): a finite gradient whose update is
    not. On 1 rank, DP 2 and PP 2 the update is not applied, every rank says it and stops at step 7 with
    exit 65, and nothing is saved after checkpoint 4 (the same bytes as the uninterrupted run's on 2 ranks)."""
    from ..training import NONFINITE_EXIT_CODE

    bad, notes, ok = FAULT_AFTER + 1, [], True
    last = RunDir(b.reference().parent).checkpoint(SAVE_EVERY).path
    message, codes = "(none)", []
    for ranks, layout in ((1, ()), (2, ()), (2, ("--parallel.pp", "2"))):
        name = f"{ranks} rank{'s' * (ranks > 1)}{' pp' if layout else ''}"
        out = b.root / f"overflow_{ranks}{'_pp' if layout else ''}"
        args = b.args(out, *layout)
        argv = [*CLI, "launch", "-n", str(ranks), "--", *CLI, *args] if ranks > 1 else [*CLI, *args]
        run = FaultRun(argv, environ=env() | {"MESHTUNE_TEST_OVERFLOW_STEP": str(bad)})
        code, _ = through_fault(b, run, lambda: None)
        codes.append(code)
        said = [l for l in run.lines if f"meshtune: step {bad}: the update would make non-finite" in l]
        message = said[0].split("] ", 1)[-1] if said else message
        saved = sorted(p.name for p in RunDir(out).checkpoints.iterdir())
        if layout or ranks == 1:  # summed in another order than 2 data-parallel ranks: step 4's adapters, close
            same = max_abs_diff(RunDir(out).adapters, CheckpointDir(last).adapters) < 1e-5
        else:
            same = all((RunDir(out).checkpoints / last.name / f.name).read_bytes() == f.read_bytes()
                       for f in last.glob("*.safetensors"))
        good = code == NONFINITE_EXIT_CODE and len(said) == ranks and saved == [last.name] and same
        ok &= good and len(survivors(str(out))) == 0
        notes.append(f"{name}: {'ok' if good else f'exit {code}, {len(said)} lines, checkpoints {saved}'}")
    diff = max_abs_diff(RunDir(b.root / "overflow_2").adapters, CheckpointDir(last).adapters)  # the step-4 adapters stand
    return Outcome("overflow_step", 2, codes[-1], None, message, 0, 0, diff, "not resumed", ok and diff == 0,
                   "; ".join(notes))


def two_runs(b: Bench) -> Outcome:
    """A second 2-rank run on a folder a 2-rank run holds: exit 2 at once, one line naming the holder's pid
    and host; the holder trains on, then stops on SIGTERM (exit 3), every checkpoint in the folder its own
    and verifying."""
    out = b.root / "two_runs"
    holder = FaultRun.launch(2, b.args(out, *LONG))
    try:
        holder.wait_for(r"step 2: train loss")
        tic = time.monotonic()
        second = subprocess.run([*CLI, "launch", "-n", "2", "--", *CLI, *b.args(out, *LONG)], env=env(),
                                capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - tic
        said = [l.split("] ", 1)[-1] for l in (second.stdout + second.stderr).splitlines() if "in use by another run" in l]
        holder_trains = holder.proc.poll() is None
        holder.proc.send_signal(signal.SIGTERM)
        code, _ = holder.finish(timeout=120)
    finally:
        if holder.proc.poll() is None:
            holder.kill()
    saved = list(RunDir(out).checkpoints.iterdir())
    intact = bool(saved) and all(verify_checkpoint(p) is None for p in saved)
    ok = (second.returncode == 2 and said and re.search(r"\(pid \d+ on \S+", said[0]) is not None
          and holder_trains and code == 3 and intact and len(survivors(str(out))) == 0)
    return Outcome("two_runs", 2, second.returncode, seconds, said[0] if said else "(none)", 0, 0, None,
                   "not resumed", bool(ok), f"the holder trained on and stopped with exit {code}; "
                   f"{len(saved)} checkpoints, all verifying: {intact}")


def repeated_signals(b: Bench) -> Outcome:
    """SIGTERM to the launcher three times and SIGINT to every rank (Ctrl-C to the process group), all within
    0.1 s: one save, one stop line, the resume line, exit 3."""
    out = b.root / "repeated_signals"
    run = FaultRun.launch(2, b.args(out, *LONG))

    def many() -> None:
        for _ in range(3):
            run.proc.send_signal(signal.SIGTERM)
            for pid in run.pids.values():  # as Ctrl-C in the launcher's terminal reaches every rank too
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            time.sleep(0.03)

    code, seconds = through_fault(b, run, many)
    text = run.output()
    stops = [l for l in run.lines if "stopped at step" in l]
    step = re.search(r"stopped at step (\d+)", stops[0]) if stops else None
    saved = sorted(int(p.name) for p in RunDir(out).checkpoints.iterdir())
    ok = (code == 3 and len(stops) == 1 and step is not None and saved[-1] == int(step.group(1))
          and "Traceback" not in text and f"to continue from step {saved[-1]}" in text
          and all(verify_checkpoint(RunDir(out).checkpoint(s).path) is None for s in saved)
          and RunDir(out).report.exists() and len(survivors(str(out))) == 0)
    return Outcome("repeated_signals", 2, code, seconds, stops[0].split("] ", 1)[-1] if stops else "(none)", 0, 0,
                   None, "not resumed", ok, "3 SIGTERMs to the launcher and 3 SIGINTs to each rank: one save")


def full_disk(b: Bench) -> Outcome:
    """A 4 MB tmpfs filled by the saves (a checkpoint every step), then one filled between saves: exit 2 with
    one line naming the room a save needs and the last good checkpoint, every metrics record whole, that
    checkpoint verifying (root; skipped where a tmpfs cannot be mounted)."""
    mount = b.root / "small_disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4000k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        return Outcome("full_disk", 1, None, None, f"skipped: cannot mount a tmpfs ({made.stderr.decode().strip()})",
                       0, 0, None, "not run", True)
    try:
        during = _full_disk_run(b, mount / "during", fill=False)
        shutil.rmtree(mount / "during")  # the room for the next run's start
        between = _full_disk_run(b, mount / "between", fill=True)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    ok = during[0] and between[0]
    return Outcome("full_disk", 1, 2, None, between[1], 0, 0, None, "not resumed", ok,
                   f"during a save: {'ok' if during[0] else during[1]}; between saves: {'ok' if between[0] else 'NO'}")


def _full_disk_run(b: Bench, out: Path, fill: bool) -> tuple[bool, str]:
    """(clean, its error line) of one run on the small disk; `fill` fills the disk after step 3."""
    run = FaultRun([*CLI, *b.args(out, *LONG, save_every=2 if fill else 1)])
    filler = out.parent / f"filler-{out.name}"
    try:
        if fill:
            run.wait_for(r"step 3: train loss")
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)
        code, _ = run.finish(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.kill()
        filler.unlink(missing_ok=True)
    errors = [l for l in run.lines if l.startswith("meshtune: error:")]
    line = errors[0] if errors else "(none)"
    try:
        whole = all(isinstance(json.loads(l), dict) for l in RunDir(out).metrics.read_text().splitlines())
    except ValueError:
        whole = False
    named = re.search(r"last good checkpoint: (\S+) \(resume", line)
    good = named is not None and verify_checkpoint(Path(named.group(1))) is None
    ok = (code == 2 and len(errors) == 1 and "No space left on device" in line and "a save needs about" in line
          and whole and good and "Traceback" not in run.output())
    return ok, line


CASES = (overflow_step, two_runs, repeated_signals, full_disk)
