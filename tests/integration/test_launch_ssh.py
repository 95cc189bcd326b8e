"""`meshtune launch --hostfile`: ranks started over ssh, output prefixed, failing together.

No remote host is reachable here, so `ssh` on PATH is a fake (support.FAKE_SSH): it runs the
remote command locally with a cleared environment. The launcher's code path (hostfile, remote
script, pid line, remote kill) is the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from meshtune.bench.faultkit import CLI, env
from support import fake_ssh
from meshtune.parallel.launcher import HOSTFILE_POLL_S
from meshtune.runtime.hostfile import read_hostfile

def _fake_ssh(tmp_path) -> dict[str, str]:
    return fake_ssh(tmp_path, env())


def _hostfile(tmp_path, n: int, ips: tuple[str, ...] = ("127.0.0.1",)):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": f"node{i}", "ips": list(ips)} for i in range(n)]))
    return path


def test_ranks_start_over_ssh_and_all_sum(tmp_path):
    environ = _fake_ssh(tmp_path)
    code = ("import os, mlx.core as mx; g = mx.distributed.init(); "
            "s = mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g); "
            "print('sum', int(s[0].item()), 'rank', g.rank(), 'of', g.size(), 'cwd', os.getcwd(), "
            "'pp', bool(os.environ.get('PYTHONPATH')), flush=True); "
            "print('again:', os.environ['MESHTUNE_LAUNCH_COMMAND'], flush=True)")
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(_hostfile(tmp_path, 3)), "--", sys.executable, "-c",
                           code], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in range(3):  # every rank ran, in the launcher's folder, with the forwarded PYTHONPATH
        assert f"[rank {rank}] sum 6 rank {rank} of 3 cwd {tmp_path} pp True" in proc.stdout, proc.stdout
        # what the run's resume line starts again (runtime/relaunch.resume_command): this launch, not -n 3 here
        assert f"[rank {rank}] again: meshtune launch --hostfile {tmp_path / 'hosts.json'}\n" in proc.stdout
    calls = (tmp_path / "ssh.log").read_text().splitlines()
    checks = [line for line in calls if "meshtune.parallel.link_check" in line]  # one link check per host first
    log = [line for line in calls if line not in checks]
    assert sorted(line.split()[0] for line in checks) == ["node0", "node1", "node2"]
    assert sorted(line.split()[0] for line in log) == ["node0", "node1", "node2"]
    assert all("MLX_RANK=" in line and "MLX_HOSTFILE=" in line for line in log)
    assert "meshtune-remote-pid" not in proc.stdout  # the launcher's own line is not shown
    _assert_removed(_remote_hostfiles(log, 3))


def _remote_hostfiles(ssh_log: list[str], n: int) -> list[str]:
    """The ring hostfile each "remote" rank was given (MLX_HOSTFILE on its ssh command line)."""
    files = sorted({word.split("=", 1)[1] for line in ssh_log for word in line.split()
                    if word.startswith("MLX_HOSTFILE=")})
    assert len(files) == n and all(f.startswith("/tmp/meshtune-") for f in files), files
    return files


def _assert_removed(files: list[str]) -> None:
    """Each host removes its rank's hostfile once the rank has ended (its watcher polls every HOSTFILE_POLL_S)."""
    deadline = time.monotonic() + 3 * HOSTFILE_POLL_S
    while any(os.path.exists(f) for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f) for f in files), files


def test_a_failing_remote_rank_stops_the_others_there_too(tmp_path):
    environ = _fake_ssh(tmp_path)
    code = ("import os, sys, time; r = int(os.environ['MLX_RANK']); print('up', r, os.getpid(), flush=True); "
            "time.sleep(1) if r == 1 else time.sleep(120); sys.exit(3)")
    tic = time.monotonic()
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(_hostfile(tmp_path, 2)), "--", sys.executable, "-c",
                           code], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - tic < 30
    assert "meshtune launch: rank 1 exited with code 3; stopping rank 0" in proc.stderr
    # "[rank R] up R PID", in whatever order the ranks printed: rank 0's pid by its rank, not by its line's place.
    pids = {int(f[3]): int(f[4]) for f in (line.split() for line in proc.stdout.splitlines()) if f[2:3] == ["up"]}
    assert sorted(pids) == [0, 1], proc.stdout
    # rank 0's process (the "remote" one, in a session the launcher's signals do not reach) was killed
    # through ssh; it ends soon after (nothing there waits for it).
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pids[0]}")
    log = (tmp_path / "ssh.log").read_text().splitlines()
    assert any(line.startswith("node0 kill -15") for line in log)
    _assert_removed(_remote_hostfiles(log, 2))  # the killed rank's too


def test_hostfile_errors_are_one_line(tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('[{"ssh": "a"}]')
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(bad), "--", "true"], env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f'meshtune: error: --hostfile {bad}: every entry needs "ssh" (a host name) and "ips" (a non-empty list of '
        'addresses), e.g. [{"ssh": "mac1", "ips": ["10.0.0.1"]}]']
    good = tmp_path / "good.json"
    good.write_text('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]')
    assert [h.ssh for h in read_hostfile(good).hosts] == ["a", "b"]
    proc = subprocess.run([*CLI, "launch", "-n", "3", "--hostfile", str(good), "--", "true"], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "-n 3 but the hostfile lists 2 hosts" in proc.stderr


def test_an_ssh_that_cannot_connect_is_named(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\necho "ssh: connect to host $1 port 22: Connection refused" >&2\nexit 255\n')
    ssh.chmod(0o755)
    environ = dict(env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    hosts = str(_hostfile(tmp_path, 2))
    # Before any rank starts, the link check's ssh fails first: one line naming the host.
    proc = subprocess.run([*CLI, "launch", "--hostfile", hosts, "--", sys.executable, "-c", "pass"], env=environ,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"meshtune: error: --hostfile {hosts}: the link check on host node0 failed (exit 255: ssh: connect to host "
        "node0 port 22: Connection refused); check that `ssh node0 true` works without a password prompt, or pass "
        "--no-link-check"]
    # Without it, the ranks' own ssh fails and the launcher names it.
    proc = subprocess.run([*CLI, "launch", "--hostfile", hosts, "--no-link-check", "--", sys.executable, "-c",
                           "pass"], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 255, proc.stdout + proc.stderr
    assert "exited with code 255 (ssh's own failure code: check that `ssh node" in proc.stderr
    assert "true` works without a password prompt)" in proc.stderr


def test_an_address_that_is_not_its_host_s_is_named_before_any_rank_starts(tmp_path):
    """Host node1 lists an address no interface here has (TEST-NET-2): the link check run on it over ssh
    says so in one line, and no rank starts."""
    environ = _fake_ssh(tmp_path)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"ssh": "node0", "ips": ["127.0.0.1"]}, {"ssh": "node1", "ips": ["198.51.100.77"]}]))
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(path), "--", sys.executable, "-c", "print('started')"],
                          env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"meshtune: error: --hostfile {path}: host node1 cannot use address 198.51.100.77 ("), lines
    assert "it is not on any of its interfaces" in lines[0] and lines[0].endswith(
        "--no-link-check starts the ranks anyway"), lines
    assert "started" not in proc.stdout
    calls = (tmp_path / "ssh.log").read_text().splitlines()
    assert calls and all("meshtune.parallel.link_check" in line for line in calls), calls


def test_every_address_a_host_lists_is_a_link_of_the_ring(tmp_path):
    """Two addresses per host: each rank's ring hostfile holds both, a port each, and MLX's ring sums over
    the two connections (127.0.0.2 is this machine's loopback too)."""
    environ = _fake_ssh(tmp_path)
    code = ("import os, json, mlx.core as mx; ring = json.load(open(os.environ['MLX_HOSTFILE'])); "
            "g = mx.distributed.init(); s = mx.distributed.all_sum(mx.arange(1000.0) * (g.rank() + 1), group=g); "
            "print('links', [len(r) for r in ring], 'sum', int(s.sum().item()), flush=True)")
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(_hostfile(tmp_path, 2, ("127.0.0.1", "127.0.0.2"))),
                           "--", sys.executable, "-c", code], env=environ, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in range(2):
        assert f"[rank {rank}] links [2, 2] sum {3 * 999 * 1000 // 2}" in proc.stdout, proc.stdout


def test_jaccl_ranks_get_mlx_launch_s_environment(tmp_path):
    """--backend jaccl from the hostfile's "backend": each remote rank gets the coordinator (rank 0's first
    address), the hosts' RDMA devices in a file of its own, and the hostfile's "envs", as mlx.launch gives
    them (tests/unit/test_hostfile.py compares the two launchers); no Thunderbolt here, so the ranks print
    what they were given instead of joining."""
    environ = _fake_ssh(tmp_path)
    hosts = [{"ssh": f"node{i}", "ips": [f"10.0.0.{i + 1}"], "rdma": [None if j == i else f"rdma_en{j}"
                                                                      for j in range(2)]} for i in range(2)]
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": hosts}))
    code = ("import os, json; e = os.environ; print('got', e['MLX_RANK'], e['MLX_JACCL_COORDINATOR'].split(':')[0], "
            "json.load(open(e['MLX_IBV_DEVICES'])), e['MLX_METAL_FAST_SYNCH'], 'MLX_HOSTFILE' in e, flush=True)")
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(path), "--", sys.executable, "-c", code],
                          env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in range(2):
        assert (f"[rank {rank}] got {rank} 10.0.0.1 [[None, 'rdma_en1'], ['rdma_en0', None]] 1 False"
                in proc.stdout), proc.stdout
    missing = tmp_path / "bad.json"
    missing.write_text(json.dumps([dict(h, rdma=[None, None]) for h in hosts]))
    proc = subprocess.run([*CLI, "launch", "--hostfile", str(missing), "--backend", "jaccl", "--", "true"],
                          env=environ, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f'meshtune: error: --hostfile {missing}: host node0 lists no RDMA device to node1; --backend jaccl needs '
        'one (e.g. "rdma_en3")']
