from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("reward", "task_json", "completion", "rollout_id", "transcript", "environment_reward", "reward_config_json")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    reward: str
    task_json: str
    completion: str
    rollout_id: str
    transcript: str
    environment_reward: float
    reward_config_json: str
    def __init__(self, reward: _Optional[str] = ..., task_json: _Optional[str] = ..., completion: _Optional[str] = ..., rollout_id: _Optional[str] = ..., transcript: _Optional[str] = ..., environment_reward: _Optional[float] = ..., reward_config_json: _Optional[str] = ...) -> None: ...

class ComponentScore(_message.Message):
    __slots__ = ("name", "score", "weight", "ok", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    score: float
    weight: float
    ok: bool
    reason: str
    def __init__(self, name: _Optional[str] = ..., score: _Optional[float] = ..., weight: _Optional[float] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("score", "components", "ok", "plugin_error")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_ERROR_FIELD_NUMBER: _ClassVar[int]
    score: float
    components: _containers.RepeatedCompositeFieldContainer[ComponentScore]
    ok: bool
    plugin_error: str
    def __init__(self, score: _Optional[float] = ..., components: _Optional[_Iterable[_Union[ComponentScore, _Mapping]]] = ..., ok: _Optional[bool] = ..., plugin_error: _Optional[str] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("name", "kind", "description", "plugin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    description: str
    plugin: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ..., plugin: _Optional[str] = ...) -> None: ...

class LoadRewardRequest(_message.Message):
    __slots__ = ("reward", "config_json", "trials")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    reward: str
    config_json: str
    trials: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, reward: _Optional[str] = ..., config_json: _Optional[str] = ..., trials: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class LoadRewardResponse(_message.Message):
    __slots__ = ("reward", "trials")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TRIALS_FIELD_NUMBER: _ClassVar[int]
    reward: RewardInfo
    trials: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, reward: _Optional[_Union[RewardInfo, _Mapping]] = ..., trials: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...

class ListRewardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRewardsResponse(_message.Message):
    __slots__ = ("rewards",)
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardInfo]
    def __init__(self, rewards: _Optional[_Iterable[_Union[RewardInfo, _Mapping]]] = ...) -> None: ...
