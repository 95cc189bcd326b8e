"""`meshtune bench faults`: hurt real training runs and check they end cleanly and resume exactly.

Each case trains 2 or 3 CPU ranks, injects one fault, and checks how the run ends and that
`--resume` gives an uninterrupted run's weights; the cases about what a run saves are in
faults_save.py. HELP, the command's --help, lists the cases; docs/reliability.md says what a user sees.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from ..run_dir import CheckpointDir, RunDir, is_temp
from .faultkit import (BATCH, CLI, FAULT_AFTER, SAVE_EVERY, Bench, FaultRun, Outcome, env, max_abs_diff,
                       survivors, through_fault)
from .faults_save import CASES as SAVE_CASES
from .fit import Load, embedded_line
from .flags import BenchParser

HELP = """`meshtune bench faults`: hurt real training runs and check they end cleanly and resume exactly.

    meshtune bench faults [--iters 12] [--watchdog 5] [--case NAME] [--skip-badinput] [--json]

Every case trains the embedded tiny model on the arithmetic data with 2 ranks on the
CPU (`meshtune launch`, ring backend; SGD, global batch 6, a checkpoint every 4
steps), injects one fault after step 6, and reports the time from the fault until
every process has exited, the line that explains it, and whether `--resume` on 2
ranks then ends with the weights of an uninterrupted 2-rank run (max abs diff; 0 is
exact, a 3-rank run resumed on 2 is held to 1e-5 + 1e-4|w| because ranks sum
gradients in another order). Cases:

    kill9_rank1        kill -9 rank 1
    sigstop_rank1      SIGSTOP rank 1 (alive, silent)
    kill_during_save   kill -9 rank 0 (the writer) while a checkpoint's temp folder exists
    corrupt_latest     a byte of the newest checkpoint of a finished run flipped, then --resume
    link_cut           the link of rank 1 taken down in the namespace bed (bench/netbed.py; root)
    kill9_3ranks       3 ranks, kill -9 rank 2, resumed on 2 ranks
    nonfinite_step     step 7 made non-finite (the test hook MESHTUNE_TEST_NONFINITE_STEP): every
                       rank stops at step 7 with exit 65, nothing written after checkpoint 4

and what a run saves (bench/faults_save.py): overflow_step (1 rank, DP 2, PP 2), two_runs,
repeated_signals, full_disk; each is described there.

The bad-input corpus (`meshtune bench badinput`) runs too and its summary line is printed.
"""

def _said(run: FaultRun) -> str:
    """The line naming the lost rank: the launcher's, else a rank's own; else whatever the launcher said."""
    mark = "meshtune launch:"
    launcher = [l[l.index(mark):] for l in run.lines if mark in l]
    ranks = [l.split("] ", 1)[-1] for l in run.lines if "stopped answering" in l and mark not in l]
    naming = [l for l in launcher if "stopped answering" in l] or ranks or launcher
    return naming[0] if naming else "(none)"


def _aftermath(b: Bench, out: Path, run: FaultRun, **resume: int) -> tuple[int, str, float | None, str, list[str]]:
    """(processes left running, the line naming the lost rank, resume's max weight diff, verdict, warnings)."""
    left, message = len(survivors(str(out))), _said(run)
    diff, verdict, warnings = b.resume(out, n=2, **resume)
    return left, message, diff, verdict, warnings


def _signal_case(b: Bench, name: str, n: int, victim: int, sig: int, expect_code: int) -> Outcome:
    out = b.root / name
    run = FaultRun.launch(n, b.args(out))
    code, seconds = through_fault(b, run, lambda: run.hurt(victim, sig))
    left, message, diff, verdict, _ = _aftermath(b, out, run)
    ok = (code == expect_code and f"rank {victim} stopped answering" in message and left == 0
          and seconds < b.watchdog_s + 5 and verdict != "NO")
    return Outcome(name, n, code, seconds, message, left, 2, diff, verdict, ok)


def kill9_rank1(b: Bench) -> Outcome:
    return _signal_case(b, "kill9_rank1", 2, 1, signal.SIGKILL, 128 + 9)


def sigstop_rank1(b: Bench) -> Outcome:
    return _signal_case(b, "sigstop_rank1", 2, 1, signal.SIGSTOP, 75)


def kill9_3ranks(b: Bench) -> Outcome:
    return _signal_case(b, "kill9_3ranks", 3, 2, signal.SIGKILL, 128 + 9)


def kill_during_save(b: Bench) -> Outcome:
    """Checkpoint every step; poll for a save's temp folder and kill the writer inside it."""
    out = b.root / "kill_during_save"
    run = FaultRun.launch(2, b.args(out, save_every=1))

    def kill_inside_a_save() -> None:
        folder, deadline = RunDir(out).checkpoints, time.monotonic() + 30
        while time.monotonic() < deadline and run.proc.poll() is None:
            if any(is_temp(p) for p in folder.iterdir()):  # a save is under way
                break
            time.sleep(0.0005)
        run.hurt(0, signal.SIGKILL)  # without a save window seen, still a kill (the note says which)

    code, seconds = through_fault(b, run, kill_inside_a_save, after=FAULT_AFTER - 2)
    temp_left = [p.name for p in RunDir(out).checkpoints.iterdir() if is_temp(p)]
    left, message, diff, verdict, warnings = _aftermath(b, out, run, save_every=1)
    skipped = any("temp folder of an interrupted save" in w for w in warnings)
    note = (f"killed mid-save: temp folder {temp_left[0]} left, resume skipped it" if temp_left and skipped
            else "the kill landed between saves (no temp folder left)")
    ok = code == 128 + 9 and left == 0 and verdict != "NO" and (not temp_left or skipped)
    return Outcome("kill_during_save", 2, code, seconds, message, left, 2, diff, verdict, ok, note)


def corrupt_latest(b: Bench) -> Outcome:
    """A finished run whose newest checkpoint lost a byte: resume skips it and redoes the steps."""
    out = b.root / "corrupt_latest"
    shutil.copytree(b.reference().parent, out)
    latest = max(RunDir(out).checkpoints.iterdir(), key=lambda p: int(p.name))
    weights = CheckpointDir(latest).adapters
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    diff, verdict, warnings = b.resume(out, n=2)
    message = warnings[0] if warnings else "(no warning)"
    ok = "does not match its sha256" in message and verdict != "NO"
    return Outcome("corrupt_latest", 2, None, None, message, 0, 2, diff, verdict, ok,
                   f"checkpoint {latest.name} skipped; resumed from the one before")


def link_cut(b: Bench) -> Outcome:
    """Both ranks in network namespaces; rank 1's veth goes down; the watchdogs end the run."""
    from . import netbed

    reason = netbed.available() or _netns_refused()
    if reason:
        return Outcome("link_cut", 2, None, None, f"skipped: {reason}", 0, 0, None, "not run", True)
    out = b.root / "link_cut"
    code = (f"import sys; from meshtune.parallel.launcher import launch_ranks; "
            f"sys.exit(launch_ranks(2, {[*CLI, *b.args(out)]!r}, hosts=['10.77.0.1', '10.77.0.2'], "
            f"wrap=lambda r: ['ip', 'netns', 'exec', f'mtbed{{r}}']))")
    with netbed.shaped_link(2, rate="10gbit") as bed:
        run = FaultRun([sys.executable, "-c", code])
        rc, seconds = through_fault(b, run, lambda: subprocess.run(
            ["ip", "-n", netbed.BRIDGE_NS, "link", "set", "mtp1", "down"], check=True))
    left, message, diff, verdict, _ = _aftermath(b, out, run)
    ok = rc == 75 and "stopped answering" in message and left == 0 and seconds < b.watchdog_s + 5 and verdict != "NO"
    return Outcome("link_cut", 2, rc, seconds, message, left, 2, diff, verdict, ok,
                   f"{bed.shaping}; no rank is dead or stopped: each rank's watchdog names the other")


def nonfinite_step(b: Bench) -> Outcome:
    """Step 7 goes non-finite: each rank says so at step 7 and exits 65; checkpoint 4 and the adapters
    are left as the uninterrupted run had them at step 4; --resume then finishes exactly."""
    from ..training import NONFINITE_EXIT_CODE

    out, bad = b.root / "nonfinite_step", FAULT_AFTER + 1
    run = FaultRun([*CLI, "launch", "-n", "2", "--", *CLI, *b.args(out)],
                   environ=env() | {"MESHTUNE_TEST_NONFINITE_STEP": str(bad)})
    code, seconds = through_fault(b, run, lambda: None)  # the clock starts at step 6's report
    said = [l for l in run.lines if f"meshtune: step {bad}: " in l]
    ranks_said = sorted(l.split("]")[0] for l in said)
    saved = sorted(p.name for p in RunDir(out).checkpoints.iterdir())
    last = RunDir(b.reference().parent).checkpoint(SAVE_EVERY).path
    kept = (saved == [last.name] and max_abs_diff(RunDir(out).adapters, CheckpointDir(last).adapters) == 0
            and all((RunDir(out).checkpoints / last.name / f.name).read_bytes() == f.read_bytes()
                    for f in last.glob("*.safetensors")))
    left, message, diff, verdict, _ = _aftermath(b, out, run)
    ok = (code == NONFINITE_EXIT_CODE and ranks_said == ["[rank 0", "[rank 1"] and kept and left == 0
          and verdict == "exact")
    note = (f"both ranks at step {bad}; nothing written after checkpoint {last.name}" if kept
            else f"written after the bad step: checkpoints {saved}")
    return Outcome("nonfinite_step", 2, code, seconds, said[0].split("] ", 1)[-1] if said else "(none)", left, 2,
                   diff, verdict, ok, note)


def _netns_refused() -> str | None:
    probe = subprocess.run(["ip", "netns", "add", "mtbed-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "mtbed-probe"], capture_output=True)
    return "network namespaces are not permitted here" if probe.returncode else None


CASES: dict[str, Callable[[Bench], Outcome]] = {
    f.__name__: f for f in (kill9_rank1, sigstop_rank1, kill_during_save, corrupt_latest, link_cut, kill9_3ranks,
                            nonfinite_step, *SAVE_CASES)}


def table(outcomes: list[Outcome]) -> str:
    rows = [f"{'case':<17} | ranks | exit | s to exit | left | resumed on | max abs diff | weights    | ok",
            f"{'-' * 17}-|-------|------|-----------|------|------------|--------------|------------|----"]
    for o in outcomes:
        secs = f"{o.seconds_to_exit:9.1f}" if o.seconds_to_exit is not None else f"{'-':>9}"
        diff = f"{o.max_abs_diff:12.3g}" if o.max_abs_diff is not None else f"{'-':>12}"
        rows.append(f"{o.case:<17} | {o.ranks:>5} | {str(o.exit_code or '-'):>4} | {secs} | {o.left_running:>4} | "
                    f"{o.resumed_on or '-':>10} | {diff} | {o.reproduced:<10} | {'yes' if o.ok else 'NO'}")
    rows.append("messages:")
    rows += [f"  {o.case}: {o.message}" + (f"  [{o.note}]" if o.note else "") for o in outcomes]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = BenchParser(prog="meshtune bench faults", description=HELP)
    p.add_argument("--iters", type=int, default=12, help="Steps of every run (faults come after step 6).")
    p.add_argument("--watchdog", type=float, default=5.0, help="runtime.watchdog_s of the runs.")
    p.add_argument("--case", action="append", choices=list(CASES), help="Run only this case (repeatable).")
    p.add_argument("--skip-badinput", action="store_true", help="Leave out the bad-input corpus.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    a = p.parse_args(argv)
    if a.iters <= FAULT_AFTER + 2:
        raise ValueError(f"--iters {a.iters}: faults come after step {FAULT_AFTER}; use at least {FAULT_AFTER + 3}")
    tic = time.monotonic()
    print(f"fault bench: embedded tiny model, arithmetic data, global batch {BATCH}, {a.iters} SGD steps, "
          f"checkpoint every {SAVE_EVERY}, runtime.watchdog_s {a.watchdog:g}, fault after step {FAULT_AFTER}; "
          "weights compared with an uninterrupted 2-rank run", flush=True)
    print(embedded_line(BATCH, 32, Load(processes=3)), flush=True)  # kill9_3ranks: three at once
    with tempfile.TemporaryDirectory(prefix="meshtune-faults-") as tmp:
        bench = Bench(Path(tmp), a.iters, a.watchdog)
        outcomes = []
        for name in a.case or list(CASES):
            outcomes.append(CASES[name](bench))
            print(f"  {name}: {'ok' if outcomes[-1].ok else 'FAILED'}", flush=True)
    print(table(outcomes))
    bad = None
    if not a.skip_badinput:
        from .bad_input import run_all

        results = run_all()
        bad = {"cases_tried": len(results), "clean_errors": sum(r.clean for r in results)}
        print(f"bad inputs: cases tried {bad['cases_tried']}, clean errors {bad['clean_errors']}")
    ok = all(o.ok for o in outcomes) and (bad is None or bad["cases_tried"] == bad["clean_errors"])
    print(f"faults bench {'passed' if ok else 'FAILED'} in {time.monotonic() - tic:.0f}s")
    if a.json:
        print(json.dumps({"cases": [asdict(o) for o in outcomes], "badinput": bad, "ok": ok}))
    return 0 if ok else 1
