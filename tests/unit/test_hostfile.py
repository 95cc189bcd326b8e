"""mlx.launch's hostfile as meshtune reads it (runtime/hostfile.py): both forms, every address a link,
JACCL's RDMA devices checked, and each bad file one line naming the host."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshtune.parallel.launcher import jaccl_env, write_ring_hostfile
from meshtune.runtime.hostfile import read_hostfile


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    return path


def test_both_forms_are_read(tmp_path):
    listed = read_hostfile(_write(tmp_path, [{"ssh": "a", "ips": ["10.0.0.1", "10.0.1.1"]},
                                             {"ssh": "b", "ips": ["10.0.0.2", "10.0.1.2"]}]))
    assert [h.ssh for h in listed.hosts] == ["a", "b"] and listed.links == 2 and listed.backend == ""
    listed.check_ring()
    obj = read_hostfile(_write(tmp_path, {"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"],
                                          "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
                                                    {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]}]}))
    assert obj.backend == "jaccl" and obj.envs == ["MLX_METAL_FAST_SYNCH=1"] and obj.hosts[1].rdma == ["rdma_en3", None]
    obj.check_jaccl("jaccl")


@pytest.mark.parametrize("hosts,message", [
    ([{"ssh": "a", "ips": ["10.0.0.1", "10.0.1.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}],
     "host a lists 2 addresses and host b 1; MLX's ring needs the same number of links on every host"),
    ([{"ssh": "a", "ips": ["10.0.0.1", "10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2", "10.0.1.2"]}],
     "host a lists address 10.0.0.1 twice; each address is one link"),
])
def test_a_ring_that_cannot_use_every_link_is_one_line(tmp_path, hosts, message):
    hostfile = read_hostfile(_write(tmp_path, hosts))
    with pytest.raises(ValueError, match=message) as err:
        hostfile.check_ring()
    assert str(hostfile.path) in str(err.value) and "\n" not in str(err.value)


THREE = [{"ssh": f"m{i}", "ips": [f"10.0.0.{i}"]} for i in range(3)]


@pytest.mark.parametrize("rdma,backend,message", [
    ([[None, "x"], ["x", None], ["x", "y", None]], "jaccl", "host m0 lists 2 RDMA devices"),
    ([["x", "y", "z"], ["x", None, "y"], ["x", "y", None]], "jaccl", "host m0 lists RDMA device 'x' for itself"),
    ([[None, "x", None], ["x", None, "y"], ["x", "y", None]], "jaccl", "host m0 lists no RDMA device to m2"),
])
def test_jaccl_devices_that_do_not_join_the_ranks_are_one_line(tmp_path, rdma, backend, message):
    hostfile = read_hostfile(_write(tmp_path, [dict(h, rdma=r) for h, r in zip(THREE, rdma)]))
    with pytest.raises(ValueError, match=message):
        hostfile.check_jaccl(backend)


def test_jaccl_ring_needs_only_the_neighbours(tmp_path):
    """In a ring of 4, m0 talks to m3 and m1 only (jaccl-ring); all-to-all JACCL needs m2 too."""
    hosts = [{"ssh": f"m{i}", "ips": [f"10.0.0.{i}"],
              "rdma": [None if j == i or (i - j) % 4 == 2 else f"rdma{i}{j}" for j in range(4)]} for i in range(4)]
    hostfile = read_hostfile(_write(tmp_path, hosts))
    hostfile.check_jaccl("jaccl-ring")
    with pytest.raises(ValueError, match="host m0 lists no RDMA device to m2"):
        hostfile.check_jaccl("jaccl")


def test_the_ring_hostfile_holds_every_address_with_a_port_each(tmp_path):
    path = write_ring_hostfile(2, tmp_path, [["127.0.0.1", "127.0.0.2"], ["127.0.0.1", "127.0.0.2"]])
    ring = json.loads(path.read_text())
    assert [[a.split(":")[0] for a in rank] for rank in ring] == [["127.0.0.1", "127.0.0.2"]] * 2
    ports = [int(a.split(":")[1]) for rank in ring for a in rank]
    assert len(set(ports)) == 4


def test_jaccl_environment_is_mlx_launch_s_for_the_same_hostfile(tmp_path, monkeypatch):
    """mlx.launch's own launch_jaccl, its process start recorded: the same variables and device file
    (the coordinator's port is each launcher's own pick)."""
    from mlx._distributed_utils import launch as mlx_launch
    from mlx._distributed_utils.common import Hostfile as MlxHostfile

    hosts = [{"ssh": f"m{i}", "ips": [f"10.0.0.{i}"],
              "rdma": [None if j == i else f"rdma_en{j}" for j in range(3)]} for i in range(3)]
    path = _write(tmp_path, hosts)
    for backend in ("jaccl", "jaccl-ring"):
        seen = []
        monkeypatch.setattr(mlx_launch, "_launch_with_io", lambda _cls, procs, _verbose: seen.extend(procs))
        args = SimpleNamespace(backend=backend, env=[], cwd=None, verbose=False, starting_port=32323, python=None)
        mlx_launch.launch_jaccl(None, MlxHostfile.from_file(path).hosts, args, ["true"])
        variables, files = jaccl_env(read_hostfile(path), backend)
        for rank, ((r, host, _python, _cwd, mlx_files, mlx_env, _cmd), _kw) in enumerate(seen):
            assert r == rank and host == hosts[rank]["ssh"]
            assert mlx_files == files
            theirs = dict(e.split("=", 1) for e in mlx_env)
            assert theirs.keys() == variables.keys()
            assert theirs["MLX_JACCL_COORDINATOR"].split(":")[0] == variables["MLX_JACCL_COORDINATOR"].split(":")[0]
            assert {k: v for k, v in theirs.items() if k != "MLX_JACCL_COORDINATOR"} == \
                {k: v for k, v in variables.items() if k != "MLX_JACCL_COORDINATOR"}
