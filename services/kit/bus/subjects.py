"""Names on the event bus, in one place: subjects per run, the JetStream streams that hold them,
and the KV buckets that hold shared state.

Every service builds its subjects from here instead of formatting strings itself, so a rename
is one edit and a bad run id fails loudly before it can become a wildcard. Run ids become a
single subject token (`looprl.<run>.episodes`), so they may only hold letters, digits, '-' and
'_': a '.' would add a token, '*' or '>' would turn a publish into a wildcard, and whitespace is
illegal in NATS subjects.

Streams (one per kind of event, covering every run with a '*' in the run position):

| stream   | subjects              | retention | why                                                   |
|----------|-----------------------|-----------|-------------------------------------------------------|
| EPISODES | looprl.*.episodes     | WorkQueue | each episode task goes to exactly one worker; an ack removes it |
| ROLLOUTS | looprl.*.rollouts     | Limits    | durable record of every rollout; the packer acks after the trainer took the batch |
| WEIGHTS  | looprl.*.weights      | Limits    | weight versions published, replayable by a late deployment |
| TRAIN    | looprl.*.train        | Limits    | trainer step records for progress views and plots      |
| RUN_EVENTS | looprl.*.events     | Limits    | errors components met working for a run (RunError)     |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

PREFIX = "looprl"

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# Consumer (durable) names follow the same rule: the server puts them into API subjects.
_DURABLE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def validate_run_id(run_id: str) -> str:
    """Return run_id unchanged, or raise ValueError naming it when it cannot be a subject token."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is not valid: use 1-128 letters, digits, '-' or '_' "
            "(it becomes a NATS subject token, so '.', '*', '>' and whitespace are not allowed)"
        )
    return run_id


def validate_durable(name: str) -> str:
    """Return name unchanged, or raise ValueError when it cannot name a JetStream consumer."""
    if not isinstance(name, str) or not _DURABLE.match(name):
        raise ValueError(f"consumer name {name!r} is not valid: use 1-128 letters, digits, '-' or '_'")
    return name


class Kind(StrEnum):
    """The kinds of per-run events; each is the last token of its subject."""

    EPISODES = "episodes"
    ROLLOUTS = "rollouts"
    WEIGHTS = "weights"
    TRAIN = "train"
    EVENTS = "events"


def subject(run_id: str, kind: Kind | str) -> str:
    """`looprl.<run>.<kind>` for a validated run id."""
    return f"{PREFIX}.{validate_run_id(run_id)}.{Kind(kind).value}"


def episodes(run_id: str) -> str:
    """Work queue of episode tasks for one run (gateway -> environment-sandbox)."""
    return subject(run_id, Kind.EPISODES)


def rollouts(run_id: str) -> str:
    """Completed rollouts for one run (environment-sandbox -> rollout-packer)."""
    return subject(run_id, Kind.ROLLOUTS)


def weights(run_id: str) -> str:
    """Weight versions published for one run (weight-sync -> deployments, gateway)."""
    return subject(run_id, Kind.WEIGHTS)


def train(run_id: str) -> str:
    """Trainer step records for one run (trainer -> gateway, progress views)."""
    return subject(run_id, Kind.TRAIN)


def events(run_id: str) -> str:
    """Errors components report for one run (any service -> gateway, which names them in the run)."""
    return subject(run_id, Kind.EVENTS)


def all_runs(kind: Kind | str) -> str:
    """The wildcard subject covering every run's events of one kind."""
    return f"{PREFIX}.*.{Kind(kind).value}"


def run_of(subject_name: str) -> str:
    """The run id carried in a `looprl.<run>.<kind>` subject."""
    parts = subject_name.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise ValueError(f"subject {subject_name!r} is not of the form {PREFIX}.<run>.<kind>")
    return validate_run_id(parts[1])


class Retention(StrEnum):
    LIMITS = "limits"
    WORK_QUEUE = "workqueue"


@dataclass(frozen=True)
class StreamSpec:
    """What a stream must look like; Bus.ensure_streams provisions it from this."""

    name: str
    subjects: tuple[str, ...]
    retention: Retention = Retention.LIMITS
    max_age_s: float | None = None
    """Messages older than this are dropped (None: kept until limits or acks remove them)."""
    max_bytes: int | None = None
    description: str = ""


@dataclass(frozen=True)
class BucketSpec:
    """A JetStream KV bucket."""

    name: str
    history: int = 1
    ttl_s: float | None = None
    description: str = ""


_WEEK = 7 * 24 * 3600.0

EPISODES = "EPISODES"
ROLLOUTS = "ROLLOUTS"
WEIGHTS = "WEIGHTS"
TRAIN = "TRAIN"
RUN_EVENTS = "RUN_EVENTS"

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        EPISODES,
        (all_runs(Kind.EPISODES),),
        Retention.WORK_QUEUE,
        description="episode tasks; an ack removes the task",
    ),
    StreamSpec(
        ROLLOUTS,
        (all_runs(Kind.ROLLOUTS),),
        Retention.LIMITS,
        max_age_s=_WEEK,
        description="completed rollouts; the packer acks after the trainer took their batch",
    ),
    StreamSpec(
        WEIGHTS,
        (all_runs(Kind.WEIGHTS),),
        Retention.LIMITS,
        max_age_s=_WEEK,
        description="weight versions published",
    ),
    StreamSpec(
        TRAIN,
        (all_runs(Kind.TRAIN),),
        Retention.LIMITS,
        max_age_s=_WEEK,
        description="trainer step records",
    ),
    StreamSpec(
        RUN_EVENTS,
        (all_runs(Kind.EVENTS),),
        Retention.LIMITS,
        max_age_s=24 * 3600.0,
        max_bytes=64 << 20,
        description="errors components reported for a run (rate-limited per component and run)",
    ),
)

STREAM_OF_KIND: dict[Kind, str] = {
    Kind.EPISODES: EPISODES,
    Kind.ROLLOUTS: ROLLOUTS,
    Kind.WEIGHTS: WEIGHTS,
    Kind.TRAIN: TRAIN,
    Kind.EVENTS: RUN_EVENTS,
}

RUNS = "runs"
DEPLOYMENTS = "deployments"
WEIGHTS_KV = "weights"
TRAINER_EPOCHS = "trainer-epochs"
PACKER_STEPS = "packer"


def packer_step_key(run_id: str, step: int | str) -> str:
    """The packer's plan of one trainer step in PACKER_STEPS (`*` as step: all of the run's steps).
    Written when the step's batch is complete, before the trainer is served it."""
    return f"{validate_run_id(run_id)}.step.{step}"


def packer_drops_key(run_id: str, step: int | str) -> str:
    """The groups the packer dropped whole while `step` filled, in PACKER_STEPS
    (services/rollout_packer/reports.py; `*` as step: all of the run's)."""
    return f"{validate_run_id(run_id)}.drops.{step}"


def packer_samples_key(run_id: str, step: int | str) -> str:
    """The sample completions of one step, in PACKER_STEPS (services/rollout_packer/reports.py)."""
    return f"{validate_run_id(run_id)}.samples.{step}"


def packer_run_keys(run_id: str) -> str:
    """Every key the packer writes for a run in PACKER_STEPS: plans, drops and samples."""
    return f"{validate_run_id(run_id)}.>"


BUCKETS: tuple[BucketSpec, ...] = (
    BucketSpec(RUNS, history=5, description="run id -> run state (gateway)"),
    BucketSpec(DEPLOYMENTS, history=1, description="deployment id -> registration and heartbeat"),
    BucketSpec(WEIGHTS_KV, history=5, description="run id / version -> weight manifest"),
    BucketSpec(TRAINER_EPOCHS, history=1, description="run id -> the trainer epochs that trained it"),
    BucketSpec(PACKER_STEPS, history=1, description="packer step plans and acks, dropped groups, samples"),
)


def stream_for(subject_name: str) -> str:
    """The stream that stores a `looprl.<run>.<kind>` subject."""
    run_of(subject_name)
    return STREAM_OF_KIND[Kind(subject_name.rsplit(".", 1)[1])]


# WeightsRejected (a canary refused a version) shares looprl.<run>.weights with WeightsPublished;
# this header tells them apart, so consumers of WeightsPublished skip the messages that carry it.
EVENT_HEADER = "looprl-event"
WEIGHTS_REJECTED = "weights-rejected"
