"""The GPU recipe's Ray resource requests, without GPUs or Ray: the trainer ranks' placement-group
bundles and actor options, and each vLLM replica's actor options, are computed from the recipe by
the same pure functions RankGroup.start and DeploymentManager.start hand Ray."""

from __future__ import annotations

import json
from pathlib import Path

from services.inference_router.config import RouterConfig
from services.inference_router.deployments import replica_actor_options
from services.kit.config.recipe import Recipe, parse_recipe
from services.modeling.config import ModelConfig
from services.modeling.tokenizer import CharTokenizer
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunTrainer

GPU_RECIPE = Path(__file__).resolve().parents[3] / "configs" / "gpu_vllm_gsm8k.toml"


def load_gpu_recipe(model_dir: Path) -> Recipe:
    """The GPU recipe as shipped, its model directory (absent on CPU machines) swapped for one
    holding a tiny config and tokenizer: only the checkpoint differs, and no resource request
    reads it."""
    (model_dir / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    CharTokenizer().save_pretrained(model_dir)
    text = GPU_RECIPE.read_text().replace("/models/Qwen2.5-0.5B-Instruct", str(model_dir))
    return parse_recipe(text, base_dir=GPU_RECIPE.parent)


def test_trainer_ranks_ask_ray_for_the_recipes_gpus_in_their_bundles(tmp_path):
    recipe = load_gpu_recipe(tmp_path)
    assert recipe.trainer.num_gpus_per_rank == 1.0
    group = RunTrainer("gpu-run", recipe, TrainerConfig()).group
    # every rank's bundle reserves the GPU and the rank's actor takes it from its bundle: a bundle
    # without it would let two ranks land on one GPU, an actor without it would see no GPU at all
    assert group.world_size == 2 and group.bundle()["GPU"] == 1.0
    assert group.worker_options()["num_gpus"] == 1.0
    assert group.worker_options()["num_cpus"] == group.bundle()["CPU"]


def test_cpu_recipes_reserve_no_gpus_for_trainer_ranks(tmp_path):
    recipe = load_gpu_recipe(tmp_path)
    recipe.trainer.num_gpus_per_rank = 0.0
    group = RunTrainer("cpu-run", recipe, TrainerConfig()).group
    assert "GPU" not in group.bundle() and group.worker_options()["num_gpus"] == 0.0


def test_vllm_replicas_ask_ray_for_one_gpu_per_tensor_parallel_rank(tmp_path):
    recipe = load_gpu_recipe(tmp_path)
    config = RouterConfig()
    asked = {
        (spec.name, index): replica_actor_options(spec, config, index)["num_gpus"]
        for spec in recipe.deployments
        for index in range(spec.replicas)
    }
    assert asked == {("short", 0): 1, ("short", 1): 1, ("long", 0): 2}
    options = replica_actor_options(recipe.deployments[1], config, 0)
    assert options["name"] == "long/0" and options["max_restarts"] == -1
