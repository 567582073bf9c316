"""A run's demand on the cluster, from its recipe, held against its tenant's quota and the cluster's
total: a run over either is refused naming the resource and the numbers; a tenant at its concurrent
runs has its next run wait, naming the quota."""

from __future__ import annotations

import pytest

from gateway.admission import check_cluster, check_quota, concurrency_reason, run_demand
from gateway.config import Tenant, token_sha256
from services.kit.config.recipe import parse_recipe
from services.kit.rpc.errors import ResourceExhausted


def team(max_gpus: float = 4, max_cpus: float = 16, runs: int = 2) -> Tenant:
    return Tenant(
        name="team-a",
        token_sha256=token_sha256("t"),
        max_concurrent_runs=runs,
        max_cpus=max_cpus,
        max_gpus=max_gpus,
    )


GPU_RUN = """
[trainer]
world_size = {world}
num_gpus_per_rank = 1.0
[[deployments]]
name = "fast"
backend = "vllm"
replicas = 2
tensor_parallel = 2
[[deployments]]
name = "shared"
backend = "vllm"
replicas = 3
gpu_memory_utilization = 0.5
"""


def test_demand_counts_trainer_ranks_and_every_replica_as_the_services_ask_ray() -> None:
    demand = run_demand(parse_recipe(GPU_RUN.format(world=2)))
    assert [(p.name, p.cpus, p.gpus) for p in demand.parts] == [
        ("trainer", 1.0, 2.0),
        ("deployments[0] 'fast'", 2.0, 4.0),  # 2 replicas x tp 2, one GPU per TP rank
        ("deployments[1] 'shared'", 3.0, 1.5),  # 3 replicas x a 0.5 share of one GPU
    ]
    assert (demand.cpus, demand.gpus) == (6.0, 7.5)
    cpu_tp = parse_recipe(
        "[trainer]\nworld_size = 4\nnum_cpus_per_rank = 0.25\n"
        "[[deployments]]\nreplicas = 2\ntensor_parallel = 3\nnum_cpus = 0.5\n"
    )
    demand = run_demand(cpu_tp)
    # cpu backend: each replica's actor plus one CPU per TP worker (ranks 1..tp-1), no GPU.
    assert (demand.cpus, demand.gpus) == (4 * 0.25 + 2 * (0.5 + 2), 0.0)


def test_a_part_over_the_gpu_quota_is_refused_naming_it_and_the_numbers() -> None:
    demand = run_demand(parse_recipe(GPU_RUN.format(world=8)))
    with pytest.raises(ResourceExhausted) as err:
        check_quota(demand, team(max_gpus=4))
    assert err.value.message == (
        "trainer: 8 GPUs (world_size 8 x num_gpus_per_rank 1.0) exceed tenant 'team-a' quota max_gpus=4"
    )


def test_a_run_over_the_quota_only_in_total_is_refused_with_its_parts() -> None:
    demand = run_demand(parse_recipe(GPU_RUN.format(world=1)))
    with pytest.raises(ResourceExhausted) as err:
        check_quota(demand, team(max_gpus=4))
    assert err.value.message == (
        "run: 6.5 GPUs (trainer 1 + deployments[0] 'fast' 4 + deployments[1] 'shared' 1.5) exceed "
        "tenant 'team-a' quota max_gpus=4"
    )
    with pytest.raises(ResourceExhausted, match=r"^deployments\[0\] 'default': 3 CPUs \(replicas 3 x 1 CPUs"):
        check_quota(run_demand(parse_recipe("[[deployments]]\nreplicas = 3\n")), team(max_cpus=2))


def test_a_run_within_the_quota_is_admitted() -> None:
    demand = run_demand(parse_recipe(GPU_RUN.format(world=1)))
    check_quota(demand, team(max_gpus=6.5, max_cpus=6.5))
    check_quota(run_demand(parse_recipe("")), team(max_gpus=0, max_cpus=2))  # default recipe: 2 CPUs


def test_a_tenant_at_its_concurrent_runs_waits_naming_the_quota() -> None:
    assert concurrency_reason(team(runs=2), active_runs=1) == ""
    assert concurrency_reason(team(runs=2), active_runs=2) == (
        "max_concurrent_runs: tenant 'team-a' has 2 active runs, its quota max_concurrent_runs=2"
    )


def test_a_run_over_the_clusters_total_is_refused_naming_the_resource_and_both_numbers() -> None:
    demand = run_demand(parse_recipe(GPU_RUN.format(world=2)))  # 2 + 4 + 1.5 GPUs
    check_cluster(demand, {"CPU": 64, "GPU": 8})
    with pytest.raises(ResourceExhausted) as err:
        check_cluster(demand, {"CPU": 64, "GPU": 4})
    assert err.value.message == (
        "run: needs 7.5 GPU (trainer 2 + deployments[0] 'fast' 4 + deployments[1] 'shared' 1.5), more than "
        "the cluster's total GPU=4: it could never start"
    )


def test_custom_resources_count_per_rank_and_per_replica_and_a_cluster_without_them_refuses() -> None:
    recipe = parse_recipe(
        "[trainer]\nworld_size = 2\nray_resources_per_rank = { trainer_node = 1 }\n"
        '[[deployments]]\nname = "d"\nreplicas = 3\nray_resources = { zone_b = 0.5 }\n'
    )
    demand = run_demand(recipe)
    assert demand.resources()["trainer_node"] == 2 and demand.resources()["zone_b"] == 1.5
    with pytest.raises(ResourceExhausted, match=r"needs 1.5 zone_b .*the cluster's total zone_b=0:"):
        check_cluster(demand, {"CPU": 64, "trainer_node": 2})
