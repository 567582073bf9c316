"""EnvironmentSandboxService over gRPC: RunEpisode, Reset/Step sessions, Exec, ListEnvironments."""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from typing import Any

from looprl.environment.v1 import environment_pb2, environment_pb2_grpc
from services.environment_sandbox.agent_loop import EpisodeRunner
from services.environment_sandbox.environments import (
    EnvContext,
    Environment,
    EnvironmentError_,
    UnknownEnvironment,
    environment_class,
    environment_names,
    make_environment,
    parse_task,
)
from services.environment_sandbox.sandbox import ExecJob, SandboxPool
from services.environment_sandbox.sandbox.fleet import SandboxFleet
from services.environment_sandbox.sandbox.job import (
    InvalidJob,
    SandboxError,
    SandboxUnavailable,
    validate_files,
)
from services.kit.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable


def _status(exc: EnvironmentError_) -> Exception:
    return NotFound(str(exc)) if isinstance(exc, UnknownEnvironment) else InvalidArgument(str(exc))


class EnvironmentSandboxServicer(environment_pb2_grpc.EnvironmentSandboxServiceServicer):
    def __init__(
        self,
        pool: SandboxPool | SandboxFleet,
        runner: EpisodeRunner | None,
        max_sessions: int = 4096,
        max_code_bytes: int = 1 << 20,
    ) -> None:
        self.pool = pool
        self.runner = runner
        self.context = EnvContext(executor=pool.run_code)
        self.sessions: OrderedDict[str, Environment] = OrderedDict()
        self.max_sessions = max_sessions
        self.max_code_bytes = max_code_bytes

    async def RunEpisode(self, request, context: Any) -> environment_pb2.RunEpisodeResponse:
        if self.runner is None:
            raise FailedPrecondition("RunEpisode needs an inference-router (set LOOPRL_ENV_ROUTER_ADDRESS)")
        task = request.task
        if not task.environment:
            raise InvalidArgument("task.environment: required")
        try:
            rollout = await self.runner.run(task)
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        except SandboxError as exc:
            raise _sandbox_status(exc) from None
        return environment_pb2.RunEpisodeResponse(rollout=rollout)

    async def Reset(self, request, context: Any) -> environment_pb2.ResetResponse:
        try:
            env = make_environment(request.environment, None, self.context)
            observation = await env.reset(parse_task(request.task_json))
        except EnvironmentError_ as exc:
            raise _status(exc) from None
        session_id = request.session_id or uuid.uuid4().hex
        self.sessions[session_id] = env
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
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
        infos = []
        for name in environment_names():
            cls = environment_class(name)
            infos.append(
                environment_pb2.EnvironmentInfo(
                    name=name,
                    description=cls.description,
                    multi_turn=cls.multi_turn,
                    default_reward=cls.default_reward,
                )
            )
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


def _sandbox_status(exc: SandboxError) -> ServiceError:
    """Missing isolation is a standing refusal (FAILED_PRECONDITION); a sandbox that could not be
    started now (a worker, or a fleet actor Ray has not placed) is worth retrying (UNAVAILABLE)."""
    if isinstance(exc, SandboxUnavailable):
        return FailedPrecondition(str(exc))
    return Unavailable(str(exc))
