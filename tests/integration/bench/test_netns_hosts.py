"""The namespace multi-host harness (bench/harness/netns_hosts.py) gives hosts that behave like
separate machines: each reaches the others over the bridge, but not their loopback, /dev/shm or
/tmp; processes on one host share its /dev/shm and host identity; a checkout under /tmp is seen by
every host as on the machine; and nothing survives the block."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.harness import netns_hosts

PY = sys.executable
SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()
"""
CONNECT = """
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).recv(64).decode())
except OSError as e:
    print("refused", type(e).__name__)
"""
IDENTITY = "from services.kit.process.hosts import host_identity; print(host_identity())"
ADVERTISED = "from services.kit.config.service import ServiceConfig, advertised_host; print(advertised_host(ServiceConfig(host='0.0.0.0')))"


@pytest.fixture(scope="module")
def hosts():
    netns_hosts.require()
    with netns_hosts.namespace_hosts(2) as made:
        yield made
    left = made.leftovers()
    assert left == {"namespaces": [], "interfaces": [], "processes": []}, left


def serve(hosts, host: int, bind: str, port: int, reply: str):
    proc = hosts.popen(
        host, [PY, "-c", SERVE, bind, str(port), reply], stdout=netns_hosts.subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "listening"
    return proc


def test_hosts_reach_each_other_over_the_bridge_but_not_each_others_loopback(hosts):
    serve(hosts, 1, hosts[1].address, 7001, "from-host1")
    serve(hosts, 1, "127.0.0.1", 7002, "host1-loopback")
    serve(hosts, 2, "127.0.0.1", 7002, "host2-loopback")  # same port, own loopback: no clash
    assert hosts.run(2, [PY, "-c", CONNECT, hosts[1].address, "7001"]).strip() == "from-host1"
    assert hosts.run(2, [PY, "-c", CONNECT, "127.0.0.1", "7002"]).strip() == "host2-loopback"
    assert hosts.run(1, [PY, "-c", CONNECT, "127.0.0.1", "7002"]).strip() == "host1-loopback"
    # The test process is on the subnet too (the controller), and sees host 1's address.
    with socket.create_connection((hosts[1].address, 7001), timeout=3) as conn:
        assert conn.recv(64) == b"from-host1"


def test_a_service_bound_to_every_interface_advertises_its_hosts_address(hosts):
    for i in (1, 2):
        assert hosts.run(i, [PY, "-c", ADVERTISED]).strip() == hosts[i].address


def test_each_host_has_its_own_shm_and_tmp_shared_by_its_processes(hosts):
    hosts.run(
        1, ["sh", "-c", "echo one > /dev/shm/looprl-harness-probe && echo one > /tmp/looprl-harness-probe"]
    )
    assert hosts.run(1, ["cat", "/dev/shm/looprl-harness-probe", "/tmp/looprl-harness-probe"]).split() == [
        "one",
        "one",
    ]
    assert (
        hosts.run(2, ["sh", "-c", "ls /dev/shm /tmp | grep -c looprl-harness-probe || true"]).strip() == "0"
    )
    with pytest.raises(FileNotFoundError):
        open("/dev/shm/looprl-harness-probe").close()
    one = {hosts.run(1, [PY, "-c", IDENTITY]).strip() for _ in range(2)}
    two = hosts.run(2, [PY, "-c", IDENTITY]).strip()
    from services.kit.process.hosts import host_identity

    assert len(one) == 1 and two not in one and host_identity() not in one | {two}


def test_a_checkout_under_tmp_is_seen_by_every_host_and_the_rest_of_tmp_is_not():
    netns_hosts.require()
    checkout = Path(tempfile.mkdtemp(prefix="looprl-checkout-", dir="/tmp"))
    beside = Path(tempfile.mkdtemp(prefix="looprl-beside-", dir="/tmp"))
    try:
        (checkout / ".venv").mkdir()
        (checkout / ".venv" / "marker").write_text("venv")
        (beside / "marker").write_text("machine only")
        with netns_hosts.namespace_hosts(2, controller=False, shared_paths=[str(checkout)]) as hosts:
            for i in (1, 2):
                assert hosts.run(i, ["cat", str(checkout / ".venv" / "marker")]) == "venv"
                assert (
                    hosts.run(i, ["sh", "-c", f"test -e {beside}/marker && echo seen || echo unseen"]).strip()
                    == "unseen"
                )
            # The same directory as on the machine (as a shared volume), also where a process
            # starts when the test runs from inside it.
            hosts.run(1, ["sh", "-c", "echo written > from-host1"], cwd=str(checkout))
            assert (checkout / "from-host1").read_text().strip() == "written"
            assert hosts.run(2, ["cat", "from-host1"], cwd=str(checkout)).strip() == "written"
    finally:
        shutil.rmtree(checkout, ignore_errors=True)
        shutil.rmtree(beside, ignore_errors=True)


def test_teardown_leaves_no_namespace_interface_or_process():
    netns_hosts.require()
    with netns_hosts.namespace_hosts(3) as made:
        stubborn = made.popen(3, ["sh", "-c", "trap '' TERM; sleep 600"])  # ignores SIGTERM
        escaped = made.run(
            2, ["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 & echo $!"]
        ).strip()  # left its group
        during = made.leftovers()
        assert len(during["namespaces"]) == 4 and during["interfaces"] == [f"{made.tag}c"]
        time.sleep(0.2)
    assert stubborn.poll() is not None
    left = made.leftovers()
    assert left == {"namespaces": [], "interfaces": [], "processes": []}, left
    assert not alive(int(escaped))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
