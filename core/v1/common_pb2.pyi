from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP_REASON_FINISH: _ClassVar[StopReason]
    STOP_REASON_BUDGET: _ClassVar[StopReason]
    STOP_REASON_TURNS: _ClassVar[StopReason]
    STOP_REASON_CONTEXT: _ClassVar[StopReason]
    STOP_REASON_ERROR: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
STOP_REASON_FINISH: StopReason
STOP_REASON_BUDGET: StopReason
STOP_REASON_TURNS: StopReason
STOP_REASON_CONTEXT: StopReason
STOP_REASON_ERROR: StopReason

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "observation_tokens", "total_tokens", "turns", "tool_calls")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    observation_tokens: int
    total_tokens: int
    turns: int
    tool_calls: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., observation_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., turns: _Optional[int] = ..., tool_calls: _Optional[int] = ...) -> None: ...

class BudgetOverrides(_message.Message):
    __slots__ = ("max_tokens", "max_turns", "max_new_tokens", "context_length")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    max_turns: int
    max_new_tokens: int
    context_length: int
    def __init__(self, max_tokens: _Optional[int] = ..., max_turns: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., context_length: _Optional[int] = ...) -> None: ...

class SamplingOverrides(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("answer", "explanation", "confidence", "stop_reason", "raw_text", "episode_id")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    answer: str
    explanation: str
    confidence: str
    stop_reason: StopReason
    raw_text: str
    episode_id: str
    def __init__(self, answer: _Optional[str] = ..., explanation: _Optional[str] = ..., confidence: _Optional[str] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., raw_text: _Optional[str] = ..., episode_id: _Optional[str] = ...) -> None: ...
