from recserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("header", "prompt_tokens", "prompt", "max_new_tokens", "temperature", "seed")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    prompt_tokens: _common_pb2.Tensor
    prompt: str
    max_new_tokens: int
    temperature: float
    seed: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., prompt_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "tokens", "text", "finished", "finish_reason", "emitted_unix_us")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    EMITTED_UNIX_US_FIELD_NUMBER: _ClassVar[int]
    index: int
    tokens: _common_pb2.Tensor
    text: str
    finished: bool
    finish_reason: str
    emitted_unix_us: int
    def __init__(self, index: _Optional[int] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., emitted_unix_us: _Optional[int] = ...) -> None: ...
