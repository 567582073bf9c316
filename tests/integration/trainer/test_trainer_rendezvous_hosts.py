"""Trainer ranks on different hosts form one gloo group: rank 0's rendezvous address is reachable
from the other hosts and every rank binds the interface that holds its own host's address (on a
namespace host the host name resolves elsewhere, so gloo's default would bind the wrong one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.harness import netns_hosts

RANK = """
import sys, torch, torch.distributed as dist
from services.trainer.worker import TrainerWorker
rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
worker = TrainerWorker(rank, 2)
worker.init_process_group(host, port, timeout_s=60)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
worker.shutdown()
"""


@pytest.mark.slow  # two processes import torch and form a gloo group
def test_two_ranks_on_two_hosts_all_reduce_over_the_bridge():
    netns_hosts.require()
    with netns_hosts.namespace_hosts(2, controller=False) as hosts:
        host, port = hosts[1].address, 29511
        ranks = [
            hosts.popen(
                i + 1,
                [sys.executable, "-c", RANK, str(i), host, str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                # an in-process trainer test of this session may have set it to "lo"
                env={k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"},
            )
            for i in range(2)
        ]
        outs = [proc.communicate(timeout=120)[0] for proc in ranks]
        assert all(proc.returncode == 0 for proc in ranks), outs
        assert all("SUM 3.0" in out for out in outs), outs
    assert hosts.leftovers() == {"namespaces": [], "interfaces": [], "processes": []}


def test_interface_of_finds_the_interface_holding_an_address():
    from services.kit.process.hosts import interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") == ""  # documentation range: on no interface here
