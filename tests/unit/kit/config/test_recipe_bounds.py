"""Recipe bounds: every number has a range, the cluster's limits come from one place (RecipeLimits,
set by the gateway's configuration), and an oversized recipe is refused before it is parsed."""

from __future__ import annotations

import typing
from dataclasses import dataclass

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from gateway.config import GatewayConfig
from services.kit.config.limits import CEILINGS, INT32_MAX, INT64_MAX, RecipeLimits
from services.kit.config.recipe import AtMost, Recipe, RecipeError, RunRecord, parse_recipe
from services.kit.config.service import ConfigError, load_config


@dataclass(frozen=True)
class Bounds:
    low: float | None = None
    low_exclusive: bool = False
    high: float | None = None
    high_exclusive: bool = False
    limit: str = ""  # the RecipeLimits field that is the upper bound

    @property
    def largest(self) -> float:
        return getattr(RecipeLimits(), self.limit) if self.limit else self.high  # type: ignore[return-value]


def _bounds_of(metadata: list) -> Bounds:
    found: dict = {}
    for item in metadata:
        if isinstance(item, Ge | Gt):
            found.update(
                low=getattr(item, "ge", getattr(item, "gt", None)), low_exclusive=isinstance(item, Gt)
            )
        elif isinstance(item, Le | Lt):
            found.update(
                high=getattr(item, "le", getattr(item, "lt", None)), high_exclusive=isinstance(item, Lt)
            )
        elif isinstance(item, AtMost):
            found.update(limit=item.limit)
    return Bounds(**found)


def _numbers(model: type[BaseModel], prefix: str = "") -> dict[str, tuple[type, Bounds]]:
    """field path (`name[]`: each element of a list) -> (int or float, its bounds), from the schema."""
    out: dict[str, tuple[type, Bounds]] = {}
    for name, info in model.model_fields.items():
        tp, path = info.annotation, f"{prefix}{name}"
        element = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out |= _numbers(tp, path + ".")
        elif isinstance(element, type) and issubclass(element, BaseModel):
            out |= _numbers(element, path + "[].")
        elif tp in (int, float) and not isinstance(info.default, bool):
            out[path] = (tp, _bounds_of(info.metadata))
        elif typing.get_origin(element) is typing.Annotated:
            base, *meta = typing.get_args(element)
            out[path + "[]"] = (base, _bounds_of([m for f in meta for m in f.metadata]))
    return out


NUMBERS = _numbers(Recipe)


def _toml(field_path: str, value: object) -> str:
    """A recipe setting one numeric field (`deployments[]`: in one deployment)."""
    literal = repr(value)
    section, name = field_path.split(".")
    if section == "deployments[]":
        return f"[[deployments]]\n{name} = {literal}\n"
    if name == "betas[]":
        return f"[optimizer]\nbetas = [{literal}, 0.99]\n"
    return f"[{section}]\n{name} = {literal}\n"


def _path(field_path: str) -> str:
    return field_path.replace("deployments[]", "deployments[0]").replace("betas[]", "betas[0]")


def _refusal(text: str, limits: RecipeLimits | None = None) -> str:
    with pytest.raises(RecipeError) as err:
        parse_recipe(text, limits=limits)
    return str(err.value)


@pytest.mark.parametrize("field_path", sorted(NUMBERS))
def test_every_bounded_field_refuses_a_value_above_its_largest(field_path: str) -> None:
    kind, bounds = NUMBERS[field_path]
    largest = bounds.largest
    too_big = largest + 1 if kind is int else largest * 2 + 1.0
    message = _refusal(_toml(field_path, too_big))
    op = "<" if bounds.high_exclusive and not bounds.limit else "<="
    assert message.startswith(f"{_path(field_path)}: must be {op} {largest}"), message
    if bounds.limit:
        assert f"this cluster's {bounds.limit}" in message


@pytest.mark.parametrize("field_path", sorted(NUMBERS))
def test_every_bounded_field_refuses_a_value_below_its_smallest(field_path: str) -> None:
    kind, bounds = NUMBERS[field_path]
    if bounds.low_exclusive:
        below, expected = bounds.low, f"must be > {bounds.low}"
    else:
        below, expected = bounds.low - 1, f"must be >= {bounds.low}"  # type: ignore[operator]
    message = _refusal(_toml(field_path, kind(below)))
    assert message.startswith(f"{_path(field_path)}: {expected}"), message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[run]\nsteps = 18446744073709551616\n", "run.steps: must be <= 1000000 (this cluster's max_steps)"),
        ("[run]\nseed = 1180591620717411303424\n", f"run.seed: must be <= {INT64_MAX}"),
        ("[batch]\nrollouts_per_step = 8000000\n", "batch.rollouts_per_step: must be <= 65536"),
        ("[sampling]\nmax_tokens = 1000000000000\n", "sampling.max_tokens: must be <= 131072"),
        ("[sampling]\ntop_k = -1\n", "sampling.top_k: must be >= 0"),
        ("[sampling]\ntemperature = inf\n", "sampling.temperature: must be a finite number"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr: must be a finite number"),
        ("[trainer]\nworld_size = 100000\n", "trainer.world_size: must be <= 1024"),
        (
            "[[deployments]]\nname = 'a'\n[[deployments]]\nname = 'b'\nreplicas = 1000000\n",
            "deployments[1].replicas",
        ),
        (
            "[[deployments]]\nmax_model_len = 1099511627776\n",
            "deployments[0].max_model_len: must be <= 1048576",
        ),
    ],
)
def test_out_of_range_values_name_the_field_and_the_bound(text: str, message: str) -> None:
    assert _refusal(text).startswith(message)


def test_too_many_deployments_are_refused() -> None:
    text = "".join(f"[[deployments]]\nname = 'd{i}'\n" for i in range(65))
    assert _refusal(text).startswith(
        "deployments: must be at most 64 (this cluster's max_deployments), got 65"
    )


def test_a_two_megabyte_recipe_is_refused_before_parsing() -> None:
    text = "[environment.config]\nblob = '" + "x" * 2_000_000 + "'\n"
    assert _refusal(text) == f"recipe: {len(text)} bytes, more than this cluster's max_recipe_bytes (262144)"
    # Under the limit the same kind of recipe is fine.
    assert parse_recipe("[environment.config]\nblob = '" + "x" * 1000 + "'\n").environment.config["blob"]


def test_the_values_at_the_limits_are_accepted() -> None:
    recipe = parse_recipe(
        "[run]\nsteps = 1000000\nseed = 9223372036854775807\n[batch]\nrollouts_per_step = 65536\n"
        f"group_size = 256\n[sampling]\nmax_tokens = 131072\ntop_k = {INT32_MAX}\n[trainer]\nworld_size = 1024\n"
        "[[deployments]]\nmax_model_len = 1048576\n"
    )
    assert (recipe.run.steps, recipe.batch.rollouts_per_step, recipe.batch.group_size) == (
        1_000_000,
        65536,
        256,
    )


def test_the_gateway_configuration_sets_the_cluster_limits() -> None:
    env = {"LOOPRL_GATEWAY_RECIPE_LIMITS": '{"max_rollouts_per_step": 128, "max_world_size": 4}'}
    limits = load_config(GatewayConfig, "GATEWAY", env).recipe_limits
    assert _refusal("[batch]\nrollouts_per_step = 256\n", limits).startswith(
        "batch.rollouts_per_step: must be <= 128 (this cluster's max_rollouts_per_step), got 256"
    )
    assert _refusal("[trainer]\nworld_size = 8\n", limits).startswith("trainer.world_size: must be <= 4")
    # Raised past the default, a larger batch is admitted, and every service re-reads the admitted
    # recipe from its run record without the gateway's limits.
    wide = RecipeLimits.from_dict({"max_rollouts_per_step": 200_000})
    text = "[batch]\nrollouts_per_step = 131072\n"
    assert parse_recipe(text, limits=wide).batch.rollouts_per_step == 131072
    assert RunRecord("r", text).recipe().batch.rollouts_per_step == 131072


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_rollout_per_step": 5}, "max_rollout_per_step: unknown field (known: max_batch_size, "),
        ({"max_steps": 2**64}, f"max_steps: must be <= {CEILINGS['max_steps']}"),
        ({"max_group_size": 0}, "max_group_size: must be >= 1"),
        ({"max_group_size": 257}, "max_group_size: must be <= 256"),
        ({"max_world_size": "8"}, "max_world_size: expected an integer"),
    ],
)
def test_limits_over_their_ceiling_or_unknown_are_configuration_errors(values: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        RecipeLimits.from_dict(values)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"max_steps": 0}', "LOOPRL_GATEWAY_RECIPE_LIMITS.max_steps: must be >= 1"),
        ("[4096]", "LOOPRL_GATEWAY_RECIPE_LIMITS: expected a table"),
    ],
)
def test_a_bad_gateway_limit_is_a_configuration_error_at_start_up(raw: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(GatewayConfig, "GATEWAY", {"LOOPRL_GATEWAY_RECIPE_LIMITS": raw})
    assert str(err.value).startswith(message)


def test_every_named_limit_exists_and_is_within_its_ceiling() -> None:
    named = {bounds.limit for _, bounds in NUMBERS.values() if bounds.limit}
    defaults = RecipeLimits()
    assert named and named <= set(CEILINGS)
    assert all(getattr(defaults, name) <= CEILINGS[name] for name in CEILINGS)
    assert RecipeLimits.ceilings().max_steps == CEILINGS["max_steps"]


def test_every_number_in_a_recipe_has_bounds() -> None:
    unbounded = [path for path, (_, b) in NUMBERS.items() if b.low is None or b.largest is None]
    assert len(NUMBERS) > 40 and not unbounded


def test_ray_resources_place_replicas_and_ranks_within_bounds() -> None:
    recipe = parse_recipe(
        "[trainer]\nray_resources_per_rank = { trainer_node = 1 }\n"
        "[[deployments]]\nray_resources = { host2 = 0.5 }\n"
    )
    assert recipe.trainer.ray_resources_per_rank == {"trainer_node": 1.0}
    assert recipe.deployments[0].ray_resources == {"host2": 0.5}
    assert _refusal("[trainer]\nray_resources_per_rank = { GPU = 1 }\n").startswith(
        "trainer.ray_resources_per_rank: GPU: set by their own fields"
    )
    assert "must be >= 0.0001" in _refusal("[[deployments]]\nray_resources = { host2 = 0 }\n")
    assert "must be <= 1000000" in _refusal("[[deployments]]\nray_resources = { host2 = 1e7 }\n")
    many = ", ".join(f"r{i} = 1" for i in range(17))
    assert _refusal(f"[[deployments]]\nray_resources = {{ {many} }}\n").startswith(
        "deployments[0].ray_resources"
    )
