from core.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatTask(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.Message, _Mapping]]] = ...) -> None: ...

class BranchTask(_message.Message):
    __slots__ = ("description", "prompt")
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    description: str
    prompt: str
    def __init__(self, description: _Optional[str] = ..., prompt: _Optional[str] = ...) -> None: ...

class RunWorkerEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "question_id", "group_id", "chat", "branch", "budget", "sampling", "gold_answer")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GOLD_ANSWER_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    question_id: str
    group_id: str
    chat: ChatTask
    branch: BranchTask
    budget: _common_pb2.BudgetOverrides
    sampling: _common_pb2.SamplingOverrides
    gold_answer: str
    def __init__(self, episode_id: _Optional[str] = ..., question_id: _Optional[str] = ..., group_id: _Optional[str] = ..., chat: _Optional[_Union[ChatTask, _Mapping]] = ..., branch: _Optional[_Union[BranchTask, _Mapping]] = ..., budget: _Optional[_Union[_common_pb2.BudgetOverrides, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOverrides, _Mapping]] = ..., gold_answer: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("prompt_start", "gen_start", "gen_end", "generated_tokens", "weight_version", "finish_reason", "version_spans")
    PROMPT_START_FIELD_NUMBER: _ClassVar[int]
    GEN_START_FIELD_NUMBER: _ClassVar[int]
    GEN_END_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    prompt_start: int
    gen_start: int
    gen_end: int
    generated_tokens: int
    weight_version: str
    finish_reason: str
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    def __init__(self, prompt_start: _Optional[int] = ..., gen_start: _Optional[int] = ..., gen_end: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., weight_version: _Optional[str] = ..., finish_reason: _Optional[str] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: str
    start: int
    end: int
    def __init__(self, version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ToolCallRecord(_message.Message):
    __slots__ = ("turn", "name", "params", "outcome", "error", "docids")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TURN_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DOCIDS_FIELD_NUMBER: _ClassVar[int]
    turn: int
    name: str
    params: _containers.ScalarMap[str, str]
    outcome: str
    error: str
    docids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, turn: _Optional[int] = ..., name: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ..., docids: _Optional[_Iterable[str]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("token_ids", "loss_mask", "rollout_logprobs", "turns", "tool_calls", "stop_reason", "tokens_used", "turns_used", "error", "events")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    TURNS_USED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallRecord]
    stop_reason: _common_pb2.StopReason
    tokens_used: int
    turns_used: int
    error: str
    events: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallRecord, _Mapping]]] = ..., stop_reason: _Optional[_Union[_common_pb2.StopReason, str]] = ..., tokens_used: _Optional[int] = ..., turns_used: _Optional[int] = ..., error: _Optional[str] = ..., events: _Optional[_Iterable[str]] = ...) -> None: ...

class RunWorkerEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "report", "trajectory", "usage")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    report: _common_pb2.WorkerReport
    trajectory: Trajectory
    usage: _common_pb2.Usage
    def __init__(self, episode_id: _Optional[str] = ..., report: _Optional[_Union[_common_pb2.WorkerReport, _Mapping]] = ..., trajectory: _Optional[_Union[Trajectory, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class RunWorkerEpisodesRequest(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[RunWorkerEpisodeRequest]
    def __init__(self, episodes: _Optional[_Iterable[_Union[RunWorkerEpisodeRequest, _Mapping]]] = ...) -> None: ...
