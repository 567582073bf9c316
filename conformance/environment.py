"""The environment-sandbox contract (looprl.environment.v1.EnvironmentSandboxService): sessions
that start and end as documented, sandboxed code that reports how it ended, episodes whose rollout
is trainable as the packer expects, and refusals that name the field.

Interactive sessions and episodes need a task the environment accepts: `--option environment=NAME`
and `--option task_json=JSON` (a `digits` task by default, the default recipe's environment).
An episode needs an inference-router serving a model: without one the episode cases are skipped.
"""

from __future__ import annotations

import json
import math

from conformance.case import Contract, check, skip
from conformance.common import add_common
from conformance.target import Session
from looprl.common.v1 import common_pb2
from looprl.environment.v1 import environment_pb2 as pb
from looprl.events.v1 import events_pb2

SERVICE = "looprl.environment.v1.EnvironmentSandboxService"
contract = Contract(
    "environment-sandbox",
    SERVICE,
    "environments, the agent loop and sandboxed code: RunEpisode, Reset/Step, Exec, ListEnvironments",
    options={
        "environment": "environment for Reset/Step/RunEpisode (default: digits)",
        "task_json": "a task that environment accepts (default: a digits task)",
        "action": "an action that ends the episode (default: 21)",
    },
)
add_common(contract, "ListEnvironments", pb.ListEnvironmentsRequest())

DIGITS_TASK = json.dumps({"op": "rev", "digits": "12", "answer": "21"})
LEVELS = ("full", "degraded")


def _environment(s: Session) -> tuple[str, str]:
    name = s.option("environment", "digits")
    listed = _listing(s).environments
    if name not in [e.name for e in listed]:
        skip(f"the service does not list environment {name!r}; set --option environment=")
    task = s.option("task_json") or (DIGITS_TASK if name == "digits" else "")
    if not task:
        skip(f"no task for environment {name!r}: set --option task_json=")
    return name, task


def _listing(s: Session) -> pb.ListEnvironmentsResponse:
    if "listing" not in s.facts:
        s.facts["listing"] = s.unary(
            "ListEnvironments", pb.ListEnvironmentsRequest(), pb.ListEnvironmentsResponse
        )
    return s.facts["listing"]


@contract.case(
    "list.shape",
    "ListEnvironments",
    "lists environments with unique names and says how code is sandboxed",
    "OK",
    "looprl.environment.v1.SandboxStatus.isolation_level",
    '"full" (refuses to run unless every configured mechanism applies) or "degraded"',
)
def _list(s: Session) -> None:
    reply = _listing(s)
    names = [e.name for e in reply.environments]
    check(names and all(names), f"environments without a name: {names}")
    check(len(set(names)) == len(names), f"names repeat: {names}")
    check(
        reply.sandbox.isolation_level in LEVELS,
        f"sandbox.isolation_level is {reply.sandbox.isolation_level!r}",
    )


@contract.case(
    "reset.unknown_environment",
    "Reset",
    "an environment the service does not list is refused naming `environment`",
    "NOT_FOUND",
    "looprl.environment.v1.ResetRequest.environment",
    "not listed by ListEnvironments: NOT_FOUND",
)
def _reset_unknown(s: Session) -> None:
    request = pb.ResetRequest(environment="conformance-no-such-environment", task_json="{}")
    s.refused("NOT_FOUND", lambda: s.unary("Reset", request, pb.ResetResponse), naming="environment")


@contract.case(
    "reset.bad_task",
    "Reset",
    "a task the environment cannot play is refused naming task_json",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.ResetRequest.task_json",
    "INVALID_ARGUMENT naming task_json",
)
def _reset_bad_task(s: Session) -> None:
    name, _ = _environment(s)
    for bad in ("{not json", "[1]"):
        request = pb.ResetRequest(environment=name, task_json=bad)
        s.refused(
            "INVALID_ARGUMENT", lambda r=request: s.unary("Reset", r, pb.ResetResponse), naming="task_json"
        )


@contract.case(
    "reset.session",
    "Reset",
    "starts a session: the given session id is kept (one is generated when empty) and the observation is the opening messages",
    "OK",
    "looprl.environment.v1.ResetRequest.session_id",
    "generated when empty",
)
def _reset(s: Session) -> None:
    name, task = _environment(s)
    given = s.unary(
        "Reset",
        pb.ResetRequest(environment=name, task_json=task, session_id="conformance-a"),
        pb.ResetResponse,
    )
    check(given.session_id == "conformance-a", f"session_id {given.session_id!r}, asked for 'conformance-a'")
    check(
        given.observation and all(m.role for m in given.observation),
        f"observation without roles: {list(given.observation)}",
    )
    fresh = s.unary("Reset", pb.ResetRequest(environment=name, task_json=task), pb.ResetResponse)
    check(
        fresh.session_id and fresh.session_id != given.session_id,
        f"generated session_id {fresh.session_id!r}",
    )
    s.facts["session"] = fresh.session_id


@contract.case(
    "step.reward",
    "Step",
    "an action answers an observation, a finite reward and whether the episode is done",
    "OK",
    "looprl.environment.v1.StepResponse.reward",
    "finite",
)
def _step(s: Session) -> None:
    session = s.need("session", "no session was started (environment-sandbox.reset.session failed)")
    reply = s.unary(
        "Step", pb.StepRequest(session_id=session, action=s.option("action", "21")), pb.StepResponse
    )
    check(math.isfinite(reply.reward), f"reward {reply.reward}")
    s.facts["done"] = reply.done
    if not reply.done:
        skip("the action did not end the episode; set --option action= to one that does")


@contract.case(
    "step.finished_session",
    "Step",
    "a session whose episode is done is gone",
    "NOT_FOUND",
    "looprl.environment.v1.StepRequest.session_id",
    "finished, evicted or never started: NOT_FOUND",
)
def _step_finished(s: Session) -> None:
    session = s.need("session", "no session was started (environment-sandbox.reset.session failed)")
    if not s.facts.get("done"):
        skip("the episode did not end (environment-sandbox.step.reward)")
    s.refused(
        "NOT_FOUND",
        lambda: s.unary("Step", pb.StepRequest(session_id=session, action="1"), pb.StepResponse),
        naming="session_id",
    )


@contract.case(
    "step.unknown_session",
    "Step",
    "a session id that was never started is refused naming `session_id`",
    "NOT_FOUND",
    "looprl.environment.v1.StepRequest.session_id",
    "finished, evicted or never started: NOT_FOUND",
)
def _step_unknown(s: Session) -> None:
    request = pb.StepRequest(session_id="conformance-never-started", action="1")
    s.refused("NOT_FOUND", lambda: s.unary("Step", request, pb.StepResponse), naming="session_id")


def _sandbox_runs(s: Session) -> bool:
    return not _listing(s).sandbox.unavailable


@contract.case(
    "exec.refused_without_isolation",
    "Exec",
    "while the sandbox reports itself unavailable, code is refused with the reason",
    "FAILED_PRECONDITION",
    "looprl.environment.v1.SandboxStatus.unavailable",
    "Exec answers FAILED_PRECONDITION",
)
def _exec_unavailable(s: Session) -> None:
    if _sandbox_runs(s):
        skip("the sandbox runs code here")
    s.refused(
        "FAILED_PRECONDITION",
        lambda: s.unary("Exec", pb.ExecRequest(language="python", code="print(1)"), pb.ExecResponse),
    )


@contract.case(
    "exec.runs",
    "Exec",
    "runs python and reports its exit code and output",
    "OK",
    "looprl.environment.v1.ExecResponse.exit_code",
    "exit status of the program",
)
def _exec(s: Session) -> None:
    if not _sandbox_runs(s):
        skip("the sandbox reports itself unavailable")
    reply = s.unary(
        "Exec",
        pb.ExecRequest(language="python", code="import sys\nprint(6 * 7)\nsys.exit(3)"),
        pb.ExecResponse,
        timeout=60,
    )
    check(reply.stdout.strip() == "42", f"stdout {reply.stdout!r}, expected '42'")
    check(
        reply.exit_code == 3 and not reply.timed_out,
        f"exit_code {reply.exit_code}, timed_out {reply.timed_out}",
    )


@contract.case(
    "exec.timeout",
    "Exec",
    "a program past its timeout is stopped and says so",
    "OK",
    "looprl.environment.v1.ExecResponse.killed_reason",
    '"timeout"',
)
def _exec_timeout(s: Session) -> None:
    if not _sandbox_runs(s):
        skip("the sandbox reports itself unavailable")
    reply = s.unary(
        "Exec",
        pb.ExecRequest(language="python", code="while True:\n    pass\n", timeout_seconds=0.5),
        pb.ExecResponse,
        timeout=60,
    )
    check(
        reply.timed_out and reply.killed_reason == "timeout",
        f"timed_out {reply.timed_out}, killed_reason {reply.killed_reason!r}",
    )
    check(reply.wall_seconds < 30, f"ran {reply.wall_seconds:.1f}s past a 0.5 s timeout")


@contract.case(
    "exec.language",
    "Exec",
    "a language other than python is refused naming `language`",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.ExecRequest.language",
    'only "python"',
)
def _exec_language(s: Session) -> None:
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("Exec", pb.ExecRequest(language="cobol", code="x"), pb.ExecResponse),
        naming="language",
    )


@contract.case(
    "exec.limits",
    "Exec",
    "a negative timeout or memory limit is refused naming the field",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.ExecRequest.timeout_seconds",
    "negative, not finite or over the service's limit: INVALID_ARGUMENT",
)
def _exec_limits(s: Session) -> None:
    for field, request in (
        ("timeout_seconds", pb.ExecRequest(language="python", code="1", timeout_seconds=-1)),
        ("timeout_seconds", pb.ExecRequest(language="python", code="1", timeout_seconds=math.nan)),
        ("memory_bytes", pb.ExecRequest(language="python", code="1", memory_bytes=-1)),
    ):
        s.refused("INVALID_ARGUMENT", lambda r=request: s.unary("Exec", r, pb.ExecResponse), naming=field)


def _task(s: Session, name: str, task: str, index: int) -> events_pb2.EpisodeTask:
    return events_pb2.EpisodeTask(
        run_id="conformance",
        task_id=f"conformance-{index}",
        group_id=f"conformance-{index}",
        environment=name,
        task_json=task,
        group_size=1,
        reward=s.option("reward", name),
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=1),
    )


@contract.case(
    "episode.environment_required",
    "RunEpisode",
    "a task without an environment is refused naming task.environment",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.RunEpisodeRequest.task",
    "INVALID_ARGUMENT naming task.environment",
)
def _episode_required(s: Session) -> None:
    request = pb.RunEpisodeRequest(task=events_pb2.EpisodeTask(task_json="{}"))
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("RunEpisode", request, pb.RunEpisodeResponse),
        naming="task.environment",
    )


@contract.case(
    "episode.rollout",
    "RunEpisode",
    "returns a rollout whose model turns carry one log-prob per token and their weight version, other turns none",
    "OK",
    "looprl.common.v1.Turn.logprobs",
    "one per token; empty for turns that are not trainable",
)
def _episode(s: Session) -> None:
    name, task = _environment(s)
    request = pb.RunEpisodeRequest(task=_task(s, name, task, 0))
    try:
        reply = s.unary("RunEpisode", request, pb.RunEpisodeResponse, timeout=60)
    except Exception as exc:
        code = getattr(exc, "code", lambda: None)()
        if code is not None and code.name in ("UNAVAILABLE", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED"):
            skip(f"no model to play an episode with: {code.name} {exc.details()}")
        raise
    r = reply.rollout
    check(r.rollout_id, "the rollout has no rollout_id")
    check(math.isfinite(r.reward), f"reward {r.reward}")
    model_turns = [t for t in r.turns if t.trainable]
    check(model_turns, "no trainable (model) turn")
    for i, t in enumerate(r.turns):
        if t.trainable:
            check(
                len(t.logprobs) == len(t.token_ids),
                f"turns[{i}]: {len(t.logprobs)} log-probs for {len(t.token_ids)} tokens",
            )
            check(
                all(lp <= 1e-6 and math.isfinite(lp) for lp in t.logprobs),
                f"turns[{i}]: log-probs {list(t.logprobs)[:8]}",
            )
        else:
            check(not t.logprobs, f"turns[{i}] is not trainable but carries log-probs")
    versions = [t.weight_version for t in model_turns]
    check(
        r.min_weight_version == min(versions) and r.max_weight_version == max(versions),
        f"min/max_weight_version {r.min_weight_version}/{r.max_weight_version}, turns {versions}",
    )
    s.facts["rollout"] = r


@contract.case(
    "episode.rollout_id",
    "RunEpisode",
    "the same episode sample always has the same rollout id",
    "OK",
    "looprl.common.v1.Rollout.rollout_id",
    "the same episode sample always has the same id",
)
def _episode_id(s: Session) -> None:
    first = s.need("rollout", "no episode ran (environment-sandbox.episode.rollout)")
    name, task = _environment(s)
    again = s.unary(
        "RunEpisode", pb.RunEpisodeRequest(task=_task(s, name, task, 0)), pb.RunEpisodeResponse, timeout=60
    )
    check(
        again.rollout.rollout_id == first.rollout_id,
        f"rollout_id {again.rollout.rollout_id!r} then {first.rollout_id!r}",
    )
    other = s.unary(
        "RunEpisode", pb.RunEpisodeRequest(task=_task(s, name, task, 1)), pb.RunEpisodeResponse, timeout=60
    )
    check(other.rollout.rollout_id != first.rollout_id, "another task got the same rollout_id")


@contract.case(
    "load.required",
    "LoadEnvironment",
    "an empty environment name is refused naming `environment`",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.LoadEnvironmentRequest.environment",
    "empty: INVALID_ARGUMENT naming environment",
)
def _load_required(s: Session) -> None:
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("LoadEnvironment", pb.LoadEnvironmentRequest(), pb.LoadEnvironmentResponse),
        naming="environment",
    )


@contract.case(
    "load.unknown",
    "LoadEnvironment",
    "an environment that is neither built in nor a plugin is refused",
    "NOT_FOUND",
    "looprl.environment.v1.EnvironmentSandboxService.LoadEnvironment",
    "NOT_FOUND for an unknown environment",
)
def _load_unknown(s: Session) -> None:
    request = pb.LoadEnvironmentRequest(environment="conformance-no-such-environment")
    s.refused("NOT_FOUND", lambda: s.unary("LoadEnvironment", request, pb.LoadEnvironmentResponse))


@contract.case(
    "load.max_prompt_tokens",
    "LoadEnvironment",
    "a negative prompt limit is refused naming it",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.LoadEnvironmentRequest.max_prompt_tokens",
    "negative: INVALID_ARGUMENT naming max_prompt_tokens",
)
def _load_limit(s: Session) -> None:
    name, _ = _environment(s)
    request = pb.LoadEnvironmentRequest(environment=name, max_prompt_tokens=-1)
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("LoadEnvironment", request, pb.LoadEnvironmentResponse),
        naming="max_prompt_tokens",
    )


@contract.case(
    "load.bad_config",
    "LoadEnvironment",
    "a config the environment cannot take is refused",
    "INVALID_ARGUMENT",
    "looprl.environment.v1.EnvironmentSandboxService.LoadEnvironment",
    "INVALID_ARGUMENT for a bad config or dataset",
)
def _load_bad_config(s: Session) -> None:
    name, _ = _environment(s)
    for bad in ("{not json", '{"conformance_no_such_setting": 1}'):
        request = pb.LoadEnvironmentRequest(environment=name, environment_config_json=bad)
        s.refused(
            "INVALID_ARGUMENT", lambda r=request: s.unary("LoadEnvironment", r, pb.LoadEnvironmentResponse)
        )


@contract.case(
    "load.first_task",
    "LoadEnvironment",
    "loads a listed environment and answers a first task that Reset accepts",
    "OK",
    "looprl.environment.v1.LoadEnvironmentResponse.first_task_json",
    "The first task a run of this recipe plays (JSON)",
)
def _load(s: Session) -> None:
    name, _ = _environment(s)
    reply = s.unary(
        "LoadEnvironment", pb.LoadEnvironmentRequest(environment=name), pb.LoadEnvironmentResponse, timeout=60
    )
    check(reply.environment.name == name, f"loaded {reply.environment.name!r}, asked for {name!r}")
    task = json.loads(reply.first_task_json)
    check(isinstance(task, dict), f"first_task_json is not a JSON object: {reply.first_task_json!r}")
    started = s.unary(
        "Reset", pb.ResetRequest(environment=name, task_json=reply.first_task_json), pb.ResetResponse
    )
    check(started.observation, "Reset of the first task answered no observation")
