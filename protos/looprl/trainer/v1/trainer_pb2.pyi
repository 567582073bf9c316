from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "step", "weight_version", "world_size", "last_loss", "last_checkpoint", "state", "error")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    weight_version: int
    world_size: int
    last_loss: float
    last_checkpoint: str
    state: str
    error: str
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., world_size: _Optional[int] = ..., last_loss: _Optional[float] = ..., last_checkpoint: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("export_hf",)
    EXPORT_HF_FIELD_NUMBER: _ClassVar[int]
    export_hf: bool
    def __init__(self, export_hf: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("config_json",)
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    def __init__(self, config_json: _Optional[str] = ...) -> None: ...
