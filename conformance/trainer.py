"""The trainer contract (looprl.trainer.v1.TrainerService): states from the documented set, a
weight version equal to the steps applied, configuration as documented JSON, and refusals for runs
it does not hold. With `--option run=RUN` (a run the trainer holds) the run's own answers are
checked as well; nothing here changes a run.
"""

from __future__ import annotations

import json
import math

from conformance.case import Contract, check, skip
from conformance.common import add_common
from conformance.target import Session
from looprl.trainer.v1 import trainer_pb2 as pb

SERVICE = "looprl.trainer.v1.TrainerService"
contract = Contract(
    "trainer",
    SERVICE,
    "the policy's runs: Status, Checkpoint, GetConfig",
    options={"run": "a run the trainer holds (training or ended lately)"},
)
add_common(contract, "Status", pb.StatusRequest())

STATES = ("idle", "starting", "training", "completed", "stopped", "failed")
NO_RUN = "conformance-no-such-run"


def _check_status(reply: pb.StatusResponse, where: str) -> None:
    check(reply.state in STATES, f"{where}: state {reply.state!r}, not one of {STATES}")
    if reply.state == "idle":
        return
    check(reply.run_id, f"{where}: a {reply.state} run without run_id")
    check(
        reply.step >= 0 and reply.world_size >= 1,
        f"{where}: step {reply.step}, world_size {reply.world_size}",
    )
    check(
        reply.weight_version == reply.step,
        f"{where}: weight_version {reply.weight_version} after {reply.step} steps",
    )
    check(math.isfinite(reply.last_loss), f"{where}: last_loss {reply.last_loss}")
    check(
        bool(reply.error) == (reply.state == "failed"),
        f"{where}: state {reply.state} with error {reply.error!r}",
    )


@contract.case(
    "status.states",
    "Status",
    "reports the newest run (idle without one) and every run it holds, each in a documented state",
    "OK",
    "looprl.trainer.v1.StatusResponse.state",
    '"idle", "starting", "training", "completed", "stopped", "failed"',
)
def _status(s: Session) -> None:
    reply = s.unary("Status", pb.StatusRequest(), pb.StatusResponse)
    _check_status(reply, "Status()")
    for i, run in enumerate(reply.runs):
        _check_status(run, f"runs[{i}]")
        check(not run.runs, f"runs[{i}] lists runs of its own")
    s.facts["held"] = [r.run_id for r in reply.runs]


@contract.case(
    "status.version_is_steps",
    "Status",
    "a run's weight_version is the number of steps applied",
    "OK",
    "looprl.trainer.v1.StatusResponse.weight_version",
    "equals step",
)
def _version(s: Session) -> None:
    run = s.option("run")
    if not run:
        held = s.need("held", "Status did not answer (trainer.status.states)")
        if not held:
            skip("the trainer holds no run; pass --option run=RUN")
        run = held[-1]
    reply = s.unary("Status", pb.StatusRequest(run_id=run), pb.StatusResponse)
    check(
        reply.run_id == run and not reply.runs,
        f"Status(run_id={run!r}) answered run {reply.run_id!r} with {len(reply.runs)} runs",
    )
    _check_status(reply, f"Status({run!r})")
    s.facts["run"] = reply


@contract.case(
    "status.unknown_run",
    "Status",
    "a run the trainer does not hold is refused naming `run_id`",
    "NOT_FOUND",
    "looprl.trainer.v1.StatusRequest.run_id",
    "NOT_FOUND when the trainer holds none of that id",
)
def _status_unknown(s: Session) -> None:
    s.refused(
        "NOT_FOUND",
        lambda: s.unary("Status", pb.StatusRequest(run_id=NO_RUN), pb.StatusResponse),
        naming="run_id",
    )


@contract.case(
    "checkpoint.unknown_run",
    "Checkpoint",
    "checkpointing a run the trainer does not hold is refused naming `run_id`",
    "NOT_FOUND",
    "looprl.trainer.v1.CheckpointRequest.run_id",
    "NOT_FOUND when the trainer holds none of that id",
)
def _checkpoint_unknown(s: Session) -> None:
    s.refused(
        "NOT_FOUND",
        lambda: s.unary("Checkpoint", pb.CheckpointRequest(run_id=NO_RUN), pb.CheckpointResponse),
        naming="run_id",
    )


@contract.case(
    "checkpoint.not_training",
    "Checkpoint",
    "checkpointing a run that is not training is refused",
    "FAILED_PRECONDITION",
    "looprl.trainer.v1.CheckpointRequest.run_id",
    "not training: FAILED_PRECONDITION",
)
def _checkpoint_idle(s: Session) -> None:
    run = s.facts.get("run")
    if run is not None and run.state not in ("training", "starting"):
        s.refused(
            "FAILED_PRECONDITION",
            lambda: s.unary("Checkpoint", pb.CheckpointRequest(run_id=run.run_id), pb.CheckpointResponse),
        )
        return
    reply = s.unary("Status", pb.StatusRequest(), pb.StatusResponse)
    training = [r for r in reply.runs if r.state in ("training", "starting")]
    if training:
        skip("a run is training; checkpointing it would change it")
    s.refused(
        "FAILED_PRECONDITION", lambda: s.unary("Checkpoint", pb.CheckpointRequest(), pb.CheckpointResponse)
    )


@contract.case(
    "config.json",
    "GetConfig",
    "answers a JSON object with the service settings and the ids of the runs held, and the named run's spec",
    "OK",
    "looprl.trainer.v1.GetConfigResponse.config_json",
    '"service" (its settings), "run" (a run\'s id and spec) and "runs"',
)
def _config(s: Session) -> None:
    reply = s.unary("GetConfig", pb.GetConfigRequest(), pb.GetConfigResponse)
    try:
        data = json.loads(reply.config_json)
    except json.JSONDecodeError as exc:
        check(False, f"config_json is not JSON: {exc}")
    check(
        isinstance(data, dict) and isinstance(data.get("service"), dict),
        'config_json has no "service" object',
    )
    check(isinstance(data.get("runs"), list), 'config_json has no "runs" list')
    run = s.facts.get("run")
    if run is not None:
        named = json.loads(
            s.unary("GetConfig", pb.GetConfigRequest(run_id=run.run_id), pb.GetConfigResponse).config_json
        )
        check(
            named.get("run", {}).get("run_id") == run.run_id,
            f"GetConfig(run_id={run.run_id!r}) run is {named.get('run')!r}",
        )
        check(run.run_id in named["runs"], f"runs {named['runs']} lacks {run.run_id!r}")


@contract.case(
    "config.unknown_run",
    "GetConfig",
    "the configuration of a run the trainer does not hold is refused naming `run_id`",
    "NOT_FOUND",
    "looprl.trainer.v1.GetConfigRequest.run_id",
    "NOT_FOUND when the trainer holds none of that id",
)
def _config_unknown(s: Session) -> None:
    s.refused(
        "NOT_FOUND",
        lambda: s.unary("GetConfig", pb.GetConfigRequest(run_id=NO_RUN), pb.GetConfigResponse),
        naming="run_id",
    )
