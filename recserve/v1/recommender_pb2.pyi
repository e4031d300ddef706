from recserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecommendRequest(_message.Message):
    __slots__ = ("header", "user_id", "k", "exclude_ids", "recent_item_ids")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_IDS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    user_id: int
    k: int
    exclude_ids: _common_pb2.Tensor
    recent_item_ids: _common_pb2.Tensor
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., user_id: _Optional[int] = ..., k: _Optional[int] = ..., exclude_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., recent_item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("stage", "budget_ms", "elapsed_ms", "in_count", "out_count", "degraded", "degraded_reason", "coverage")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    IN_COUNT_FIELD_NUMBER: _ClassVar[int]
    OUT_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    budget_ms: float
    elapsed_ms: float
    in_count: int
    out_count: int
    degraded: bool
    degraded_reason: str
    coverage: float
    def __init__(self, stage: _Optional[str] = ..., budget_ms: _Optional[float] = ..., elapsed_ms: _Optional[float] = ..., in_count: _Optional[int] = ..., out_count: _Optional[int] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ..., coverage: _Optional[float] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("item_ids", "scores", "stages", "coverage", "degraded", "degraded_reason", "index_version", "model_version")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    item_ids: _common_pb2.Tensor
    scores: _common_pb2.Tensor
    stages: _containers.RepeatedCompositeFieldContainer[StageReport]
    coverage: float
    degraded: bool
    degraded_reason: str
    index_version: str
    model_version: str
    def __init__(self, item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stages: _Optional[_Iterable[_Union[StageReport, _Mapping]]] = ..., coverage: _Optional[float] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ..., index_version: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...
