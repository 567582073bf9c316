"""CreateRun's load of a run's task code and data, as a recipe's author sees it: a dataset path the
environment-sandbox may not read is refused with one message whether or not the file exists on the
gateway's host, naming the path as the recipe gave it (never the gateway's directory)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from gateway.task_code import load_task_code
from services.environment_sandbox.config import SandboxConfig
from services.environment_sandbox.environments import set_plugin_dirs
from services.environment_sandbox.run_dataset import DatasetCache
from services.environment_sandbox.sandbox import SandboxPool
from services.environment_sandbox.servicer import EnvironmentSandboxServicer
from services.kit.config.recipe import parse_recipe
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, ServiceError


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


class _Deadlined(_Sandbox):
    """The stub's `timeout` enforced as gRPC enforces a deadline."""

    async def LoadEnvironment(self, request, timeout=None):
        try:
            return await asyncio.wait_for(super().LoadEnvironment(request), timeout)
        except TimeoutError:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            ) from None


async def test_a_dataset_slow_to_read_is_read_past_the_import_deadline_a_hanging_import_is_held_to(
    tmp_path: Path, monkeypatch
) -> None:
    """Reading and measuring a dataset takes time in proportion to its rows (about 0.1 ms a row: a
    100k-row dataset took longer than the 8 s CreateRun gave the whole load, and was refused as "a
    hanging import?"); an import that hangs is still refused within the import deadline, naming the
    plugin. Here a task source that takes 1.5 s stands for a large dataset."""
    import gateway.task_code as task_code
    import services.environment_sandbox.servicer as sandbox_servicer

    monkeypatch.setattr(task_code, "LOAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(sandbox_servicer, "IMPORT_TIMEOUT_S", 0.3)
    (tmp_path / "rows.py").write_text(
        "import time\n\n\ndef many():\n    time.sleep(1.5)\n"
        "    return [{'prompt': f'what is {i} plus {i}?', 'answer': str(2 * i)} for i in range(1000)]\n"
    )
    (tmp_path / "slow_env.py").write_text("import time\n\ntime.sleep(3)\n")
    set_plugin_dirs((tmp_path,))
    try:
        sandbox = _Deadlined(
            EnvironmentSandboxServicer(SandboxPool(SandboxConfig()), None, datasets=DatasetCache((tmp_path,)))
        )
        peers = SimpleNamespace(sandbox=sandbox, reward=None)
        recipe = parse_recipe('[environment]\nname = "single_turn"\n[dataset]\nsource = "rows.py:many"\n')
        extra = await load_task_code(recipe, peers, tmp_path)
        assert extra["dataset"]["rows"] == 1000
        started = time.monotonic()
        with pytest.raises(FailedPrecondition, match=r"'slow_env.py:Env' did not import within 0.3s"):
            await load_task_code(parse_recipe('[environment]\nname = "slow_env.py:Env"\n'), peers, tmp_path)
        assert time.monotonic() - started < 1.0
    finally:
        set_plugin_dirs(())
