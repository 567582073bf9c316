from looprl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardChunk(_message.Message):
    __slots__ = ("name", "dtype", "global_shape", "row_offset", "rows", "data", "crc32", "hash64")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    HASH64_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    row_offset: int
    rows: int
    data: bytes
    crc32: int
    hash64: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., global_shape: _Optional[_Iterable[int]] = ..., row_offset: _Optional[int] = ..., rows: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., hash64: _Optional[int] = ...) -> None: ...

class PushShardsRequest(_message.Message):
    __slots__ = ("version", "trainer_rank", "trainer_world_size", "shards", "last", "run_id", "model_config_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINER_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    trainer_rank: int
    trainer_world_size: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardChunk]
    last: bool
    run_id: str
    model_config_json: str
    def __init__(self, version: _Optional[int] = ..., trainer_rank: _Optional[int] = ..., trainer_world_size: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardChunk, _Mapping]]] = ..., last: _Optional[bool] = ..., run_id: _Optional[str] = ..., model_config_json: _Optional[str] = ...) -> None: ...

class PushShardsResponse(_message.Message):
    __slots__ = ("version", "bytes_received", "version_complete")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    VERSION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    version_complete: bool
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., version_complete: _Optional[bool] = ...) -> None: ...

class TargetRank(_message.Message):
    __slots__ = ("rank", "address", "same_host", "replica", "host_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    same_host: bool
    replica: str
    host_id: str
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., same_host: _Optional[bool] = ..., replica: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class TargetLayout(_message.Message):
    __slots__ = ("tensor_parallel", "naming", "dtype")
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    NAMING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel: int
    naming: str
    dtype: _common_pb2.DType
    def __init__(self, tensor_parallel: _Optional[int] = ..., naming: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class RegisterTargetRequest(_message.Message):
    __slots__ = ("deployment", "layout", "ranks", "every_k_versions", "canary", "run_id", "model_config_json", "canary_policy", "weight_transport", "adapter")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EVERY_K_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CANARY_POLICY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    layout: TargetLayout
    ranks: _containers.RepeatedCompositeFieldContainer[TargetRank]
    every_k_versions: int
    canary: bool
    run_id: str
    model_config_json: str
    canary_policy: CanaryPolicy
    weight_transport: str
    adapter: str
    def __init__(self, deployment: _Optional[str] = ..., layout: _Optional[_Union[TargetLayout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[TargetRank, _Mapping]]] = ..., every_k_versions: _Optional[int] = ..., canary: _Optional[bool] = ..., run_id: _Optional[str] = ..., model_config_json: _Optional[str] = ..., canary_policy: _Optional[_Union[CanaryPolicy, _Mapping]] = ..., weight_transport: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class GoldenPrompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CanaryPolicy(_message.Message):
    __slots__ = ("prompts", "tokens_per_prompt", "max_logprob_drift")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROB_DRIFT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[GoldenPrompt]
    tokens_per_prompt: int
    max_logprob_drift: float
    def __init__(self, prompts: _Optional[_Iterable[_Union[GoldenPrompt, _Mapping]]] = ..., tokens_per_prompt: _Optional[int] = ..., max_logprob_drift: _Optional[float] = ...) -> None: ...

class RegisterTargetResponse(_message.Message):
    __slots__ = ("current_version",)
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    def __init__(self, current_version: _Optional[int] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TargetVersion(_message.Message):
    __slots__ = ("deployment", "version", "state", "last_error", "last_bytes", "last_sync_seconds", "canary_drift", "canary_rejected_version", "routes", "run_id")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CANARY_DRIFT_FIELD_NUMBER: _ClassVar[int]
    CANARY_REJECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    version: int
    state: str
    last_error: str
    last_bytes: int
    last_sync_seconds: float
    canary_drift: float
    canary_rejected_version: int
    routes: _containers.RepeatedCompositeFieldContainer[DeliveryRoute]
    run_id: str
    def __init__(self, deployment: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[str] = ..., last_error: _Optional[str] = ..., last_bytes: _Optional[int] = ..., last_sync_seconds: _Optional[float] = ..., canary_drift: _Optional[float] = ..., canary_rejected_version: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[DeliveryRoute, _Mapping]]] = ..., run_id: _Optional[str] = ...) -> None: ...

class DeliveryRoute(_message.Message):
    __slots__ = ("replica", "rank", "address", "host_id", "transport", "reason", "bytes_delivered")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    replica: str
    rank: int
    address: str
    host_id: str
    transport: str
    reason: str
    bytes_delivered: int
    def __init__(self, replica: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., host_id: _Optional[str] = ..., transport: _Optional[str] = ..., reason: _Optional[str] = ..., bytes_delivered: _Optional[int] = ...) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("latest_version", "targets", "host_id", "latest_bytes_held")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    targets: _containers.RepeatedCompositeFieldContainer[TargetVersion]
    host_id: str
    latest_bytes_held: bool
    def __init__(self, latest_version: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[TargetVersion, _Mapping]]] = ..., host_id: _Optional[str] = ..., latest_bytes_held: _Optional[bool] = ...) -> None: ...

class RequestSyncRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class RequestSyncResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class UnregisterTargetRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class UnregisterTargetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
