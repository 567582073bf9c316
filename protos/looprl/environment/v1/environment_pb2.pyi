from looprl.common.v1 import common_pb2 as _common_pb2
from looprl.events.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class RunEpisodeRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _events_pb2.EpisodeTask
    def __init__(self, task: _Optional[_Union[_events_pb2.EpisodeTask, _Mapping]] = ...) -> None: ...

class RunEpisodeResponse(_message.Message):
    __slots__ = ("rollout", "rollouts")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollout: _common_pb2.Rollout
    rollouts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Rollout]
    def __init__(self, rollout: _Optional[_Union[_common_pb2.Rollout, _Mapping]] = ..., rollouts: _Optional[_Iterable[_Union[_common_pb2.Rollout, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("environment", "task_json", "session_id")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    environment: str
    task_json: str
    session_id: str
    def __init__(self, environment: _Optional[str] = ..., task_json: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "observation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, session_id: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    observation: _containers.RepeatedCompositeFieldContainer[Message]
    reward: float
    done: bool
    info: _containers.ScalarMap[str, str]
    def __init__(self, observation: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("language", "code", "stdin", "files", "timeout_seconds", "memory_bytes")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    language: str
    code: str
    stdin: str
    files: _containers.ScalarMap[str, str]
    timeout_seconds: float
    memory_bytes: int
    def __init__(self, language: _Optional[str] = ..., code: _Optional[str] = ..., stdin: _Optional[str] = ..., files: _Optional[_Mapping[str, str]] = ..., timeout_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("exit_code", "stdout", "stderr", "timed_out", "killed_reason", "wall_seconds", "output_truncated", "isolation", "missing_isolation", "warm", "memory_peak_bytes")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    KILLED_REASON_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    MISSING_ISOLATION_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str
    wall_seconds: float
    output_truncated: bool
    isolation: _containers.RepeatedScalarFieldContainer[str]
    missing_isolation: _containers.RepeatedScalarFieldContainer[str]
    warm: bool
    memory_peak_bytes: int
    def __init__(self, exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., timed_out: _Optional[bool] = ..., killed_reason: _Optional[str] = ..., wall_seconds: _Optional[float] = ..., output_truncated: _Optional[bool] = ..., isolation: _Optional[_Iterable[str]] = ..., missing_isolation: _Optional[_Iterable[str]] = ..., warm: _Optional[bool] = ..., memory_peak_bytes: _Optional[int] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "description", "multi_turn", "default_reward", "plugin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MULTI_TURN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_REWARD_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    multi_turn: bool
    default_reward: str
    plugin: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., multi_turn: _Optional[bool] = ..., default_reward: _Optional[str] = ..., plugin: _Optional[str] = ...) -> None: ...

class LoadEnvironmentRequest(_message.Message):
    __slots__ = ("environment", "environment_config_json", "dataset_json", "tokenizer", "max_prompt_tokens")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DATASET_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    environment: str
    environment_config_json: str
    dataset_json: str
    tokenizer: str
    max_prompt_tokens: int
    def __init__(self, environment: _Optional[str] = ..., environment_config_json: _Optional[str] = ..., dataset_json: _Optional[str] = ..., tokenizer: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class DatasetSummary(_message.Message):
    __slots__ = ("rows", "train_rows", "eval_rows", "filtered_too_long", "max_prompt_tokens", "longest_prompt_tokens", "sources")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_TOO_LONG_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LONGEST_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    train_rows: int
    eval_rows: int
    filtered_too_long: int
    max_prompt_tokens: int
    longest_prompt_tokens: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rows: _Optional[int] = ..., train_rows: _Optional[int] = ..., eval_rows: _Optional[int] = ..., filtered_too_long: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., longest_prompt_tokens: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadEnvironmentResponse(_message.Message):
    __slots__ = ("environment", "dataset", "first_task_json", "first_answer")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FIRST_TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    FIRST_ANSWER_FIELD_NUMBER: _ClassVar[int]
    environment: EnvironmentInfo
    dataset: DatasetSummary
    first_task_json: str
    first_answer: str
    def __init__(self, environment: _Optional[_Union[EnvironmentInfo, _Mapping]] = ..., dataset: _Optional[_Union[DatasetSummary, _Mapping]] = ..., first_task_json: _Optional[str] = ..., first_answer: _Optional[str] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments", "sandbox")
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    sandbox: SandboxStatus
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ..., sandbox: _Optional[_Union[SandboxStatus, _Mapping]] = ...) -> None: ...

class SandboxStatus(_message.Message):
    __slots__ = ("isolation_level", "isolation", "missing_isolation", "unavailable", "memory_bytes", "pids", "cpu_quota", "workspace_bytes", "cgroup")
    ISOLATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    MISSING_ISOLATION_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CGROUP_FIELD_NUMBER: _ClassVar[int]
    isolation_level: str
    isolation: _containers.RepeatedScalarFieldContainer[str]
    missing_isolation: _containers.RepeatedScalarFieldContainer[str]
    unavailable: str
    memory_bytes: int
    pids: int
    cpu_quota: float
    workspace_bytes: int
    cgroup: str
    def __init__(self, isolation_level: _Optional[str] = ..., isolation: _Optional[_Iterable[str]] = ..., missing_isolation: _Optional[_Iterable[str]] = ..., unavailable: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., cpu_quota: _Optional[float] = ..., workspace_bytes: _Optional[int] = ..., cgroup: _Optional[str] = ...) -> None: ...
