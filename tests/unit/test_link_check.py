"""parallel/link_check.py: what a host finds about its links, and the one line each problem gets."""

from __future__ import annotations

import socket
from pathlib import Path

from meshtune.parallel.link_check import answers, own_address, probe, problems
from meshtune.runtime.hostfile import Host, Hostfile


def _hostfile(*ips: list[str]) -> Hostfile:
    return Hostfile(Path("hosts.json"), [Host(f"mac{i + 1}", list(a)) for i, a in enumerate(ips)])


def test_a_host_binds_its_own_addresses_only():
    assert own_address("127.0.0.1") == ""
    assert own_address("198.51.100.77") != ""  # TEST-NET-2: on no interface here


def test_a_refused_connection_answers_and_a_listening_one_too():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: the kernel refuses
        assert answers("127.0.0.1", 1.0, port) == ""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert answers("127.0.0.1", 1.0, server.getsockname()[1]) == ""


def test_probe_reports_binds_answers_and_source_addresses():
    found = probe(["127.0.0.1"], ["127.0.0.1"], timeout=1.0)
    assert found == {"own": {"127.0.0.1": ""}, "answers": {"127.0.0.1": ""}, "source": {"127.0.0.1": "127.0.0.1"}}


def test_each_problem_is_one_line_naming_host_and_address():
    hostfile = _hostfile(["10.0.0.1", "10.0.1.1"], ["10.0.0.2", "10.0.1.2"])
    clean = [{"own": {"10.0.0.1": "", "10.0.1.1": ""}, "answers": {"10.0.0.2": "", "10.0.1.2": ""},
              "source": {"10.0.0.2": "10.0.0.1", "10.0.1.2": "10.0.1.1"}},
             {"own": {"10.0.0.2": "", "10.0.1.2": ""}, "answers": {"10.0.0.1": "", "10.0.1.1": ""},
              "source": {"10.0.0.1": "10.0.0.2", "10.0.1.1": "10.0.1.2"}}]
    assert problems(hostfile, clean) == []
    silent = [clean[0], dict(clean[1], answers={"10.0.0.1": "", "10.0.1.1": "no answer in 2 s"})]
    assert problems(hostfile, silent) == [
        "host mac2 cannot reach host mac1's address 10.0.1.1 (no answer in 2 s); check that cable, or list on "
        "every host only the addresses whose cables are connected"]
    one_cable = [dict(clean[0], source={"10.0.0.2": "10.0.0.1", "10.0.1.2": "10.0.0.1"}), clean[1]]
    assert problems(hostfile, one_cable) == [
        "host mac1 reaches host mac2's addresses 10.0.0.2 and 10.0.1.2 both from its address 10.0.0.1 (one "
        "interface): two links on one cable add nothing; give each cable its own subnet"]
    foreign = [clean[0], dict(clean[1], own={"10.0.0.2": "Cannot assign requested address", "10.0.1.2": ""})]
    assert problems(hostfile, foreign) == [
        "host mac2 cannot use address 10.0.0.2 (Cannot assign requested address): it is not on any of its "
        "interfaces; list the addresses that host's cables have (ifconfig / ip addr)"]


def test_loopback_links_share_their_interface_by_design():
    hostfile = _hostfile(["127.0.0.1", "127.0.0.2"], ["127.0.0.1", "127.0.0.2"])
    found = [{"own": {"127.0.0.1": "", "127.0.0.2": ""}, "answers": {"127.0.0.1": "", "127.0.0.2": ""},
              "source": {"127.0.0.1": "127.0.0.1", "127.0.0.2": "127.0.0.1"}}] * 2
    assert problems(hostfile, found) == []
