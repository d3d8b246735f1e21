from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SearchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEARCH_MODE_HYBRID: _ClassVar[SearchMode]
    SEARCH_MODE_LEXICAL: _ClassVar[SearchMode]
    SEARCH_MODE_DENSE: _ClassVar[SearchMode]
SEARCH_MODE_HYBRID: SearchMode
SEARCH_MODE_LEXICAL: SearchMode
SEARCH_MODE_DENSE: SearchMode

class SearchRequest(_message.Message):
    __slots__ = ("query", "k", "mode", "window", "snippet_words")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SNIPPET_WORDS_FIELD_NUMBER: _ClassVar[int]
    query: str
    k: int
    mode: SearchMode
    window: int
    snippet_words: int
    def __init__(self, query: _Optional[str] = ..., k: _Optional[int] = ..., mode: _Optional[_Union[SearchMode, str]] = ..., window: _Optional[int] = ..., snippet_words: _Optional[int] = ...) -> None: ...

class SearchHit(_message.Message):
    __slots__ = ("docid", "url", "text", "score", "lexical_rank", "lexical_score", "dense_rank", "dense_score", "title")
    DOCID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LEXICAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    DENSE_RANK_FIELD_NUMBER: _ClassVar[int]
    DENSE_SCORE_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    docid: str
    url: str
    text: str
    score: float
    lexical_rank: int
    lexical_score: float
    dense_rank: int
    dense_score: float
    title: str
    def __init__(self, docid: _Optional[str] = ..., url: _Optional[str] = ..., text: _Optional[str] = ..., score: _Optional[float] = ..., lexical_rank: _Optional[int] = ..., lexical_score: _Optional[float] = ..., dense_rank: _Optional[int] = ..., dense_score: _Optional[float] = ..., title: _Optional[str] = ...) -> None: ...

class SearchTimings(_message.Message):
    __slots__ = ("lexical_seconds", "embed_seconds", "dense_seconds", "fuse_seconds", "fetch_seconds", "total_seconds")
    LEXICAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EMBED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lexical_seconds: float
    embed_seconds: float
    dense_seconds: float
    fuse_seconds: float
    fetch_seconds: float
    total_seconds: float
    def __init__(self, lexical_seconds: _Optional[float] = ..., embed_seconds: _Optional[float] = ..., dense_seconds: _Optional[float] = ..., fuse_seconds: _Optional[float] = ..., fetch_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("hits", "degraded", "degraded_backend", "timings")
    HITS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[SearchHit]
    degraded: bool
    degraded_backend: str
    timings: SearchTimings
    def __init__(self, hits: _Optional[_Iterable[_Union[SearchHit, _Mapping]]] = ..., degraded: _Optional[bool] = ..., degraded_backend: _Optional[str] = ..., timings: _Optional[_Union[SearchTimings, _Mapping]] = ...) -> None: ...

class BatchSearchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SearchRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[SearchRequest, _Mapping]]] = ...) -> None: ...

class BatchSearchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[SearchResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[SearchResponse, _Mapping]]] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("docid", "url")
    DOCID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    docid: str
    url: str
    def __init__(self, docid: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("docid", "url", "text", "title")
    DOCID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    docid: str
    url: str
    text: str
    title: str
    def __init__(self, docid: _Optional[str] = ..., url: _Optional[str] = ..., text: _Optional[str] = ..., title: _Optional[str] = ...) -> None: ...
