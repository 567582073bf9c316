"""Typed env config, recipe validation and the tensor codec."""

import numpy as np
import pytest
import torch
from pydantic import Field

from services.kit.config.recipe import RecipeError, parse_recipe
from services.kit.config.service import ConfigError, ServiceConfig, load_config
from services.kit.messages.array_codec import array_to_proto
from services.kit.messages.codec import CodecError, tensor_from_proto, tensor_to_proto


class DemoConfig(ServiceConfig):
    workers: int = Field(4, ge=1)
    """number of workers"""
    ratio: float = 0.5
    """a ratio"""
    enabled: bool = False
    """a switch"""


def test_config_reads_service_then_global_variables() -> None:
    env = {
        "LOOPRL_DEMO_WORKERS": "9",
        "LOOPRL_WORKERS": "1",
        "LOOPRL_ENABLED": "yes",
        "LOOPRL_GRPC_PORT": "5000",
    }
    cfg = load_config(DemoConfig, "demo", env)
    assert (cfg.workers, cfg.enabled, cfg.grpc_port, cfg.ratio) == (9, True, 5000, 0.5)


def test_config_error_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^LOOPRL_DEMO_RATIO: expected a number, got str 'lots'$"):
        load_config(DemoConfig, "demo", {"LOOPRL_DEMO_RATIO": "lots"})
    with pytest.raises(ConfigError, match=r"^LOOPRL_WORKERS: must be >= 1, got 0$"):
        load_config(DemoConfig, "demo", {"LOOPRL_WORKERS": "0"})
    with pytest.raises(ConfigError, match=r"^LOOPRL_DEMO_LOG_LEVEL: must be one of 'DEBUG', .* got 'LOUD'$"):
        load_config(DemoConfig, "demo", {"LOOPRL_DEMO_LOG_LEVEL": "loud"})


@pytest.mark.parametrize(
    ("text", "field_path"),
    [
        ("[run]\nsteps = 0", "run.steps"),
        ("[run]\nstepz = 3", "run.stepz"),
        ("[batch]\nrollouts_per_step = 10\ngroup_size = 4", "batch.rollouts_per_step"),
        ("[model]\npath = '/definitely/not/here'", "model.path"),
        ("[[deployments]]\nname = 'a'\n[[deployments]]\nname = 'a'", "deployments[1].name"),
        ("[sampling]\ntemperature = -1.0", "sampling.temperature"),
        ("[optimizer]\nlr = 'fast'", "optimizer.lr"),
    ],
)
def test_bad_recipes_name_the_field(text: str, field_path: str) -> None:
    with pytest.raises(RecipeError) as err:
        parse_recipe(text)
    assert str(err.value).startswith(field_path + ":")


def test_recipe_defaults_and_overrides() -> None:
    recipe = parse_recipe("[batch]\nrollouts_per_step = 32\ngroup_size = 8\n[optimizer]\nlr = 1\n")
    assert recipe.groups_per_step == 4
    assert recipe.optimizer.lr == 1.0 and isinstance(recipe.optimizer.lr, float)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_codec_roundtrip(dtype: torch.dtype) -> None:
    source = (torch.arange(24) % 5).to(dtype).view(2, 3, 4)
    assert torch.equal(tensor_from_proto(tensor_to_proto(source)), source)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int64, np.bool_, np.uint8])
def test_numpy_arrays_encoded_without_torch_decode_to_the_same_values(dtype) -> None:
    source = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)[:, ::2]  # not contiguous
    decoded = tensor_from_proto(array_to_proto(source))
    assert decoded.shape == source.shape and decoded.numpy().tolist() == source.tolist()


def test_an_array_of_an_unsupported_dtype_is_refused_by_name() -> None:
    with pytest.raises(CodecError, match="unsupported dtype float64"):
        array_to_proto(np.zeros(3))


def test_codec_decodes_without_copy_and_checks_sizes() -> None:
    msg = tensor_to_proto(np.arange(6, dtype=np.int32))
    decoded = tensor_from_proto(msg)
    assert decoded.tolist() == list(range(6))
    msg.shape[:] = [7]
    with pytest.raises(CodecError, match="needs 28 bytes, got 24"):
        tensor_from_proto(msg)
