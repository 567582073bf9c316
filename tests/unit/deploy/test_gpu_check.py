"""tools/gpu_check.sh without a GPU: the recipe it runs is sized so Ray can place every GPU
request on 1, 2, 3 or 4+ GPUs (a request Ray cannot place waits forever: the check would hang
instead of failing), it runs every gpu-marked test module, and its verdict fails a run that did
not commit every version on every deployment."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from services.kit.config.recipe import parse_recipe
from tools import gpu_check_plan as plan

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _sized(gpus: int):
    raw = plan.sized_recipe(tomllib.loads(plan.RECIPE.read_text()), gpus, 20)
    text = plan.to_toml(raw)
    return raw, parse_recipe(text, base_dir=plan.RECIPE.parent)  # a recipe looprl accepts


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_every_gpu_request_of_the_sized_run_fits_the_machine_in_any_order(gpus):
    _, recipe = _sized(gpus)
    requests = plan.ray_gpu_requests(recipe)
    assert len(requests) == 3  # one trainer rank and one replica per deployment ask for GPUs
    assert plan.fits_in_any_order(requests, gpus), f"{gpus} GPU(s) cannot place {requests}"
    tps = [d.tensor_parallel for d in recipe.deployments]
    assert tps == ([1, 2] if gpus >= 3 else [1, 1])  # tp=2 wherever the GPUs allow it
    assert recipe.run.steps == 20 and recipe.trainer.world_size == 1
    # vLLM's memory shares of processes on one GPU add up to at most the GPU: each fractional
    # replica's share is its Ray request, and the trainer's Ray share leaves the rest to it
    assert all(d.gpu_memory_utilization in (0.0, d.gpus_per_replica) for d in recipe.deployments)
    assert sum(requests) <= gpus + 1e-9


def test_the_old_sizing_oversubscribed_two_and_three_gpu_machines():
    """What the script asked for before: trainer 1 GPU, tp=1 replicas a whole GPU each, and tp=2
    from three GPUs on; the placement check must see that it does not fit."""
    assert not plan.fits_in_any_order([1.0, 1, 1], 2)
    assert not plan.fits_in_any_order([1.0, 1, 2], 3)
    # fractions that each fit somewhere can still strand a whole-GPU request, depending on order
    assert plan.place([0.5, 2, 0.45], 3) is not None and plan.place([0.45, 0.5, 2], 3) is not None
    assert plan.place([0.6, 0.6, 2], 3) is None


def test_the_verdict_names_every_version_a_deployment_did_not_commit():
    log = "\n".join(
        f"INFO deployment {d} now serves version {v} (123 bytes, 0.5s)"
        for d in ("short", "long")
        for v in range(0, 21)
        if not (d == "long" and v in (7, 20))
    )
    assert plan.missing_versions(log, ["short", "long"], 20) == {"long": [7, 20]}
    assert plan.missing_versions(log, ["short"], 20) == {}
    assert plan.missing_versions("", ["short"], 2) == {"short": [1, 2]}


def test_verify_exits_non_zero_with_a_message_when_versions_are_missing(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(plan.to_toml(_sized(2)[0]))
    log = tmp_path / "weight_sync.log"
    log.write_text("deployment short now serves version 1 (1 bytes, 0.1s)\n")
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check_plan", "verify", "2", str(recipe), str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "deployment short never committed version(s) [2] of 1..2" in result.stdout
    assert "deployment long never committed version(s) [1, 2]" in result.stdout


def test_the_script_runs_every_gpu_marked_test_module_and_the_verdict():
    script = SCRIPT.read_text()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    [finder] = re.findall(r"mapfile -t GPU_TESTS < <\((.*)\)$", script, re.M)
    found = subprocess.run(["bash", "-c", finder], cwd=ROOT, capture_output=True, text=True, check=True)
    marked = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text())
    }
    assert marked and set(found.stdout.split()) == marked
    assert '"${GPU_TESTS[@]}"' in script and "-m gpu" in script
    assert "tools.gpu_check_plan recipe" in script and "tools.gpu_check_plan verify" in script
