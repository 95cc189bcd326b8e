"""`meshtune launch --backend nccl`: one rank per GPU of this machine, joined through rank 0.

No GPU here, so the ranks print what they were given instead of joining NCCL (the
H200 runs are started by hand); the launcher's path is the real one:
processes started, environment set per rank, output prefixed, exit codes checked.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshtune.bench.faultkit import CLI, env

SHOW = ("import os; print(' '.join(f'{k}={os.environ.get(k, \"-\")}' for k in "
        "('MLX_RANK', 'MLX_WORLD_SIZE', 'NCCL_HOST_IP', 'NCCL_PORT', 'CUDA_VISIBLE_DEVICES', 'MLX_HOSTFILE')), "
        "flush=True)")


def _launch(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "launch", *args], env=environ or env(), capture_output=True, text=True,
                          timeout=120)


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split("] ", 1)[1].split())


def test_each_rank_gets_rank_zero_address_and_its_own_gpu():
    proc = _launch("-n", "3", "--backend", "nccl", "--", sys.executable, "-c", SHOW,
                   environ=dict(env(), MLX_HOSTFILE="/outer/ring.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ranks = {int(f["MLX_RANK"]): f for f in map(_fields, proc.stdout.strip().splitlines())}
    assert sorted(ranks) == [0, 1, 2], proc.stdout
    assert {f["NCCL_PORT"] for f in ranks.values()} != {"-"} and len({f["NCCL_PORT"] for f in ranks.values()}) == 1
    for i, f in ranks.items():
        assert (f["MLX_WORLD_SIZE"], f["NCCL_HOST_IP"], f["CUDA_VISIBLE_DEVICES"], f["MLX_HOSTFILE"]) == \
            ("3", "127.0.0.1", str(i), "-")


def test_ranks_take_their_gpus_from_cuda_visible_devices():
    proc = _launch("-n", "2", "--backend", "nccl", "--", sys.executable, "-c", SHOW,
                   environ=dict(env(), CUDA_VISIBLE_DEVICES="5, 7"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = {f["MLX_RANK"]: f["CUDA_VISIBLE_DEVICES"] for f in map(_fields, proc.stdout.strip().splitlines())}
    assert got == {"0": "5", "1": "7"}


def test_a_failing_nccl_rank_fails_the_launch():
    code = "import os, sys; sys.exit(3 if os.environ['MLX_RANK'] == '1' else 0)"
    proc = _launch("-n", "2", "--backend", "nccl", "--", sys.executable, "-c", code)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "rank 1" in proc.stderr


def test_nccl_with_a_hostfile_is_a_one_line_error(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text('[{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]')
    proc = _launch("--hostfile", str(hosts), "--backend", "nccl", "--", sys.executable, "-c", "pass")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--backend nccl" in lines[0] and "mlx.launch" in lines[0], proc.stderr


def _nccl_built() -> bool:
    import mlx.core as mx

    return mx.distributed.is_available("nccl")


def test_nccl_on_an_mlx_without_it_is_a_one_line_error_before_any_rank(tmp_path):
    if _nccl_built():
        pytest.skip("MLX's CUDA build: the ranks join NCCL")
    proc = _launch("-n", "2", "--backend", "nccl", "--", "meshtune", "train", "--iters", "2",
                   "--adapter-path", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "this MLX has no NCCL" in lines[0] and "--backend ring" in lines[0], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "r").exists()


def test_a_rank_whose_backend_forms_a_smaller_world_stops_instead_of_training_alone(tmp_path):
    """A rank told MLX_WORLD_SIZE=2 whose backend gives it a world of 1 (no peer to join: here no
    hostfile) would train the whole batch alone, writing into the run folder beside its peers."""
    environ = {k: v for k, v in env().items() if k != "MLX_HOSTFILE"} | {"MLX_RANK": "0", "MLX_WORLD_SIZE": "2"}
    proc = subprocess.run([*CLI, "train", "--iters", "2", "--adapter-path", str(tmp_path / "r")], env=environ,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MLX_WORLD_SIZE=2" in lines[0] and "a world of 1" in lines[0], proc.stderr
    assert not (tmp_path / "r").exists()
