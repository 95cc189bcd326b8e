"""A rank whose ring backend cannot start (its hostfile address is not this host's, its port is taken)
says so in one line with the cause in words, exit 2, where it gave MLX's traceback."""

from __future__ import annotations

import json
import socket
import subprocess

from meshtune.bench.faultkit import CLI, env


def _rank0(tmp_path, addresses):
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[a] for a in addresses]))
    environ = env() | {"MLX_RANK": "0", "MLX_WORLD_SIZE": "2", "MLX_HOSTFILE": str(hostfile)}
    return subprocess.run([*CLI, "train", "--iters", "1", "--adapter-path", str(tmp_path / "r")], env=environ,
                          capture_output=True, text=True, timeout=120)


def test_an_address_not_on_this_host_names_the_hostfile_entry(tmp_path):
    proc = _rank0(tmp_path, ["10.255.255.1:45123", "127.0.0.1:45124"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "rank 0: the distributed backend could not start" in lines[0]
    assert "not one of this host's: give this host's own IP in its hostfile entry" in lines[0]
    assert not (tmp_path / "r").exists()


def test_a_port_in_use_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _rank0(tmp_path, [f"127.0.0.1:{port}", "127.0.0.1:1"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0], proc.stderr
