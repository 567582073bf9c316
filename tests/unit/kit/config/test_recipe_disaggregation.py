"""deployments[].disaggregation in a recipe: its workers are the deployment's replicas, and what it
cannot be combined with is refused naming the field."""

from __future__ import annotations

import json
import re

import pytest

from services.kit.config.limits import RecipeLimits
from services.kit.config.recipe import RecipeError, parse_recipe, recipe_toml
from services.modeling.config import ModelConfig


def _deployment(lines: str):
    return parse_recipe(f'[[deployments]]\nname = "pd"\n{lines}\n').deployments[0]


def test_a_disaggregated_deployments_replicas_are_its_prefill_and_decode_workers():
    spec = _deployment("disaggregation = { prefill_workers = 1, decode_workers = 3 }")
    assert spec.replicas == 4 and spec.disaggregation.retune and spec.disaggregation.kv_transfer == "auto"
    assert _deployment("replicas = 4\ndisaggregation = { prefill_workers = 1, decode_workers = 3 }") == spec
    assert _deployment("").disaggregation is None
    # Written back as TOML, it parses to the same recipe.
    recipe = parse_recipe('[[deployments]]\nname = "pd"\ndisaggregation = { prefill_workers = 2 }\n')
    assert parse_recipe(recipe_toml(recipe)) == recipe


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            "replicas = 2\ndisaggregation = { prefill_workers = 1, decode_workers = 3 }",
            "deployments[0].replicas: a disaggregated deployment's replicas are its 1 prefill + 3 decode workers (4)",
        ),
        (
            "tensor_parallel = 2\ndisaggregation = {}",
            "deployments[0].disaggregation: the cpu backend hands over",
        ),
        ("canary = true\ndisaggregation = {}", "deployments[0].disaggregation: not with canary"),
        ("max_loras = 2\ndisaggregation = {}", "deployments[0].disaggregation: not with LoRA adapters"),
        (
            "disaggregation = { decode_workers = 0 }",
            "deployments[0].disaggregation.decode_workers: must be >= 1",
        ),
        (
            'disaggregation = { kv_transfer = "rdma" }',
            "deployments[0].disaggregation.kv_transfer: must be one of",
        ),
        ('disaggregation = { kv_connector = "P2pNcclConnector" }', "disaggregation.kv_connector: must be"),
        ("disaggregation = { retune_min_gain = -1.0 }", "disaggregation.retune_min_gain: must be >= 0"),
        ("disaggregation = { workers = 2 }", "deployments[0].disaggregation.workers"),
    ],
)
def test_what_cannot_be_disaggregated_is_refused_naming_the_field(lines, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        _deployment(lines)


def test_the_workers_count_against_the_clusters_replica_limit():
    with pytest.raises(RecipeError, match=r"prefill_workers \+ decode_workers must be <= 4"):
        parse_recipe(
            "[[deployments]]\ndisaggregation = { prefill_workers = 3, decode_workers = 3 }\n",
            limits=RecipeLimits(max_replicas=4),
        )


def test_a_lora_run_is_not_disaggregated(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    recipe = f'[model]\npath = "{tmp_path}"\nlora = {{ rank = 8 }}\n[[deployments]]\ndisaggregation = {{}}\n'
    with pytest.raises(RecipeError, match=re.escape("deployments[0].disaggregation: not for a LoRA run")):
        parse_recipe(recipe)
