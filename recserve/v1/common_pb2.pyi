from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    CRITICAL: _ClassVar[Priority]
    STANDARD: _ClassVar[Priority]
    BEST_EFFORT: _ClassVar[Priority]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    INT8_ROWWISE: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    UINT8: _ClassVar[DType]
PRIORITY_UNSPECIFIED: Priority
CRITICAL: Priority
STANDARD: Priority
BEST_EFFORT: Priority
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
INT8_ROWWISE: DType
INT64: DType
INT32: DType
UINT8: DType

class RequestHeader(_message.Message):
    __slots__ = ("request_id", "tenant", "priority", "deadline_unix_ms", "session_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    priority: Priority
    deadline_unix_ms: int
    session_key: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_unix_ms: _Optional[int] = ..., session_key: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...
