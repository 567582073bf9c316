"""CreateRun's load of a run's task code and data, as a recipe's author sees it: a dataset path the
environment-sandbox may not read is refused with one message whether or not the file exists on the
gateway's host, naming the path as the recipe gave it (never the gateway's directory)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from gateway.task_code import load_task_code
from services.environment_sandbox.config import SandboxConfig
from services.environment_sandbox.run_dataset import DatasetCache
from services.environment_sandbox.sandbox import SandboxPool
from services.environment_sandbox.servicer import EnvironmentSandboxServicer
from services.kit.errors import InvalidArgument, ServiceError
from services.kit.recipe import parse_recipe


class _Sandbox:
    """The real servicer behind a client stub's face: its refusals arrive as gRPC errors."""

    def __init__(self, servicer: EnvironmentSandboxServicer) -> None:
        self.servicer = servicer

    async def LoadEnvironment(self, request, timeout=None):
        try:
            return await self.servicer.LoadEnvironment(request, None)
        except ServiceError as exc:
            raise grpc.aio.AioRpcError(exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), str(exc)) from None


RECIPE = """
[environment]
name = "single_turn"

[dataset]
path = "{path}"
"""


async def test_a_dataset_outside_the_data_directories_is_refused_alike_existing_or_not(
    tmp_path: Path,
) -> None:
    gateway_dir, data_dir = tmp_path / "gateway", tmp_path / "data"
    gateway_dir.mkdir()
    data_dir.mkdir()
    (gateway_dir / "private.jsonl").write_text('{"prompt": "the gateway host\'s file"}\n')
    (data_dir / "ok.jsonl").write_text('{"prompt": "1", "answer": "1"}\n{"prompt": "2", "answer": "2"}\n')
    sandbox = _Sandbox(
        EnvironmentSandboxServicer(
            SandboxPool(SandboxConfig()), None, datasets=DatasetCache(data_dirs=(data_dir,))
        )
    )
    peers = SimpleNamespace(sandbox=sandbox, reward=None)
    answers = []
    for given in ("private.jsonl", "missing.jsonl"):
        recipe = parse_recipe(RECIPE.format(path=given))
        with pytest.raises(InvalidArgument) as caught:
            await load_task_code(recipe, peers, gateway_dir)
        answers.append(str(caught.value).replace(given, "PATH"))
    assert answers[0] == answers[1], answers
    assert (
        "'PATH' does not exist in the data directories" in answers[0] and str(gateway_dir) not in answers[0]
    )
    extra = await load_task_code(parse_recipe(RECIPE.format(path=data_dir / "ok.jsonl")), peers, gateway_dir)
    assert extra["dataset"]["rows"] == 2
