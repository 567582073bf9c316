from looprl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextBatchRequest(_message.Message):
    __slots__ = ("run_id", "step", "rank", "world_size", "trainer_version", "timeout_seconds")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    rank: int
    world_size: int
    trainer_version: int
    timeout_seconds: float
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., trainer_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("step", "rank", "index", "count", "input_ids", "position_ids", "cu_seqlens", "loss_mask", "advantages", "behaviour_logprobs", "versions", "rollout_ids", "num_tokens", "global_loss_tokens", "global_sequences", "step_reward_mean", "step_reward_std", "rollout_traceparents")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    STEP_REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    index: int
    count: int
    input_ids: _common_pb2.Tensor
    position_ids: _common_pb2.Tensor
    cu_seqlens: _common_pb2.Tensor
    loss_mask: _common_pb2.Tensor
    advantages: _common_pb2.Tensor
    behaviour_logprobs: _common_pb2.Tensor
    versions: _common_pb2.Tensor
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    global_loss_tokens: int
    global_sequences: int
    step_reward_mean: float
    step_reward_std: float
    rollout_traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., input_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., cu_seqlens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., loss_mask: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., behaviour_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., versions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., global_loss_tokens: _Optional[int] = ..., global_sequences: _Optional[int] = ..., step_reward_mean: _Optional[float] = ..., step_reward_std: _Optional[float] = ..., rollout_traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class NextBatchResponse(_message.Message):
    __slots__ = ("micro_batch",)
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    micro_batch: MicroBatch
    def __init__(self, micro_batch: _Optional[_Union[MicroBatch, _Mapping]] = ...) -> None: ...

class AckStepRequest(_message.Message):
    __slots__ = ("run_id", "step", "trainer_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    trainer_version: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class AckStepResponse(_message.Message):
    __slots__ = ("acked_rollouts",)
    ACKED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    acked_rollouts: int
    def __init__(self, acked_rollouts: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("queued_rollouts", "pending_groups", "padding_fraction", "rank_imbalance", "dropped", "packed_steps", "acked_rollouts")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PADDING_FRACTION_FIELD_NUMBER: _ClassVar[int]
    RANK_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PACKED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACKED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    queued_rollouts: int
    pending_groups: int
    padding_fraction: float
    rank_imbalance: float
    dropped: _containers.ScalarMap[str, int]
    packed_steps: int
    acked_rollouts: int
    def __init__(self, queued_rollouts: _Optional[int] = ..., pending_groups: _Optional[int] = ..., padding_fraction: _Optional[float] = ..., rank_imbalance: _Optional[float] = ..., dropped: _Optional[_Mapping[str, int]] = ..., packed_steps: _Optional[int] = ..., acked_rollouts: _Optional[int] = ...) -> None: ...
