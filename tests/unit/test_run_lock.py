"""One run per folder (runtime/run_lock.py) and ports held against other launchers (parallel/launch_ports.py)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from meshtune.parallel import launch_ports as ports_module
from meshtune.parallel.launch_ports import HeldPorts
from meshtune.run_dir import LOCK_FILE
from meshtune.runtime.run_lock import lock_folder


def test_a_second_holder_is_refused_with_the_first_one_s_pid_and_host(tmp_path):
    run = tmp_path / "run"
    first = lock_folder(run, say=lambda line: None)
    with pytest.raises(ValueError) as refused:
        lock_folder(run, say=lambda line: None)  # a second open file: flock refuses it as it would another process
    line = str(refused.value)
    assert f"output.adapter_path={run} is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in line
    assert "choose another --adapter-path" in line and "\n" not in line
    first.release()
    assert not run.exists()  # made by the lock and left empty: gone with it
    lock_folder(run, say=lambda line: None).release()


def test_a_lock_left_by_a_dead_run_is_taken_over_with_a_note_and_its_temp_files_go(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "since": 0}))
    (run / ".adapters.safetensors.tmp-999999.safetensors").write_bytes(b"cut")
    (run / ".earlier-run-999999").mkdir()
    (run / "adapters.safetensors").write_bytes(b"kept")
    said = []
    lock = lock_folder(run, say=said.append)
    assert len(said) == 2 and "left by a run that ended without releasing it (pid 999999 on elsewhere" in said[0]
    assert "removed 2 unfinished temp files" in said[1]
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "adapters.safetensors"]
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == ["adapters.safetensors"]  # a folder it did not make stays


def test_clear_removes_the_whole_earlier_run_and_keeps_the_lock(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "0000002").mkdir(parents=True)
    for name in ("adapters.safetensors", "adapter_config.json", "metrics.jsonl", "report.md"):
        (run / name).write_text("old")
    lock = lock_folder(run, say=lambda line: None)
    assert lock.clear() == 5
    assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    lock.release()


class FakeSocket:
    """A socket whose bind(0) hands out the ports of `given` in turn (the kernel's choice, scripted)."""

    def __init__(self, given):
        self._given = given

    def bind(self, address):
        self.port = self._given.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        pass


def test_a_port_another_launcher_holds_is_passed_over(tmp_path, monkeypatch):
    given = [41001, 41002, 41001, 41003, 41004]
    monkeypatch.setattr(ports_module.socket, "socket", lambda: FakeSocket(given))  # the kernel's choice
    with HeldPorts(tmp_path) as first, HeldPorts(tmp_path) as second:
        assert first.take(2) == [41001, 41002]
        assert second.take(2) == [41003, 41004]  # 41001 came back from the kernel, but the first launcher holds it
    given.extend([41001])
    with HeldPorts(tmp_path) as third:
        assert third.take(1) == [41001]  # released with its launcher
