from looprl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeTask(_message.Message):
    __slots__ = ("run_id", "task_id", "group_id", "environment", "task_json", "group_size", "sample_index", "sampling", "min_weight_version", "reward", "step", "environment_config_json", "branch_at_turn", "branches", "tokenizer", "dataset_json", "reward_config_json", "evaluation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    BRANCH_AT_TURN_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DATASET_JSON_FIELD_NUMBER: _ClassVar[int]
    REWARD_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    group_id: str
    environment: str
    task_json: str
    group_size: int
    sample_index: int
    sampling: _common_pb2.SamplingParams
    min_weight_version: int
    reward: str
    step: int
    environment_config_json: str
    branch_at_turn: int
    branches: int
    tokenizer: str
    dataset_json: str
    reward_config_json: str
    evaluation: bool
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., environment: _Optional[str] = ..., task_json: _Optional[str] = ..., group_size: _Optional[int] = ..., sample_index: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_weight_version: _Optional[int] = ..., reward: _Optional[str] = ..., step: _Optional[int] = ..., environment_config_json: _Optional[str] = ..., branch_at_turn: _Optional[int] = ..., branches: _Optional[int] = ..., tokenizer: _Optional[str] = ..., dataset_json: _Optional[str] = ..., reward_config_json: _Optional[str] = ..., evaluation: _Optional[bool] = ...) -> None: ...

class WeightsPublished(_message.Message):
    __slots__ = ("run_id", "version", "deployment", "sync_seconds", "bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    deployment: str
    sync_seconds: float
    bytes: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., deployment: _Optional[str] = ..., sync_seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class WeightsRejected(_message.Message):
    __slots__ = ("run_id", "version", "deployment", "drift", "detail")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    deployment: str
    drift: float
    detail: str
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., deployment: _Optional[str] = ..., drift: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class TrainStepRecord(_message.Message):
    __slots__ = ("run_id", "step", "version", "loss", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_second", "mean_staleness", "reward_mean", "reward_std", "num_rollouts", "num_tokens", "step_seconds", "rollout_ids", "max_staleness", "response_tokens", "trainer_epoch", "importance_ratio_mean", "importance_ratio_max", "importance_ratio_min", "importance_ratio_clipped")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_RATIO_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    version: int
    loss: float
    clip_fraction: float
    kl: float
    entropy: float
    grad_norm: float
    tokens_per_second: float
    mean_staleness: float
    reward_mean: float
    reward_std: float
    num_rollouts: int
    num_tokens: int
    step_seconds: float
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    max_staleness: int
    response_tokens: int
    trainer_epoch: str
    importance_ratio_mean: float
    importance_ratio_max: float
    importance_ratio_min: float
    importance_ratio_clipped: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., loss: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., mean_staleness: _Optional[float] = ..., reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., num_rollouts: _Optional[int] = ..., num_tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., max_staleness: _Optional[int] = ..., response_tokens: _Optional[int] = ..., trainer_epoch: _Optional[str] = ..., importance_ratio_mean: _Optional[float] = ..., importance_ratio_max: _Optional[float] = ..., importance_ratio_min: _Optional[float] = ..., importance_ratio_clipped: _Optional[float] = ...) -> None: ...

class RunError(_message.Message):
    __slots__ = ("run_id", "component", "message", "occurrences", "unix_time", "fatal")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCES_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    component: str
    message: str
    occurrences: int
    unix_time: float
    fatal: bool
    def __init__(self, run_id: _Optional[str] = ..., component: _Optional[str] = ..., message: _Optional[str] = ..., occurrences: _Optional[int] = ..., unix_time: _Optional[float] = ..., fatal: _Optional[bool] = ...) -> None: ...
