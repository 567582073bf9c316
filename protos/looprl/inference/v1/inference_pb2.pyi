from looprl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "session_id", "deployment", "min_weight_version", "request_id", "expected_output_tokens", "run_id", "version_wait_ms", "kv_transfer_params")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    session_id: str
    deployment: str
    min_weight_version: int
    request_id: str
    expected_output_tokens: int
    run_id: str
    version_wait_ms: int
    kv_transfer_params: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., deployment: _Optional[str] = ..., min_weight_version: _Optional[int] = ..., request_id: _Optional[str] = ..., expected_output_tokens: _Optional[int] = ..., run_id: _Optional[str] = ..., version_wait_ms: _Optional[int] = ..., kv_transfer_params: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "weight_version", "token_versions", "kv_versions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    weight_version: int
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    kv_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., token_versions: _Optional[_Iterable[int]] = ..., kv_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "deployment", "replica", "prompt_tokens", "adapter", "kv_transfer_params", "prefill_replica", "kv_transfer")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REPLICA_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    deployment: str
    replica: str
    prompt_tokens: int
    adapter: str
    kv_transfer_params: str
    prefill_replica: str
    kv_transfer: str
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., deployment: _Optional[str] = ..., replica: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., adapter: _Optional[str] = ..., kv_transfer_params: _Optional[str] = ..., prefill_replica: _Optional[str] = ..., kv_transfer: _Optional[str] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "weight_version", "finish_reason", "deployment", "replica", "adapter")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    finish_reason: str
    deployment: str
    replica: str
    adapter: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., finish_reason: _Optional[str] = ..., deployment: _Optional[str] = ..., replica: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class LengthProfile(_message.Message):
    __slots__ = ("min_prompt_tokens", "max_prompt_tokens", "min_output_tokens", "max_output_tokens")
    MIN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    min_prompt_tokens: int
    max_prompt_tokens: int
    min_output_tokens: int
    max_output_tokens: int
    def __init__(self, min_prompt_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., min_output_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("name", "healthy", "weight_version", "outstanding_tokens", "outstanding_requests", "address", "metrics_address", "role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    healthy: bool
    weight_version: int
    outstanding_tokens: int
    outstanding_requests: int
    address: str
    metrics_address: str
    role: str
    def __init__(self, name: _Optional[str] = ..., healthy: _Optional[bool] = ..., weight_version: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., outstanding_requests: _Optional[int] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class DeploymentInfo(_message.Message):
    __slots__ = ("name", "backend", "tensor_parallel", "profile", "replicas", "max_model_len", "layout", "dtype", "run_id", "split_decision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_DECISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: str
    tensor_parallel: int
    profile: LengthProfile
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    max_model_len: int
    layout: str
    dtype: str
    run_id: str
    split_decision: str
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., profile: _Optional[_Union[LengthProfile, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., max_model_len: _Optional[int] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., run_id: _Optional[str] = ..., split_decision: _Optional[str] = ...) -> None: ...

class ListDeploymentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDeploymentsResponse(_message.Message):
    __slots__ = ("deployments", "starts_run_deployments")
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    STARTS_RUN_DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentInfo]
    starts_run_deployments: bool
    def __init__(self, deployments: _Optional[_Iterable[_Union[DeploymentInfo, _Mapping]]] = ..., starts_run_deployments: _Optional[bool] = ...) -> None: ...

class RegisterDeploymentRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: DeploymentInfo
    def __init__(self, deployment: _Optional[_Union[DeploymentInfo, _Mapping]] = ...) -> None: ...

class RegisterDeploymentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterResourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterResourcesResponse(_message.Message):
    __slots__ = ("total", "in_use")
    class TotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class InUseEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    total: _containers.ScalarMap[str, float]
    in_use: _containers.ScalarMap[str, float]
    def __init__(self, total: _Optional[_Mapping[str, float]] = ..., in_use: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("weight_version", "queued_requests", "tokens_in_flight", "cache_usage", "paused", "staged_version", "rollback_version", "host_id", "holds_for_version", "adapter_versions", "metrics_address")
    class AdapterVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    queued_requests: int
    tokens_in_flight: int
    cache_usage: float
    paused: bool
    staged_version: int
    rollback_version: int
    host_id: str
    holds_for_version: bool
    adapter_versions: _containers.ScalarMap[str, int]
    metrics_address: str
    def __init__(self, weight_version: _Optional[int] = ..., queued_requests: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., cache_usage: _Optional[float] = ..., paused: _Optional[bool] = ..., staged_version: _Optional[int] = ..., rollback_version: _Optional[int] = ..., host_id: _Optional[str] = ..., holds_for_version: _Optional[bool] = ..., adapter_versions: _Optional[_Mapping[str, int]] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageWeightsRequest(_message.Message):
    __slots__ = ("version", "slices", "bucket_count", "bucket_index", "model_config_json", "deployment", "rank", "total_bytes", "device_handle", "nccl_broadcast", "commit_when_complete", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NCCL_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    COMMIT_WHEN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    slices: _containers.RepeatedCompositeFieldContainer[WeightSlice]
    bucket_count: int
    bucket_index: int
    model_config_json: str
    deployment: str
    rank: int
    total_bytes: int
    device_handle: bytes
    nccl_broadcast: bool
    commit_when_complete: bool
    adapter: str
    def __init__(self, version: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[WeightSlice, _Mapping]]] = ..., bucket_count: _Optional[int] = ..., bucket_index: _Optional[int] = ..., model_config_json: _Optional[str] = ..., deployment: _Optional[str] = ..., rank: _Optional[int] = ..., total_bytes: _Optional[int] = ..., device_handle: _Optional[bytes] = ..., nccl_broadcast: _Optional[bool] = ..., commit_when_complete: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class WeightSlice(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data", "crc32", "shm_name", "shm_offset", "nbytes", "hash64", "shm_rows", "shm_row_stride", "sum64", "shm_adopt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HASH64_FIELD_NUMBER: _ClassVar[int]
    SHM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SHM_ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SUM64_FIELD_NUMBER: _ClassVar[int]
    SHM_ADOPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    crc32: int
    shm_name: str
    shm_offset: int
    nbytes: int
    hash64: int
    shm_rows: int
    shm_row_stride: int
    sum64: int
    shm_adopt: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., hash64: _Optional[int] = ..., shm_rows: _Optional[int] = ..., shm_row_stride: _Optional[int] = ..., sum64: _Optional[int] = ..., shm_adopt: _Optional[bool] = ...) -> None: ...

class StageWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes_received", "complete", "serving_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    complete: bool
    serving_version: int
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., complete: _Optional[bool] = ..., serving_version: _Optional[int] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("version", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    adapter: str
    def __init__(self, version: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class CommitWeightsResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class AbortWeightsRequest(_message.Message):
    __slots__ = ("version", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    adapter: str
    def __init__(self, version: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class AbortWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeSharedMemoryRequest(_message.Message):
    __slots__ = ("segment", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    nbytes: int
    def __init__(self, segment: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ProbeSharedMemoryResponse(_message.Message):
    __slots__ = ("data", "host_id")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    host_id: str
    def __init__(self, data: _Optional[bytes] = ..., host_id: _Optional[str] = ...) -> None: ...

class RollbackWeightsRequest(_message.Message):
    __slots__ = ("version", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    adapter: str
    def __init__(self, version: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("kv_id",)
    KV_ID_FIELD_NUMBER: _ClassVar[int]
    kv_id: str
    def __init__(self, kv_id: _Optional[str] = ...) -> None: ...

class FetchKVResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RollbackWeightsResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...
