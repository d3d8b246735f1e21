from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GradeAnswerRequest(_message.Message):
    __slots__ = ("question", "response", "correct_answer")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CORRECT_ANSWER_FIELD_NUMBER: _ClassVar[int]
    question: str
    response: str
    correct_answer: str
    def __init__(self, question: _Optional[str] = ..., response: _Optional[str] = ..., correct_answer: _Optional[str] = ...) -> None: ...

class GradeAnswerResponse(_message.Message):
    __slots__ = ("correct", "extracted_final_answer", "reasoning", "confidence", "parse_error", "grader_version", "cached", "method")
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    EXTRACTED_FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    PARSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    GRADER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    correct: bool
    extracted_final_answer: str
    reasoning: str
    confidence: float
    parse_error: bool
    grader_version: str
    cached: bool
    method: str
    def __init__(self, correct: _Optional[bool] = ..., extracted_final_answer: _Optional[str] = ..., reasoning: _Optional[str] = ..., confidence: _Optional[float] = ..., parse_error: _Optional[bool] = ..., grader_version: _Optional[str] = ..., cached: _Optional[bool] = ..., method: _Optional[str] = ...) -> None: ...

class GradeContributionRequest(_message.Message):
    __slots__ = ("question", "task", "report", "final_answer", "gold_answer")
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    GOLD_ANSWER_FIELD_NUMBER: _ClassVar[int]
    question: str
    task: str
    report: str
    final_answer: str
    gold_answer: str
    def __init__(self, question: _Optional[str] = ..., task: _Optional[str] = ..., report: _Optional[str] = ..., final_answer: _Optional[str] = ..., gold_answer: _Optional[str] = ...) -> None: ...

class GradeContributionResponse(_message.Message):
    __slots__ = ("score", "label", "reasoning", "parse_error", "grader_version", "cached", "method")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    PARSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    GRADER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    score: float
    label: str
    reasoning: str
    parse_error: bool
    grader_version: str
    cached: bool
    method: str
    def __init__(self, score: _Optional[float] = ..., label: _Optional[str] = ..., reasoning: _Optional[str] = ..., parse_error: _Optional[bool] = ..., grader_version: _Optional[str] = ..., cached: _Optional[bool] = ..., method: _Optional[str] = ...) -> None: ...

class BatchGradeAnswerRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GradeAnswerRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[GradeAnswerRequest, _Mapping]]] = ...) -> None: ...

class BatchGradeAnswerResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GradeAnswerResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GradeAnswerResponse, _Mapping]]] = ...) -> None: ...

class BatchGradeContributionRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GradeContributionRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[GradeContributionRequest, _Mapping]]] = ...) -> None: ...

class BatchGradeContributionResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GradeContributionResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GradeContributionResponse, _Mapping]]] = ...) -> None: ...
