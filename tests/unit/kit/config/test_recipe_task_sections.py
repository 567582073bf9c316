"""The recipe sections of a user's own task: [reward], [dataset] and [eval] refuse contradictions
naming the field, the prompt limit follows the deployments, and a recipe written back as TOML
parses to the same recipe (what `looprl eval` submits)."""

from __future__ import annotations

import pytest

from services.kit.config.recipe import RecipeError, parse_recipe, recipe_toml


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


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> tuple[str, str]:
    """A base model directory, and one of another architecture (three layers)."""
    from services.modeling.config import ModelConfig
    from services.modeling.qwen2 import Qwen2ForCausalLM

    base, other = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("other")
    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(base)
    Qwen2ForCausalLM(ModelConfig.tiny(num_hidden_layers=3), seed=0).save_pretrained(other)
    return str(base), str(other)


NOT_THE_BASE = "deployments[0].model_path: is not the base model.path names (a LoRA run's adapters apply to that base only)"


@pytest.mark.parametrize(
    ("lora", "deployment", "message"),
    [
        ('target_modules = ["q_proj", "q_proj"]', "", "model.lora.target_modules: 'q_proj' is named twice"),
        ("", 'model_path = "{other}"', NOT_THE_BASE),
        ("", 'model_path = "{base}/missing"', NOT_THE_BASE),
        ("", "tensor_parallel = 2", "deployments[0].tensor_parallel: a LoRA run's adapters are served at"),
        (
            "",
            'backend = "vllm"\ntensor_parallel = 2',
            "deployments[0].tensor_parallel: a LoRA run's adapters are served at",
        ),
        ("", 'weight_transport = "shared_copy"', "deployments[0].weight_transport: shared_copy replicas"),
        ("rank = 128", "", "deployments[0].max_lora_rank: 64 is below the run's adapter rank 128"),
    ],
)
def test_a_lora_recipe_that_cannot_serve_its_adapter_is_refused_naming_the_field(
    bases: tuple[str, str], lora: str, deployment: str, message: str
) -> None:
    base, other = bases
    text = (
        f'[model]\npath = "{base}"\n[model.lora]\n{lora}\n'
        f'[[deployments]]\nname = "a"\n{deployment.format(base=base, other=other)}\n'
    )
    with pytest.raises(RecipeError) as refused:
        parse_recipe(text)
    assert message in str(refused.value)


def test_a_lora_deployment_may_name_its_base_by_another_path(bases: tuple[str, str], tmp_path) -> None:
    base, _ = bases
    (tmp_path / "link").symlink_to(base)
    recipe = parse_recipe(
        f'[model]\npath = "{base}"\n[model.lora]\n[[deployments]]\nname = "a"\nmodel_path = "{tmp_path / "link"}"\n'
    )
    assert recipe.deployments[0].model_path == str(tmp_path / "link")
    assert parse_recipe(f'[model]\npath = "{base}"\n[model.lora]\n').model.lora is not None
    with pytest.raises(RecipeError, match=r"deployments\[0\]\.max_loras: serves LoRA runs' adapters"):
        parse_recipe(f'[model]\npath = "{base}"\n[[deployments]]\nname = "a"\nshared = true\nmax_loras = 2\n')
