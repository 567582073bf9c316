"""The realistic peer shape hands TRL what looprl trains: the same tokenizer, template, weights and reward."""

from __future__ import annotations

import tomllib

import pytest
import torch

from bench.loop_harness import with_overrides
from bench.peer_trl_realistic import MODEL_DIR, RECIPE, ROOT, check_parity, math_reward
from services.kit.config.recipe import Recipe, parse_recipe
from tools.build_hf_model import build


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Recipe:
    """The realistic recipe on a small model the project's tool builds (the shape's own takes minutes)."""
    model = tmp_path_factory.mktemp("peer") / "model"
    build(model, seed=3)
    return parse_recipe(
        with_overrides(RECIPE.read_text(), model={"path": str(model), "tokenizer": str(model)})
    )


def test_loaders_agree_on_a_built_model(recipe: Recipe) -> None:
    check_parity(recipe)  # raises on any difference in token ids, template ids or logits


def test_parity_check_catches_other_weights(recipe: Recipe, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    def nudged(r: Recipe):
        model = AutoModelForCausalLM.from_pretrained(r.model.path, dtype=torch.float32)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.add_(0.01)
        return model

    monkeypatch.setattr("bench.peer_trl_realistic.trl_model", nudged)
    with pytest.raises(AssertionError, match="logits"):
        check_parity(recipe)


def test_math_reward_is_the_stacks_math_reward() -> None:
    completions = [
        [{"role": "assistant", "content": "Ann has 13 + 41 = 54 apples. 54 - 2 = 52.\n#### 52"}],
        [{"role": "assistant", "content": "Ann has 13 + 41 = 54 apples.\n#### 53"}],
        [{"role": "assistant", "content": "so the answer is 52"}],
        [{"role": "assistant", "content": "no number"}],
    ]
    assert math_reward(completions, answer=["52", "52", "52", "52"]) == [1.0, 0.0, 1.0, 0.0]


def test_the_shape_recipe_is_looprl_valid_and_maps_onto_trl(recipe: Recipe) -> None:
    assert recipe.environment.name == "math"
    # The settings shared/peer-trl-mapping.md maps onto GRPOTrainer.
    assert recipe.algorithm.advantage == "dr_grpo" and recipe.algorithm.loss_aggregation == "token-mean"
    assert recipe.run.max_staleness == 0  # TRL's side; looprl's best configuration is an override
    # `make run RECIPE=configs/math_10m_grpo.toml` finds the model the bench builds.
    model = tomllib.loads(RECIPE.read_text())["model"]
    assert ROOT / model["path"] == ROOT / model["tokenizer"] == MODEL_DIR


def test_the_model_is_built_once_and_again_when_its_architecture_or_warm_start_changes(
    tmp_path, monkeypatch
) -> None:
    import bench.peer_trl_realistic as shape

    builds = []
    monkeypatch.setattr(shape, "MODEL_DIR", tmp_path / "model")
    monkeypatch.setattr(
        "tools.build_hf_model.build", lambda out, **kw: builds.append(kw) or out.mkdir(exist_ok=True)
    )
    monkeypatch.setattr(shape, "ENVIRONMENT_WARM_START_TASKS", 4)
    shape.ensure_model()
    shape.ensure_model()
    assert len(builds) == 1
    assert [target for _, target in builds[0]["sft_examples"]] == [
        target for _, target in shape.warm_start_examples()
    ]
    assert all("####" in target for _, target in builds[0]["sft_examples"])  # worked solutions
    monkeypatch.setattr(shape, "WARM_START_STEPS", shape.WARM_START_STEPS + 1)
    shape.ensure_model()
    assert len(builds) == 2
    monkeypatch.setattr(
        shape, "MODEL", shape.MODEL.replace(num_hidden_layers=shape.MODEL.num_hidden_layers + 1)
    )
    shape.ensure_model()
    assert len(builds) == 3 and builds[2]["num_layers"] == shape.MODEL.num_hidden_layers
