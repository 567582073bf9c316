from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "step", "weight_version", "world_size", "last_loss", "last_checkpoint", "state", "error", "runs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    weight_version: int
    world_size: int
    last_loss: float
    last_checkpoint: str
    state: str
    error: str
    runs: _containers.RepeatedCompositeFieldContainer[StatusResponse]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., world_size: _Optional[int] = ..., last_loss: _Optional[float] = ..., last_checkpoint: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., runs: _Optional[_Iterable[_Union[StatusResponse, _Mapping]]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("export_hf", "run_id")
    EXPORT_HF_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    export_hf: bool
    run_id: str
    def __init__(self, export_hf: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "hf_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HF_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    hf_path: str
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., hf_path: _Optional[str] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("config_json",)
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    def __init__(self, config_json: _Optional[str] = ...) -> None: ...
