from core.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoordinatorOverrides(_message.Message):
    __slots__ = ("max_turns", "max_branches", "wall_time_seconds")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    max_branches: int
    wall_time_seconds: float
    def __init__(self, max_turns: _Optional[int] = ..., max_branches: _Optional[int] = ..., wall_time_seconds: _Optional[float] = ...) -> None: ...

class RunCoordinatorEpisodeRequest(_message.Message):
    __slots__ = ("question", "question_id", "gold_answer", "overrides", "episode_id", "worker_budget", "group_id", "worker_sampling", "worker_gold")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    GOLD_ANSWER_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WORKER_GOLD_FIELD_NUMBER: _ClassVar[int]
    question: str
    question_id: str
    gold_answer: str
    overrides: CoordinatorOverrides
    episode_id: str
    worker_budget: _common_pb2.BudgetOverrides
    group_id: str
    worker_sampling: _common_pb2.SamplingOverrides
    worker_gold: bool
    def __init__(self, question: _Optional[str] = ..., question_id: _Optional[str] = ..., gold_answer: _Optional[str] = ..., overrides: _Optional[_Union[CoordinatorOverrides, _Mapping]] = ..., episode_id: _Optional[str] = ..., worker_budget: _Optional[_Union[_common_pb2.BudgetOverrides, _Mapping]] = ..., group_id: _Optional[str] = ..., worker_sampling: _Optional[_Union[_common_pb2.SamplingOverrides, _Mapping]] = ..., worker_gold: _Optional[bool] = ...) -> None: ...

class RunCoordinatorEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "answer", "explanation", "confidence", "worker_reports", "usage", "status", "endpoint", "weight_versions", "worker_usage", "error", "question_id", "seconds")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    WORKER_REPORTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WORKER_USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    answer: str
    explanation: str
    confidence: str
    worker_reports: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerReport]
    usage: _common_pb2.Usage
    status: str
    endpoint: str
    weight_versions: _containers.RepeatedScalarFieldContainer[str]
    worker_usage: _common_pb2.Usage
    error: str
    question_id: str
    seconds: float
    def __init__(self, episode_id: _Optional[str] = ..., answer: _Optional[str] = ..., explanation: _Optional[str] = ..., confidence: _Optional[str] = ..., worker_reports: _Optional[_Iterable[_Union[_common_pb2.WorkerReport, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., status: _Optional[str] = ..., endpoint: _Optional[str] = ..., weight_versions: _Optional[_Iterable[str]] = ..., worker_usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[str] = ..., question_id: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
