"""CreateRun refuses, before a run record exists, what could never train: a recipe no deployment can
serve, an HTTP body whose fields are of the wrong type or unknown, and model directories it may not
use, these last in one and the same words whether the path is missing, forbidden or of the wrong
kind (an answer per case would map the gateway host's file system for any tenant)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.admission import Peers, admit
from gateway.auth import TokenAuth
from gateway.config import tokens_tenant
from gateway.http import HttpApi
from gateway.servicer import RunManager
from looprl.inference.v1 import inference_pb2
from services.kit.config.recipe import RecipeError, parse_recipe
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument
from tests.unit.gateway.test_queue import MemoryStore

TOKEN = "secret"


def manager(tmp_path: Path, path_roots: tuple[Path, ...] = ()) -> tuple[RunManager, MemoryStore]:
    store = MemoryStore()
    return RunManager(None, store, tmp_path, path_roots=path_roots), store  # type: ignore[arg-type]


def refusal(runs: RunManager, recipe: str) -> str:
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(runs.create(recipe, "", tokens_tenant()))
    return err.value.message


def test_a_recipe_whose_turn_fits_in_no_deployment_is_refused_naming_sampling_max_tokens(tmp_path) -> None:
    runs, store = manager(tmp_path)
    # Every request of this run would be refused by the router (prompt + max_tokens > max_model_len),
    # and the run would sit at step 0 for ever.
    message = refusal(runs, "[sampling]\nmax_tokens = 512\n")  # the default deployment: 512 tokens
    assert message.startswith("recipe_toml: sampling.max_tokens: 512 tokens per turn leave no room")
    assert "the longest max_model_len is 512" in message
    two = "[sampling]\nmax_tokens = 300\n[[deployments]]\nname = 'a'\nmax_model_len = 256\n"
    two += "[[deployments]]\nname = 'b'\nmax_model_len = 300\n"
    assert "the longest max_model_len is 300" in refusal(runs, two)
    assert not store.records
    assert parse_recipe("[sampling]\nmax_tokens = 511\n").sampling.max_tokens == 511


class StaticRouter:
    """A router that serves only its configured deployments (one of 64 tokens)."""

    async def ListDeployments(self, request, timeout=None):
        return inference_pb2.ListDeploymentsResponse(
            deployments=[
                inference_pb2.DeploymentInfo(
                    name="short", max_model_len=64, replicas=[inference_pb2.ReplicaInfo(name="short-r0")]
                )
            ],
            starts_run_deployments=False,
        )


def test_a_stack_whose_configured_deployments_cannot_hold_a_turn_refuses_the_run(tmp_path) -> None:
    recipe = parse_recipe("[sampling]\nmax_tokens = 64\n[[deployments]]\nname = 'short'\n")
    with pytest.raises(FailedPrecondition) as err:
        asyncio.run(admit(recipe, Peers(router=StaticRouter()), tmp_path))  # type: ignore[arg-type]
    assert err.value.message.startswith("sampling.max_tokens: 64 tokens per turn leave no room")
    fits = parse_recipe("[sampling]\nmax_tokens = 60\n[[deployments]]\nname = 'short'\n")
    assert asyncio.run(admit(fits, Peers(router=StaticRouter()), tmp_path)) is True  # type: ignore[arg-type]


def post_runs(runs: RunManager, bodies: list[object]) -> list[tuple[int, dict]]:
    app = HttpApi(runs, TokenAuth([TOKEN]), None, None).app()  # type: ignore[arg-type]

    async def drive() -> list[tuple[int, dict]]:
        out = []
        async with TestClient(TestServer(app)) as client:
            for body in bodies:
                reply = await client.post(
                    "/v1/runs", data=json.dumps(body), headers={"Authorization": f"Bearer {TOKEN}"}
                )
                out.append((reply.status, await reply.json()))
        return out

    return asyncio.run(drive())


def test_the_http_create_run_body_with_a_wrong_type_or_an_unknown_field_is_a_400_naming_it(tmp_path) -> None:
    runs, store = manager(tmp_path)
    cases = [
        ({"recipe_toml": "[run]\nsteps = 2\n", "run_id": 7}, "run_id", "run_id: must be a string, got 7"),
        ({"recipe_toml": "[run]\nsteps = 2\n", "run_id": True}, "run_id", "run_id: must be a string"),
        ({"recipe_toml": "[run]\nsteps = 2\n", "runid": "x"}, "runid", "runid: unknown field"),
        ({"recipe": "[run]\nsteps = 2\n"}, "recipe", "recipe: unknown field"),
        ({"recipe_toml": {"run": {"steps": 2}}}, "recipe_toml", "recipe_toml: must be a string"),
        ({"recipe_toml": ["[run]"]}, "recipe_toml", "recipe_toml: must be a string"),
        ({"recipe_toml": "", "run_id": "r"}, "recipe_toml", "recipe_toml: required string"),
    ]
    replies = post_runs(runs, [body for body, _, _ in cases])
    for (body, param, text), (status, reply) in zip(cases, replies, strict=True):
        assert status == 400, (body, reply)
        error = reply["error"]
        assert (status, error["param"]) == (400, param), (body, reply)
        assert error["message"].startswith(text), (body, error)
    assert not store.records


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 64}))
    return path


def test_model_paths_get_one_answer_whether_missing_forbidden_or_not_a_model(tmp_path) -> None:
    allowed = tmp_path / "models"
    usable = model_dir(allowed / "tiny")
    outside = model_dir(tmp_path / "elsewhere" / "tiny")  # a real model, outside the allowed directory
    (allowed / "empty").mkdir()

    def answers(runs: RunManager, field: str, paths: dict[str, Path]) -> dict[str, str]:
        return {
            name: refusal(runs, f'[model]\n{field} = "{path}"\n').replace(str(path), "<path>")
            for name, path in paths.items()
        }

    anywhere, store = manager(tmp_path)
    cases = {"missing": allowed / "nope", "not a model": allowed / "empty", "a file": usable / "config.json"}
    said = answers(anywhere, "path", cases)
    assert len(set(said.values())) == 1, said
    assert next(iter(said.values())).startswith("recipe_toml: model.path: '<path>' is not a model directory")
    said = answers(anywhere, "tokenizer", {"missing": allowed / "nope", "no tokenizer": usable})
    assert len(set(said.values())) == 1, said
    # Confined to `allowed`: a real model outside it, or reached through "..", gets the same answer.
    confined, _ = manager(tmp_path, path_roots=(allowed,))
    cases |= {"outside": outside, "escaping": allowed / ".." / "elsewhere" / "tiny"}
    said = answers(confined, "path", cases)
    assert len(set(said.values())) == 1, said
    assert not store.records
    # An allowed model directory passes this check (the vocabulary check that follows is its own).
    parse_recipe(f'[model]\npath = "{usable}"\n', path_roots=(allowed,))
    with pytest.raises(RecipeError):
        parse_recipe(f'[model]\npath = "{outside}"\n', path_roots=(allowed,))
