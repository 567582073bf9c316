"""EnvironmentSandboxService over gRPC: RunEpisode, Reset/Step sessions, Exec, ListEnvironments,
LoadEnvironment (a run's environment, plugin or built in, and its dataset, before its first episode)."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import uuid
from collections import OrderedDict
from typing import Any

import grpc

from looprl.environment.v1 import environment_pb2, environment_pb2_grpc
from services.environment_sandbox.agent_loop import EpisodeRunner
from services.environment_sandbox.clients import CURRENT_RUN
from services.environment_sandbox.environments import (
    EnvContext,
    Environment,
    EnvironmentError_,
    PluginFailure,
    UnknownEnvironment,
    environment_class,
    environment_names,
    make_environment,
    parse_task,
    plugin_code,
    plugin_of,
)
from services.environment_sandbox.environments.base import parse_config
from services.environment_sandbox.run_dataset import DatasetCache
from services.environment_sandbox.sandbox import ExecJob, SandboxPool
from services.environment_sandbox.sandbox.fleet import SandboxFleet
from services.environment_sandbox.sandbox.job import (
    InvalidJob,
    SandboxError,
    SandboxUnavailable,
    validate_files,
)
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable
from services.kit.usercode import plugins
from services.modeling.tokenizer import TokenizerCache

# A plugin environment that does not import in this long is refused (LoadEnvironment), within the
# gateway's deadline for the whole load without a dataset (gateway/task_code.py LOAD_TIMEOUT_S, 8 s),
# so that the refusal names the plugin.
IMPORT_TIMEOUT_S = 6.0


def _status(exc: EnvironmentError_) -> Exception:
    if isinstance(exc, UnknownEnvironment):
        return NotFound(str(exc))
    if isinstance(exc, PluginFailure):
        return FailedPrecondition(str(exc))
    return InvalidArgument(str(exc))


class EnvironmentSandboxServicer(environment_pb2_grpc.EnvironmentSandboxServiceServicer):
    def __init__(
        self,
        pool: SandboxPool | SandboxFleet,
        runner: EpisodeRunner | None,
        max_sessions: int = 4096,
        max_code_bytes: int = 1 << 20,
        datasets: DatasetCache | None = None,
        tokenizers: TokenizerCache | None = None,
    ) -> None:
        self.pool = pool
        self.runner = runner
        self.datasets = datasets or (runner.datasets if runner is not None else DatasetCache())
        self.tokenizers = tokenizers or (runner.tokenizers if runner is not None else TokenizerCache())
        self.context = EnvContext(executor=pool.run_code, workspaces=pool.workspaces)
        self.sessions: OrderedDict[str, Environment] = OrderedDict()
        self.max_sessions = max_sessions
        self.max_code_bytes = max_code_bytes

    async def RunEpisode(self, request, context: Any) -> environment_pb2.RunEpisodeResponse:
        if self.runner is None:
            raise FailedPrecondition("RunEpisode needs an inference-router (set LOOPRL_ENV_ROUTER_ADDRESS)")
        task = request.task
        if not task.environment:
            raise InvalidArgument("task.environment: required")
        CURRENT_RUN.set(task.run_id)  # this call's own context: the router serves the run's deployments
        try:
            rollouts = await self.runner.run_all(task)
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        except SandboxError as exc:
            raise _sandbox_status(exc) from None
        except grpc.aio.AioRpcError as exc:
            raise _dependency_status(exc) from None
        return environment_pb2.RunEpisodeResponse(rollout=rollouts[0], rollouts=rollouts)

    async def Reset(self, request, context: Any) -> environment_pb2.ResetResponse:
        try:
            env = make_environment(request.environment, None, self.context)
            observation = await env.reset(parse_task(request.task_json))
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        session_id = request.session_id or uuid.uuid4().hex
        replaced = self.sessions.get(session_id)
        self.sessions[session_id] = env
        self.sessions.move_to_end(session_id)
        dropped = [replaced] if replaced is not None else []
        while len(self.sessions) > self.max_sessions:
            dropped.append(self.sessions.popitem(last=False)[1])
        for old in dropped:  # what a dropped session holds (a workspace) is freed with it
            await old.close()
        return environment_pb2.ResetResponse(
            session_id=session_id, observation=[environment_pb2.Message(**m) for m in observation]
        )

    async def Step(self, request, context: Any) -> environment_pb2.StepResponse:
        env = self.sessions.get(request.session_id)
        if env is None:
            raise NotFound(
                f"session_id: no session {request.session_id!r} (never reset, finished or evicted)"
            )
        try:
            result = await env.step(request.action)
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        except SandboxError as exc:
            raise _sandbox_status(exc) from None
        if result.done:
            self.sessions.pop(request.session_id, None)
            await env.close()
        return environment_pb2.StepResponse(
            observation=[environment_pb2.Message(**m) for m in result.observation],
            reward=result.reward,
            done=result.done,
            info=result.info,
        )

    async def Exec(self, request, context: Any) -> environment_pb2.ExecResponse:
        if request.language not in ("", "python"):
            raise InvalidArgument(f"language: only 'python' is supported, got {request.language!r}")
        if not math.isfinite(request.timeout_seconds) or request.timeout_seconds < 0:
            raise InvalidArgument(f"timeout_seconds: must be >= 0, got {request.timeout_seconds}")
        max_timeout_s = self.pool.sandbox_config.max_timeout_s
        if request.timeout_seconds > max_timeout_s:
            raise InvalidArgument(
                f"timeout_seconds: {request.timeout_seconds:g} is over the limit {max_timeout_s:g}"
            )
        if request.memory_bytes < 0:
            raise InvalidArgument(f"memory_bytes: must be >= 0, got {request.memory_bytes}")
        size = len(request.code) + len(request.stdin) + sum(len(v) for v in request.files.values())
        if size > self.max_code_bytes:
            raise InvalidArgument(
                f"code: code, stdin and files total {size} bytes, over {self.max_code_bytes}"
            )
        files = dict(request.files)
        try:
            validate_files(files)
            result = await self.pool.execute(
                ExecJob(request.code, request.stdin, files, request.timeout_seconds, request.memory_bytes)
            )
        except InvalidJob as exc:
            raise InvalidArgument(str(exc)) from None
        except SandboxError as exc:
            raise _sandbox_status(exc) from None
        return environment_pb2.ExecResponse(
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            timed_out=result.timed_out,
            killed_reason=result.killed_reason,
            wall_seconds=result.wall_seconds,
            output_truncated=result.output_truncated,
            isolation=result.isolation,
            missing_isolation=result.missing_isolation,
            warm=result.warm,
            memory_peak_bytes=result.memory_peak_bytes,
        )

    async def ListEnvironments(self, request, context: Any) -> environment_pb2.ListEnvironmentsResponse:
        infos = [_info(name, environment_class(name)) for name in environment_names()]
        status = self.pool.isolation_status()
        sandbox = environment_pb2.SandboxStatus(
            isolation_level=status["level"],
            isolation=status["isolation"],
            missing_isolation=status["missing_isolation"],
            unavailable=status["unavailable"],
            memory_bytes=status["memory_bytes"],
            pids=status["pids"],
            cpu_quota=status["cpu_quota"],
            workspace_bytes=status["workspace_bytes"],
            cgroup=status["cgroup"],
        )
        return environment_pb2.ListEnvironmentsResponse(environments=infos, sandbox=sandbox)

    async def LoadEnvironment(self, request, context: Any) -> environment_pb2.LoadEnvironmentResponse:
        if not request.environment:
            raise InvalidArgument("environment: required")
        if request.max_prompt_tokens < 0:
            raise InvalidArgument(f"max_prompt_tokens: must be >= 0, got {request.max_prompt_tokens}")
        config_json = request.environment_config_json or None
        try:
            try:
                # In a thread: a plugin whose import hangs must not stop this service's event loop;
                # and refused at once (the dataset that follows may take longer, in rows).
                load = asyncio.to_thread(environment_class, request.environment, True)
                cls = await asyncio.wait_for(load, IMPORT_TIMEOUT_S)
            except TimeoutError:
                raise PluginFailure(
                    f"environment.name: plugin {request.environment!r} did not import within "
                    f"{IMPORT_TIMEOUT_S:g}s (a hanging import?)"
                ) from None
            except UnknownEnvironment:
                raise UnknownEnvironment(
                    f"environment.name: unknown environment {request.environment!r}: the environment-sandbox "
                    f"serves {', '.join(environment_names())}; a plugin is named 'module:Class', "
                    "'file.py:Class' or by a looprl.environments entry point"
                ) from None
            config = parse_config(cls, config_json)
            try:
                tokenizer = await self.tokenizers.aget(request.tokenizer)
            except ValueError as exc:
                raise EnvironmentError_(f"model.tokenizer: {exc}") from None
            reply = environment_pb2.LoadEnvironmentResponse(environment=_info(request.environment, cls))
            if request.dataset_json:
                dataset = await self.datasets.get(
                    request.dataset_json,
                    request.environment,
                    config_json,
                    request.tokenizer,
                    tokenizer,
                    refresh=True,
                )
                first = dataset.task("train", 0)
                reply.dataset.CopyFrom(
                    environment_pb2.DatasetSummary(
                        rows=dataset.rows,
                        train_rows=len(dataset.train),
                        eval_rows=len(dataset.eval),
                        filtered_too_long=dataset.filtered_too_long,
                        max_prompt_tokens=dataset.max_prompt_tokens,
                        longest_prompt_tokens=dataset.longest_prompt_tokens,
                        sources=dataset.sources,
                    )
                )
            else:
                first = await _trial(
                    cls, lambda: cls.generate(random.Random(f"{request.environment}:0:0"), config)
                )
            env = cls(config, self.context)
            await _trial(cls, lambda: env.reset(dict(first)))
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        except plugins.PluginError as exc:  # a task source plugin
            raise FailedPrecondition(f"dataset.source: plugin {exc}") from None
        reply.first_task_json = json.dumps(first)
        if "answer" in first:
            reply.first_answer = str(first["answer"])
        return reply


def _info(name: str, cls: type[Environment]) -> environment_pb2.EnvironmentInfo:
    loaded = plugin_of(cls)
    return environment_pb2.EnvironmentInfo(
        name=name,
        description=getattr(cls, "description", "") or (cls.__doc__ or "").strip().split("\n")[0],
        multi_turn=cls.multi_turn,
        default_reward=cls.default_reward,
        plugin=loaded.origin if loaded is not None else "",
    )


async def _trial(cls: type[Environment], call: Any) -> Any:
    """Run one call of an environment's code (its generator, a reset) before a run relies on it: a
    plugin that raises is a FAILED_PRECONDITION naming its file and line."""
    with plugin_code(cls, "failed its trial"):
        result = call()
        return await result if inspect.isawaitable(result) else result


def _dependency_status(exc: grpc.aio.AioRpcError) -> ServiceError:
    """A refusal of the episode's own request by the router or reward service is the caller's to
    fix (the same status); any other failure of theirs is worth retrying (UNAVAILABLE)."""
    code, details = exc.code(), exc.details() or exc.code().name
    for refusal in (InvalidArgument, NotFound, FailedPrecondition):
        if code == refusal.code:
            return refusal(f"a call of the episode was refused: {details}")
    return Unavailable(f"a service the episode needs failed ({code.name}): {details}")


def _sandbox_status(exc: SandboxError) -> ServiceError:
    """Missing isolation is a standing refusal (FAILED_PRECONDITION); a sandbox that could not be
    started now (a worker, or a fleet actor Ray has not placed) is worth retrying (UNAVAILABLE)."""
    if isinstance(exc, SandboxUnavailable):
        return FailedPrecondition(str(exc))
    return Unavailable(str(exc))
