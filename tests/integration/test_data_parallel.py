"""Data parallelism as real processes on the ring backend: N ranks x B/N == 1 rank x B.

Every multi-rank run goes through `meshtune launch` (ranks started directly, output
prefixed by rank, non-zero exit when any rank fails); each test checks the exit code
and that every rank reported in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from support import ROOT, fake_ssh

# SGD: the update is the gradient itself, so weights compare gradients. (Adam divides
# by sqrt(v); for the near-zero gradients of lora_a at B = 0 that turns float
# rounding of the rank-summed gradient into lr-sized differences, 9e-4 at lr 1e-3.)
STEPS = ["--iters", "4", "--train.steps_per_report", "2", "--steps-per-eval", "2", "--save-every", "2",
         "--train.val_batches", "2", "--optimizer", "sgd", "--learning-rate", "0.01"]


def _run(n: int, out: Path, *args: str, timeout: int = 300, links: int = 1) -> subprocess.CompletedProcess:
    """n ranks through `meshtune launch`; with `links` > 1 through a hostfile listing that many loopback
    addresses per host (support.fake_ssh stands in for ssh)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    train = ["train", *STEPS, *args, "--adapter-path", str(out)]
    ranks = ["-n", str(n)]
    if links > 1:
        out.parent.mkdir(parents=True, exist_ok=True)
        hosts = out.parent / "hosts.json"
        hosts.write_text(json.dumps([{"ssh": f"node{i}", "ips": [f"127.0.0.{j + 1}" for j in range(links)]}
                                     for i in range(n)]))
        env, ranks = fake_ssh(out.parent, env), ["--hostfile", str(hosts)]
    full = [*cmd, "launch", *ranks, "--", *cmd, *train] if n > 1 else [*cmd, *train]
    proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if n > 1:
        for rank in range(n):
            assert f"[rank {rank}] rank {rank} of {n}: data-parallel rank {rank} of {n}" in proc.stdout
            assert f"[rank {rank}] rank {rank} finished at step 4" in proc.stdout
    return proc


# Options that only change how ranks exchange gradients: one process has nothing to exchange, so the
# one-process runs of configurations that differ in these alone are one run, made once a session.
_RANKS_ONLY = {"--parallel.grad_sync", "--parallel.bucket_mb", "--parallel.transport"}
_ONE_PROCESS: dict[tuple, Path] = {}


def _one_process(tmp_path_factory, args: list[str]) -> Path:
    """The one-process run of `args` less the rank-only options (run the first time it is asked for)."""
    kept, rest = [], iter(args)
    for arg in rest:
        if arg in _RANKS_ONLY:
            next(rest)
        else:
            kept.append(arg)
    key = tuple(kept)
    if key not in _ONE_PROCESS:
        out = tmp_path_factory.mktemp("one") / "run"
        _run(1, out, *kept)
        _ONE_PROCESS[key] = out
    return _ONE_PROCESS[key]


def _losses(run: Path) -> list[tuple]:
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["type"], r["step"], r.get("loss", r.get("val_loss")), r["tokens"]) for r in recs
            if r["type"] in ("train", "val")]


def _assert_same_run(one: Path, many: Path) -> None:
    a, b = _losses(one), _losses(many)
    assert [x[:2] + x[3:] for x in a] == [x[:2] + x[3:] for x in b]  # same reports, same token counts
    # Ranks sum gradients in another order than one process does (float32 rounding,
    # ~1e-7); training then amplifies that. Tolerances: the first reports (before and
    # after the first updates) to 1e-5, later ones and the weights after 4 steps to 1e-3
    # relative. A wrong reduction (mean of per-rank means, a missing 1/N) moves the
    # step-2 loss by far more than 1e-5.
    for i, (x, y) in enumerate(zip(a, b)):
        assert y[2] == pytest.approx(x[2], rel=1e-5 if i < 2 else 1e-3), (x, y)
    wa, wb = mx.load(str(one / "adapters.safetensors")), mx.load(str(many / "adapters.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert mx.allclose(wa[k], wb[k], rtol=1e-3, atol=1e-5), k


# Three ranks (an odd ring; ~10 s a case on 2 cores) in two cases: plain, and DoRA over the socket ring with overlapped
# sync and accumulation; every other combination runs on two ranks.
@pytest.mark.parametrize("n, kind, extra", [
    (2, "lora", []),
    (2, "dora", []),
    (2, "full", ["--num-layers", "1"]),
    (2, "lora", ["--grad-accumulation-steps", "2"]),
    (2, "dora", ["--grad-accumulation-steps", "2"]),
    (2, "full", ["--num-layers", "1", "--grad-accumulation-steps", "2"]),
    (3, "lora", []),
    # Overlapped sync with tiny buckets (many all_sums, last layers first), with and without accumulation.
    (2, "lora", ["--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.01"]),
    (2, "lora", ["--parallel.grad_sync", "overlap", "--grad-accumulation-steps", "2"]),
    (2, "full", ["--num-layers", "1", "--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.05"]),
    (2, "lora", ["--parallel.grad_sync", "overlap", "--train.compile", "false"]),
    # Gradients over meshtune's socket ring (blocking TCP on its own thread), both sync modes.
    (2, "lora", ["--parallel.transport", "sockets", "--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.01"]),
    (3, "dora", ["--parallel.transport", "sockets", "--parallel.grad_sync", "overlap", "--grad-accumulation-steps", "2"]),
    # Steps overlapped (runtime.overlap_steps, the GPU's default) forced on the CPU: all_sums in the
    # compiled step, and the socket ring's threads.
    (2, "dora", ["--runtime.overlap_steps", "true", "--grad-accumulation-steps", "2"]),
    (2, "lora", ["--runtime.overlap_steps", "true", "--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.01"]),
    (2, "dora", ["--runtime.overlap_steps", "true", "--parallel.transport", "sockets", "--parallel.grad_sync",
                 "overlap", "--parallel.bucket_mb", "0.01"]),
])
def test_n_ranks_match_one_rank(tmp_path_factory, tmp_path, n, kind, extra):
    args = ["--batch-size", str(2 * n), "--fine-tune-type", kind, *extra]
    one = _one_process(tmp_path_factory, args)
    many = _run(n, tmp_path / "many", *args)
    _assert_same_run(one, tmp_path / "many")
    # Only rank 0 writes and reports.
    assert "adapters written to" in many.stdout and "[rank 1] adapters written" not in many.stdout


# Two links per rank (a hostfile with two addresses per host): MLX's ring and the socket ring stripe every
# all-reduce over both connections; the result is the one process's.
@pytest.mark.parametrize("n, kind, extra", [
    (2, "lora", []),
    (2, "lora", ["--parallel.transport", "sockets", "--parallel.grad_sync", "overlap", "--parallel.bucket_mb", "0.01"]),
    (3, "lora", ["--parallel.transport", "sockets", "--parallel.grad_sync", "overlap"]),
])
def test_n_ranks_over_two_links_match_one_rank(tmp_path_factory, tmp_path, n, kind, extra):
    args = ["--batch-size", str(2 * n), "--fine-tune-type", kind, *extra]
    one = _one_process(tmp_path_factory, args)
    many = _run(n, tmp_path / "many", *args, links=2)
    _assert_same_run(one, tmp_path / "many")
    assert "adapters written to" in many.stdout and "[rank 1] adapters written" not in many.stdout


def test_batch_the_ranks_cannot_share_fails_before_loading(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    proc = subprocess.run([*cmd, "launch", "-n", "2", "--", *cmd, "train", "--batch-size", "7",
                           "--adapter-path", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    # The launcher checks the layout itself now, before any rank starts.
    assert "nearest valid sizes are 6 or 8" in proc.stderr and "[rank" not in proc.stdout


def test_socket_transport_with_pipeline_stages_is_one_line_before_loading(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    proc = subprocess.run([*cmd, "launch", "-n", "2", "--", *cmd, "train", "--batch-size", "4", "--parallel.pp", "2",
                           "--parallel.transport", "sockets", "--adapter-path", str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "parallel.transport=sockets carries data-parallel gradients only" in said, said[-2000:]
    assert "set parallel.transport: mlx" in said and "Traceback" not in said


def test_launch_stops_everyone_and_fails_when_a_rank_fails():
    code = "import os, sys, time; r = int(os.environ['MLX_RANK']); print('up', r, flush=True); " \
           "sys.exit(3) if r == 1 else time.sleep(120)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable, "-c",
                           code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "[rank 0] up 0" in proc.stdout and "[rank 1] up 1" in proc.stdout
    assert "meshtune launch: rank 1 exited with code 3; stopping rank 0" in proc.stderr


def test_launch_names_the_failing_rank_not_the_peer_that_lost_it():
    """Rank 0 fails (exit 1) a moment after rank 1 has lost its connection to it (exit 75, the
    resumable code a retry script would loop on): the line and the exit code are rank 0's."""
    code = ("import os, sys, time; r = int(os.environ['MLX_RANK']); time.sleep(1.0 if r == 0 else 0.1); "
            "print('meshtune: error: rank', r, 'failed', flush=True) if r == 0 else None; sys.exit(1 if r == 0 else 75)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable, "-c",
                           code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[rank 0] meshtune: error: rank 0 failed" in proc.stdout
    assert "meshtune launch: rank 0 exited with code 1; rank 1 already exited" in proc.stderr, proc.stderr


def test_bench_scaling_prints_table_and_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "bench", "scaling", "--iters", "4",
                           "--local-batch", "4", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "weak-scaling efficiency" in proc.stdout and "--pin" in proc.stdout
    assert "\nlora  sockets" in proc.stdout and "\nfull  mlx" in proc.stdout  # both transports ran
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("overlap_speedup_full", "overlap_speedup_lora", "weak_scaling_lora", "overlap_speedup_full_sockets",
                "overlap_speedup_lora_mlx"):
        assert 0 < result[key] < 10, (key, result[key])  # a ratio of two measured rates
    assert 0 <= result["exposed_comm_fraction_overlap"] <= 1
    for kind in ("lora", "full"):  # the step times the docs quote, as the table prints them
        for tr in ("mlx", "sockets"):
            ms = result[f"step_ms_after_{kind}_{tr}"], result[f"step_ms_overlap_{kind}_{tr}"]
            assert re.search(rf"^{kind}\s+{tr}\s.*{result[f'step_ms_1_{kind}']:.1f} /\s+{ms[0]:.1f} /\s+{ms[1]:.1f}",
                             proc.stdout, re.M), (kind, tr, ms, proc.stdout)
            assert result[f"overlap_speedup_{kind}_{tr}"] == pytest.approx(ms[0] / ms[1])
    # the headline figures are the table's own numbers: best N-rank steps/s over the 1-rank steps/s of each kind
    for kind in ("lora", "full"):
        rows = re.findall(rf"^{kind}\s+\w+\s+([\d.]+) st/s\s+([\d.]+) st/s\s+([\d.]+) st/s", proc.stdout, re.M)
        assert len(rows) == 2, proc.stdout
        one = float(rows[0][0])
        best = max(float(v) for row in rows for v in row[1:])
        low, high = (best - 0.05) / (one + 0.05), (best + 0.05) / (one - 0.05)  # the table rounds to 0.1 st/s
        assert one > 0.05 and low <= result[f"weak_scaling_{kind}"] <= high
        printed = re.search(rf"^{kind}: weak-scaling efficiency ([\d.]+)%", proc.stdout, re.M)
        assert printed and float(printed.group(1)) == pytest.approx(100 * result[f"weak_scaling_{kind}"], abs=0.06)


@pytest.mark.serial  # times the exit after the stop
def test_a_stopped_rank_makes_the_others_exit_cleanly_and_resume_continues(tmp_path):
    import re
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    run = tmp_path / "run"
    train = ["train", "--iters", "100000", "--batch-size", "4", "--save-every", "5", "--steps-per-eval", "100000",
             "--runtime.watchdog_s", "4", "--adapter-path", str(run)]
    proc = subprocess.Popen([*cmd, "launch", "-n", "2", "--", *cmd, *train], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(r"\[rank 1\] rank 1 of 2: .*\(pid (\d+)\)", line):
            pid = int(m.group(1))
        if pid and (run / "checkpoints" / "0000005").exists():
            break
    assert pid, "".join(lines)
    os.kill(pid, signal.SIGSTOP)  # a hung peer: alive, silent
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    assert elapsed < 40
    # The launcher sees the stopped rank itself (state T) and names it in one line.
    assert re.search(r"meshtune launch: rank 1 stopped answering at step \d+ \(stopped \(SIGSTOP\)\); stopping rank 0",
                     err), err
    # The last complete checkpoint resumes on one process and trains on past it.
    last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    resumed = subprocess.run([*cmd, "train", "--iters", str(last + 2), "--batch-size", "4", "--save-every", "5",
                              "--adapter-path", str(run), "--resume"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert re.search(rf"resumed from step {last}\b", resumed.stdout), resumed.stdout[-2000:]
    assert (run / "checkpoints" / f"{last + 2:07d}").is_dir()  # the last step's checkpoint
