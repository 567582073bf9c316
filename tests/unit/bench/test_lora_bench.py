"""bench/lora.py's stack recipe: two LoRA runs on the default task, sharing a deployment or not."""

from __future__ import annotations

import pytest

from bench.lora import default_task, lora_recipe
from services.kit.config.recipe import parse_recipe
from services.modeling.config import ModelConfig
from services.modeling.hf_files import write_char_tokenizer
from services.modeling.qwen2 import Qwen2ForCausalLM


@pytest.mark.parametrize(
    ("deployment", "shared", "max_loras"),
    [('name = "lora"\nshared = true\nmax_loras = 2', True, 2), ('name = "lora"', False, 0)],
)
def test_the_stack_recipe_is_a_lora_run_of_the_default_task(tmp_path, deployment, shared, max_loras) -> None:
    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(tmp_path)
    write_char_tokenizer(tmp_path)
    recipe = parse_recipe(lora_recipe(tmp_path, "lora-0", 3, 7, deployment))
    assert (recipe.run.seed, recipe.run.steps) == (3, 7)
    assert recipe.model.lora is not None and recipe.model.lora.rank == 16
    task = default_task()
    assert (recipe.environment.name, dict(recipe.environment.config)) == (task["name"], task["config"])
    [d] = recipe.deployments
    assert (d.shared, d.max_loras) == (shared, max_loras)
