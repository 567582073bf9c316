"""The recipe sections of a user's own task: [reward], [dataset] and [eval] refuse contradictions
naming the field, the prompt limit follows the deployments, and a recipe written back as TOML
parses to the same recipe (what `looprl eval` submits)."""

from __future__ import annotations

import pytest

from services.kit.recipe import RecipeError, parse_recipe, recipe_toml


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[environment]\nreward = "digits"\n[reward]\nfunction = "r.py:score"\n',
            "reward.function: set reward.function or environment.reward, not both",
        ),
        (
            "[reward]\nconfig = { a = 1 }\n",
            "reward.config: settings of a reward plugin: set reward.function too",
        ),
        (
            '[dataset]\npath = "a.jsonl"\nsource = "t.py:make"\n',
            "dataset.source: set dataset.path or dataset.source, not both",
        ),
        ("[dataset]\neval_size = 8\n", "dataset.path: a held-out split needs a dataset"),
        (
            '[dataset]\npath = "a.jsonl"\neval_size = 8\neval_path = "b.jsonl"\n',
            "dataset.eval_size: set dataset.eval_size or dataset.eval_path, not both",
        ),
        ("[eval]\ngreedy = false\n", "eval.samples: must be > 0 when greedy = false"),
        (
            '[reward]\nfunction = "r.py:score"\nconfig = { w = nan }\n',
            "reward.config.w: must be a finite number",
        ),
    ],
)
def test_contradictions_are_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_recipe(text)


def test_the_prompt_limit_is_what_a_deployment_serves_with_room_to_answer() -> None:
    recipe = parse_recipe(
        "[sampling]\nmax_tokens = 16\n[[deployments]]\nname = 'a'\nmax_model_len = 128\n"
        "[[deployments]]\nname = 'b'\nmax_model_len = 512\nmax_prompt_tokens = 300\n"
    )
    assert recipe.max_prompt_tokens == 300
    limited = parse_recipe("[dataset]\npath = 'x.jsonl'\nmax_prompt_tokens = 50\n")
    assert limited.max_prompt_tokens == 50


def test_a_recipe_written_as_toml_parses_back_equal() -> None:
    text = (
        '[run]\nname = "x"\nsteps = 7\n[environment]\nname = "single_turn"\nconfig = { system_prompt = "be \\"brief\\"" }\n'
        '[reward]\nfunction = "r.py:score"\nconfig = { w = 0.5, tags = ["a", "b"] }\n'
        '[dataset]\npath = "d.jsonl"\neval_size = 4\n[eval]\nevery = 2\nsamples = 3\n'
        "[[deployments]]\nname = 'a'\n[[deployments]]\nname = 'b'\nray_resources = { zone = 1.5 }\n"
    )
    recipe = parse_recipe(text)
    assert parse_recipe(recipe_toml(recipe)) == recipe


def test_a_lora_recipe_written_as_toml_parses_back_equal(tmp_path) -> None:
    from services.modeling.config import ModelConfig
    from services.modeling.qwen2 import Qwen2ForCausalLM

    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(tmp_path)
    text = f'[model]\npath = "{tmp_path}"\n[model.lora]\nrank = 8\ntarget_modules = ["q_proj", "v_proj"]\n'
    recipe = parse_recipe(text)
    assert parse_recipe(recipe_toml(recipe)) == recipe
