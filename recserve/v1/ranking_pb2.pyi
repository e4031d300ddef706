from recserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankRequest(_message.Message):
    __slots__ = ("header", "user_id", "candidate_ids", "model", "history_item_ids")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    user_id: int
    candidate_ids: _common_pb2.Tensor
    model: str
    history_item_ids: _common_pb2.Tensor
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., user_id: _Optional[int] = ..., candidate_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., model: _Optional[str] = ..., history_item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("item_ids", "scores", "degraded", "degraded_reason", "missing_rows", "model_version", "model")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    MISSING_ROWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    item_ids: _common_pb2.Tensor
    scores: _common_pb2.Tensor
    degraded: bool
    degraded_reason: str
    missing_rows: int
    model_version: str
    model: str
    def __init__(self, item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ..., missing_rows: _Optional[int] = ..., model_version: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EmbedUserRequest(_message.Message):
    __slots__ = ("header", "user_id", "history_item_ids")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    user_id: int
    history_item_ids: _common_pb2.Tensor
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., user_id: _Optional[int] = ..., history_item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class EmbedUserResponse(_message.Message):
    __slots__ = ("vector", "model_version", "degraded", "degraded_reason", "missing_rows")
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    MISSING_ROWS_FIELD_NUMBER: _ClassVar[int]
    vector: _common_pb2.Tensor
    model_version: str
    degraded: bool
    degraded_reason: str
    missing_rows: int
    def __init__(self, vector: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., model_version: _Optional[str] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ..., missing_rows: _Optional[int] = ...) -> None: ...
