"""The stack across three namespace hosts (bench/harness/netns_hosts.py), and the loss of one.

Host 1 runs nats-server, the Ray head and every service (`looprl up --host <host 1>`), host 2 and
host 3 a Ray worker node each. The recipe places by custom Ray resources: deployment "near" on host
1, "mid" on host 2, "far" on host 3 (`deployments.ray_resources`), and the two trainer ranks on
hosts 1 and 2 (`trainer.ray_resources_per_rank`, one `trainer_node` each; the default recipe at two
ranks). It runs through the gateway as a user's would, and host 3 is killed mid-run (its link down,
every process in it SIGKILLed). The run must complete, learn, account for every rollout, report the replica on
host 3 gone, and weight-sync must have used shared memory only for host 1's replica and gRPC for the
others; the byte counts per transport and host, the reward curve and the recovery time are printed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from bench.harness import netns_hosts
from bench.harness.multihost import stack_on_hosts
from looprl.gateway.v1 import gateway_pb2
from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from tests.support.runs import assert_accounting, with_overrides
from tests.support.stack import DEFAULT_RECIPE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The default recipe, shortened. Its first 60 steps (seed 1) learn the answer format: the mean reward
# of the last 10 steps is ~0.09 against ~0.04 for the first 10 (measured here, with and without the
# loss of host 3: the run is seeded, so the curve repeats); leaving the format ceiling takes ~150.
STEPS = 60
LEARNING_MARGIN = 0.03
KILL_AT_STEP = 20
# Deployment -> the host its replica must run on.
PLACEMENT = {"near": 1, "mid": 2, "far": 3}
RESOURCES = {
    1: {"host1": 1, "trainer_node": 1},
    2: {"host2": 1, "trainer_node": 1},
    3: {"host3": 1},
}
# The slowest step after the loss may take the router's status timeout (5 s) and a poll to notice
# (measured 6.3 s; 121 s before a failed poll released the requests in flight), far below the
# request timeout (120 s) that held them before.
MAX_RECOVERY_S = 30.0


def recipe() -> str:
    text = DEFAULT_RECIPE[: DEFAULT_RECIPE.index("[[deployments]]")]
    text = with_overrides(text, run={"steps": STEPS}, trainer={"checkpoint_every": 10, "world_size": 2})
    text = text.replace("[trainer]\n", "[trainer]\nray_resources_per_rank = { trainer_node = 1 }\n")
    for name, host in PLACEMENT.items():
        text += (
            f'\n[[deployments]]\nname = "{name}"\nreplicas = 1\nmax_model_len = 128\n'
            f"max_batch_size = 64\nmax_output_tokens = 32\nray_resources = {{ host{host} = 1 }}\n"
        )
    return text


def delivered_bytes(metrics_url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("looprl_weight_sync_delivered_bytes_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.index("}")]))
            out[(labels["transport"], labels["host"])] = float(line.rsplit(" ", 1)[1])
    return out


def replicas(stack) -> dict[str, inference_pb2.ReplicaInfo]:
    with stack.state.channel("inference-router") as channel:
        reply = inference_pb2_grpc.InferenceRouterServiceStub(channel).ListDeployments(
            inference_pb2.ListDeploymentsRequest(), timeout=10
        )
    return {r.name: r for d in reply.deployments for r in d.replicas}


def routes(stack) -> dict[str, weightsync_pb2.DeliveryRoute]:
    with stack.state.channel("weight-sync") as channel:
        reply = weightsync_pb2_grpc.WeightSyncServiceStub(channel).GetVersion(
            weightsync_pb2.GetVersionRequest(), timeout=10
        )
    # One target per replica (named like it), one route per TP rank (tp = 1 here).
    return {t.deployment: t.routes[0] for t in reply.targets if t.routes}


def test_three_hosts_learn_deliver_by_host_and_survive_losing_one():
    netns_hosts.require()
    started = time.monotonic()
    # Outside /tmp: every host has its own /tmp, and all must see the state dir (as a shared volume).
    state_dir = Path(tempfile.mkdtemp(prefix="looprl-3hosts-", dir="/var/tmp"))
    try:
        _run_on_three_hosts(state_dir, started)
    except BaseException:
        # What the services said is the only trace of what went wrong on the hosts.
        for log in [*sorted((state_dir / "logs").glob("*.log")), state_dir / "up.log"]:
            if log.exists():
                print(f"==== {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _run_on_three_hosts(state_dir: Path, started: float) -> None:
    with netns_hosts.namespace_hosts(3) as hosts:
        with stack_on_hosts(hosts, state_dir, recipe(), RESOURCES) as stack:
            print(f"stack up on 3 hosts in {time.monotonic() - started:.1f}s")
            host_of_ip = {hosts[i].address: f"host{i}" for i in (1, 2, 3)}
            run_id = "three-hosts"
            stack.stub.CreateRun(
                gateway_pb2.CreateRunRequest(recipe_toml=recipe(), run_id=run_id), metadata=stack.metadata
            )
            where: dict[str, weightsync_pb2.DeliveryRoute] = {}
            killed_at = gone_after = resumed_after = None
            step_at_kill = -1
            step_times: dict[int, float] = {}
            deadline = time.monotonic() + 420
            while True:
                run = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run
                now = time.monotonic()
                step_times.setdefault(run.step, now)
                if run.state not in (gateway_pb2.RUN_STATE_PENDING, gateway_pb2.RUN_STATE_RUNNING):
                    break
                assert now < deadline, f"run not done after 420s at step {run.step}: {run}"
                if len(where) < len(PLACEMENT):
                    where = routes(stack)  # read while every host is there
                if killed_at is None and run.step >= KILL_AT_STEP:
                    assert len(where) == len(PLACEMENT), f"not every deployment was delivered to: {where}"
                    hosts.kill_host(3)
                    killed_at, step_at_kill = time.monotonic(), run.step
                    print(f"host 3 killed at step {run.step}")
                if killed_at is not None:
                    if gone_after is None and not replicas(stack)["far-r0"].healthy:
                        gone_after = time.monotonic() - killed_at
                    if resumed_after is None and run.step > step_at_kill + 1:
                        resumed_after = time.monotonic() - killed_at
                time.sleep(0.2)
            final = stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run
            after_run = replicas(stack)
            metric = delivered_bytes(
                f"http://{stack.state.host}:{stack.state.service('weight-sync').metrics_port}/metrics"
            )
            trainer_log = stack.log("trainer")

        elapsed = time.monotonic() - started
        rewards = [h.reward_mean for h in final.history]
        print("reward per step:", " ".join(f"{r:.3f}" for r in rewards))
        print(
            f"published {final.episodes_published}, trained {final.rollouts_trained}, "
            f"dropped {dict(final.rollouts_dropped)}, duplicates {final.duplicate_deliveries}"
        )
        host_of_id = {r.host_id: host_of_ip[r.address.rsplit(":", 1)[0]] for r in where.values()}
        for name, route in sorted(where.items()):
            print(
                f"{name:5s} replica on {host_of_ip[route.address.rsplit(':', 1)[0]]}: {route.transport:4s} "
                f"({route.reason})"
            )
        for (transport, host_id), value in sorted(metric.items()):
            print(
                f"looprl_weight_sync_delivered_bytes_total{{transport={transport}, "
                f"host={host_of_id.get(host_id, host_id)}}} {value:.0f}"
            )
        print(
            f"host 3 lost at step {step_at_kill}: its replica reported gone after "
            f"{gone_after if gone_after is None else f'{gone_after:.1f}s'}, training past the step "
            f"after {resumed_after if resumed_after is None else f'{resumed_after:.1f}s'}"
        )
        # The cost of the loss: the slowest step after it, against a typical step before it.
        gaps = {k: step_times[k] - step_times[k - 1] for k in sorted(step_times) if k - 1 in step_times}
        before = sorted(v for k, v in gaps.items() if 1 < k <= step_at_kill)
        after = [v for k, v in gaps.items() if k > step_at_kill]
        print(
            f"recovery: slowest step after the loss {max(after):.1f}s, "
            f"median step before it {before[len(before) // 2]:.1f}s"
        )
        print(f"test runtime {elapsed:.0f}s")

        assert final.state == gateway_pb2.RUN_STATE_COMPLETED, f"run ended {final.state}: {final.error}"
        assert_accounting(final)
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        print(f"mean reward: first 10 steps {first:.3f}, last 10 {last:.3f}")
        assert last > first + LEARNING_MARGIN, (
            f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
        )
        # Placement: each deployment's replica on its host, the trainer ranks on hosts 1 and 2.
        assert {n: host_of_ip[r.address.rsplit(":", 1)[0]] for n, r in where.items()} == {
            f"{n}-r0": f"host{h}" for n, h in PLACEMENT.items()
        }
        nodes = re.search(r"ranks up, \d+ parameters, on nodes ([^\"]+)", trainer_log)
        assert nodes, "the trainer did not log where its ranks run"
        rank_hosts = [host_of_ip.get(ip.strip(), ip) for ip in nodes.group(1).split(",")]
        print("trainer ranks on:", ", ".join(rank_hosts))
        assert sorted(rank_hosts) == ["host1", "host2"], rank_hosts
        # Transports: shared memory within host 1 only, gRPC to every replica on another host.
        assert where["near-r0"].transport == "shm", where["near-r0"]
        assert where["mid-r0"].transport == "grpc" and where["far-r0"].transport == "grpc", where
        ids = {f"host{h}": where[f"{n}-r0"].host_id for n, h in PLACEMENT.items()}
        assert metric.get(("shm", ids["host1"]), 0) > 0, metric
        assert metric.get(("grpc", ids["host2"]), 0) > 0, metric
        assert metric.get(("grpc", ids["host3"]), 0) > 0, metric
        assert not [k for k in metric if k[0] == "shm" and k[1] != ids["host1"] and metric[k] > 0], metric
        # Host 3's loss: its replica reported gone, the others kept serving the newest versions.
        assert gone_after is not None and not after_run["far-r0"].healthy, after_run
        assert after_run["near-r0"].healthy and after_run["mid-r0"].healthy, after_run
        assert resumed_after is not None, "no step completed after host 3 was killed"
        assert max(after) < MAX_RECOVERY_S, f"a step took {max(after):.1f}s after host 3 was lost"
    left = hosts.leftovers()
    assert left == {"namespaces": [], "interfaces": [], "processes": []}, left
