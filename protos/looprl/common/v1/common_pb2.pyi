from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    D_TYPE_UNSPECIFIED: _ClassVar[DType]
    D_TYPE_FLOAT32: _ClassVar[DType]
    D_TYPE_FLOAT16: _ClassVar[DType]
    D_TYPE_BFLOAT16: _ClassVar[DType]
    D_TYPE_INT32: _ClassVar[DType]
    D_TYPE_INT64: _ClassVar[DType]
    D_TYPE_BOOL: _ClassVar[DType]
    D_TYPE_UINT8: _ClassVar[DType]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_ENVIRONMENT: _ClassVar[Role]
D_TYPE_UNSPECIFIED: DType
D_TYPE_FLOAT32: DType
D_TYPE_FLOAT16: DType
D_TYPE_BFLOAT16: DType
D_TYPE_INT32: DType
D_TYPE_INT64: DType
D_TYPE_BOOL: DType
D_TYPE_UINT8: DType
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_ENVIRONMENT: Role

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "n", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("role", "token_ids", "logprobs", "trainable", "weight_version", "text", "deployment", "adapter")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    role: Role
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    trainable: bool
    weight_version: int
    text: str
    deployment: str
    adapter: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., trainable: _Optional[bool] = ..., weight_version: _Optional[int] = ..., text: _Optional[str] = ..., deployment: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("rollout_id", "run_id", "group_id", "task_id", "environment", "turns", "reward", "reward_components", "group_size", "sample_index", "min_weight_version", "max_weight_version", "generation_seconds", "environment_seconds", "finish_reason", "task_source")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TASK_SOURCE_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    run_id: str
    group_id: str
    task_id: str
    environment: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    group_size: int
    sample_index: int
    min_weight_version: int
    max_weight_version: int
    generation_seconds: float
    environment_seconds: float
    finish_reason: str
    task_source: str
    def __init__(self, rollout_id: _Optional[str] = ..., run_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., environment: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., group_size: _Optional[int] = ..., sample_index: _Optional[int] = ..., min_weight_version: _Optional[int] = ..., max_weight_version: _Optional[int] = ..., generation_seconds: _Optional[float] = ..., environment_seconds: _Optional[float] = ..., finish_reason: _Optional[str] = ..., task_source: _Optional[str] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...
