from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_PENDING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_STALLED: _ClassVar[RunState]
    RUN_STATE_QUEUED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_PENDING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_STALLED: RunState
RUN_STATE_QUEUED: RunState

class DeploymentVersion(_message.Message):
    __slots__ = ("deployment", "version")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step", "reward_mean", "reward_std", "loss", "mean_staleness", "train_tokens_per_second", "generation_tokens_per_second", "num_rollouts", "seconds", "max_staleness", "clip_fraction", "kl", "entropy", "grad_norm", "mean_response_tokens", "unix_time", "importance_ratio_mean", "importance_ratio_max", "importance_ratio_min", "importance_ratio_clipped", "resampled_groups")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    MEAN_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    RESAMPLED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    reward_mean: float
    reward_std: float
    loss: float
    mean_staleness: float
    train_tokens_per_second: float
    generation_tokens_per_second: float
    num_rollouts: int
    seconds: float
    max_staleness: int
    clip_fraction: float
    kl: float
    entropy: float
    grad_norm: float
    mean_response_tokens: float
    unix_time: float
    importance_ratio_mean: float
    importance_ratio_max: float
    importance_ratio_min: float
    importance_ratio_clipped: float
    resampled_groups: int
    def __init__(self, step: _Optional[int] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., loss: _Optional[float] = ..., mean_staleness: _Optional[float] = ..., train_tokens_per_second: _Optional[float] = ..., generation_tokens_per_second: _Optional[float] = ..., num_rollouts: _Optional[int] = ..., seconds: _Optional[float] = ..., max_staleness: _Optional[int] = ..., clip_fraction: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., grad_norm: _Optional[float] = ..., mean_response_tokens: _Optional[float] = ..., unix_time: _Optional[float] = ..., importance_ratio_mean: _Optional[float] = ..., importance_ratio_max: _Optional[float] = ..., importance_ratio_min: _Optional[float] = ..., importance_ratio_clipped: _Optional[float] = ..., resampled_groups: _Optional[int] = ...) -> None: ...

class SampleCompletion(_message.Message):
    __slots__ = ("step", "rollout_id", "group_id", "prompt", "completion", "reward", "advantage", "response_tokens", "tokens", "weight_version")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    step: int
    rollout_id: str
    group_id: str
    prompt: str
    completion: str
    reward: float
    advantage: float
    response_tokens: int
    tokens: int
    weight_version: int
    def __init__(self, step: _Optional[int] = ..., rollout_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., response_tokens: _Optional[int] = ..., tokens: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class WeightSync(_message.Message):
    __slots__ = ("deployment", "version", "sync_seconds", "bytes")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    sync_seconds: float
    bytes: int
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ..., sync_seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "state", "recipe_toml", "step", "total_steps", "weight_version", "deployments", "history", "episodes_published", "rollouts_trained", "rollouts_dropped", "error", "queued_episodes", "duplicate_deliveries", "weight_syncs", "last_error", "stalled_reason", "step_records_ignored", "tenant", "queue_position", "queued_reason", "evaluations", "dataset", "resampled_groups", "samples")
    class RolloutsDroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RECIPE_TOML_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    EPISODES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNCS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    STALLED_REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_RECORDS_IGNORED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REASON_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    RESAMPLED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    recipe_toml: str
    step: int
    total_steps: int
    weight_version: int
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentVersion]
    history: _containers.RepeatedCompositeFieldContainer[StepSummary]
    episodes_published: int
    rollouts_trained: int
    rollouts_dropped: _containers.ScalarMap[str, int]
    error: str
    queued_episodes: int
    duplicate_deliveries: int
    weight_syncs: _containers.RepeatedCompositeFieldContainer[WeightSync]
    last_error: ComponentError
    stalled_reason: str
    step_records_ignored: int
    tenant: str
    queue_position: int
    queued_reason: str
    evaluations: _containers.RepeatedCompositeFieldContainer[Evaluation]
    dataset: RunDataset
    resampled_groups: int
    samples: _containers.RepeatedCompositeFieldContainer[SampleCompletion]
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., recipe_toml: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., deployments: _Optional[_Iterable[_Union[DeploymentVersion, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., episodes_published: _Optional[int] = ..., rollouts_trained: _Optional[int] = ..., rollouts_dropped: _Optional[_Mapping[str, int]] = ..., error: _Optional[str] = ..., queued_episodes: _Optional[int] = ..., duplicate_deliveries: _Optional[int] = ..., weight_syncs: _Optional[_Iterable[_Union[WeightSync, _Mapping]]] = ..., last_error: _Optional[_Union[ComponentError, _Mapping]] = ..., stalled_reason: _Optional[str] = ..., step_records_ignored: _Optional[int] = ..., tenant: _Optional[str] = ..., queue_position: _Optional[int] = ..., queued_reason: _Optional[str] = ..., evaluations: _Optional[_Iterable[_Union[Evaluation, _Mapping]]] = ..., dataset: _Optional[_Union[RunDataset, _Mapping]] = ..., resampled_groups: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[SampleCompletion, _Mapping]]] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("step", "prompts", "samples_per_prompt", "pass_at_1", "pass_at_k", "k", "mean_reward", "mean_response_tokens", "sources", "seconds", "unix_time", "greedy")
    class SourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EvaluationSource
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EvaluationSource, _Mapping]] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_1_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_K_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    MEAN_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    step: int
    prompts: int
    samples_per_prompt: int
    pass_at_1: float
    pass_at_k: float
    k: int
    mean_reward: float
    mean_response_tokens: float
    sources: _containers.MessageMap[str, EvaluationSource]
    seconds: float
    unix_time: float
    greedy: bool
    def __init__(self, step: _Optional[int] = ..., prompts: _Optional[int] = ..., samples_per_prompt: _Optional[int] = ..., pass_at_1: _Optional[float] = ..., pass_at_k: _Optional[float] = ..., k: _Optional[int] = ..., mean_reward: _Optional[float] = ..., mean_response_tokens: _Optional[float] = ..., sources: _Optional[_Mapping[str, EvaluationSource]] = ..., seconds: _Optional[float] = ..., unix_time: _Optional[float] = ..., greedy: _Optional[bool] = ...) -> None: ...

class EvaluationSource(_message.Message):
    __slots__ = ("prompts", "pass_at_1", "pass_at_k", "mean_reward", "mean_response_tokens")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_1_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_K_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    MEAN_RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompts: int
    pass_at_1: float
    pass_at_k: float
    mean_reward: float
    mean_response_tokens: float
    def __init__(self, prompts: _Optional[int] = ..., pass_at_1: _Optional[float] = ..., pass_at_k: _Optional[float] = ..., mean_reward: _Optional[float] = ..., mean_response_tokens: _Optional[float] = ...) -> None: ...

class RunDataset(_message.Message):
    __slots__ = ("rows", "train_rows", "eval_rows", "filtered_too_long", "max_prompt_tokens", "longest_prompt_tokens")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_TOO_LONG_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONGEST_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    train_rows: int
    eval_rows: int
    filtered_too_long: int
    max_prompt_tokens: int
    longest_prompt_tokens: int
    def __init__(self, rows: _Optional[int] = ..., train_rows: _Optional[int] = ..., eval_rows: _Optional[int] = ..., filtered_too_long: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., longest_prompt_tokens: _Optional[int] = ...) -> None: ...

class ComponentError(_message.Message):
    __slots__ = ("component", "message", "occurrences", "unix_time")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCES_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    component: str
    message: str
    occurrences: int
    unix_time: float
    def __init__(self, component: _Optional[str] = ..., message: _Optional[str] = ..., occurrences: _Optional[int] = ..., unix_time: _Optional[float] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("recipe_toml", "run_id")
    RECIPE_TOML_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    recipe_toml: str
    run_id: str
    def __init__(self, recipe_toml: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...
