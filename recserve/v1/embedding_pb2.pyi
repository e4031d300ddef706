from recserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableLookup(_message.Message):
    __slots__ = ("table", "ids", "bag_indices", "bag_offsets", "col_start", "col_end")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    BAG_INDICES_FIELD_NUMBER: _ClassVar[int]
    BAG_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    COL_START_FIELD_NUMBER: _ClassVar[int]
    COL_END_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _common_pb2.Tensor
    bag_indices: _common_pb2.Tensor
    bag_offsets: _common_pb2.Tensor
    col_start: int
    col_end: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bag_indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bag_offsets: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., col_start: _Optional[int] = ..., col_end: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("header", "tables", "row_dtype", "pooled", "plan_version")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    tables: _containers.RepeatedCompositeFieldContainer[TableLookup]
    row_dtype: _common_pb2.DType
    pooled: bool
    plan_version: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableLookup, _Mapping]]] = ..., row_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., pooled: _Optional[bool] = ..., plan_version: _Optional[int] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "rows", "found", "not_owned", "col_start", "col_end", "pooled", "bag_counts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NOT_OWNED_FIELD_NUMBER: _ClassVar[int]
    COL_START_FIELD_NUMBER: _ClassVar[int]
    COL_END_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    BAG_COUNTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: _common_pb2.Tensor
    found: _common_pb2.Tensor
    not_owned: _common_pb2.Tensor
    col_start: int
    col_end: int
    pooled: _common_pb2.Tensor
    bag_counts: _common_pb2.Tensor
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., found: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., not_owned: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., col_start: _Optional[int] = ..., col_end: _Optional[int] = ..., pooled: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., bag_counts: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("plan_version", "tables")
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    plan_version: int
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    def __init__(self, plan_version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ...) -> None: ...

class TableUpsert(_message.Message):
    __slots__ = ("table", "ids", "rows", "col_start", "col_end")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COL_START_FIELD_NUMBER: _ClassVar[int]
    COL_END_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _common_pb2.Tensor
    rows: _common_pb2.Tensor
    col_start: int
    col_end: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., col_start: _Optional[int] = ..., col_end: _Optional[int] = ...) -> None: ...

class UpsertRequest(_message.Message):
    __slots__ = ("header", "tables", "admin_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    tables: _containers.RepeatedCompositeFieldContainer[TableUpsert]
    admin_token: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableUpsert, _Mapping]]] = ..., admin_token: _Optional[str] = ...) -> None: ...

class UpsertResponse(_message.Message):
    __slots__ = ("rows_written", "plan_version")
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    rows_written: int
    plan_version: int
    def __init__(self, rows_written: _Optional[int] = ..., plan_version: _Optional[int] = ...) -> None: ...

class ShardInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableTierInfo(_message.Message):
    __slots__ = ("table", "rows", "dim", "hot_rows", "warm_rows", "warm_col_start", "warm_col_end", "cold_rows", "hot_bytes", "warm_bytes", "cold_bytes", "model_version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    HOT_ROWS_FIELD_NUMBER: _ClassVar[int]
    WARM_ROWS_FIELD_NUMBER: _ClassVar[int]
    WARM_COL_START_FIELD_NUMBER: _ClassVar[int]
    WARM_COL_END_FIELD_NUMBER: _ClassVar[int]
    COLD_ROWS_FIELD_NUMBER: _ClassVar[int]
    HOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARM_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: int
    dim: int
    hot_rows: int
    warm_rows: int
    warm_col_start: int
    warm_col_end: int
    cold_rows: int
    hot_bytes: int
    warm_bytes: int
    cold_bytes: int
    model_version: str
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., hot_rows: _Optional[int] = ..., warm_rows: _Optional[int] = ..., warm_col_start: _Optional[int] = ..., warm_col_end: _Optional[int] = ..., cold_rows: _Optional[int] = ..., hot_bytes: _Optional[int] = ..., warm_bytes: _Optional[int] = ..., cold_bytes: _Optional[int] = ..., model_version: _Optional[str] = ...) -> None: ...

class ShardInfoResponse(_message.Message):
    __slots__ = ("shard_id", "plan_version", "tables", "rpcs", "ids_requested", "rows_served_hot", "rows_served_warm", "rows_served_cold", "rows_missing", "rows_not_owned", "row_cache_hits", "row_cache_misses", "row_cache_hit_rate", "p50_ms", "p99_ms", "cpu_seconds", "rss_bytes", "upserts", "errors", "ready", "instance_id")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RPCS_FIELD_NUMBER: _ClassVar[int]
    IDS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_HOT_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_WARM_FIELD_NUMBER: _ClassVar[int]
    ROWS_SERVED_COLD_FIELD_NUMBER: _ClassVar[int]
    ROWS_MISSING_FIELD_NUMBER: _ClassVar[int]
    ROWS_NOT_OWNED_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ROW_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPSERTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    plan_version: int
    tables: _containers.RepeatedCompositeFieldContainer[TableTierInfo]
    rpcs: int
    ids_requested: int
    rows_served_hot: int
    rows_served_warm: int
    rows_served_cold: int
    rows_missing: int
    rows_not_owned: int
    row_cache_hits: int
    row_cache_misses: int
    row_cache_hit_rate: float
    p50_ms: float
    p99_ms: float
    cpu_seconds: float
    rss_bytes: int
    upserts: int
    errors: int
    ready: bool
    instance_id: str
    def __init__(self, shard_id: _Optional[int] = ..., plan_version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableTierInfo, _Mapping]]] = ..., rpcs: _Optional[int] = ..., ids_requested: _Optional[int] = ..., rows_served_hot: _Optional[int] = ..., rows_served_warm: _Optional[int] = ..., rows_served_cold: _Optional[int] = ..., rows_missing: _Optional[int] = ..., rows_not_owned: _Optional[int] = ..., row_cache_hits: _Optional[int] = ..., row_cache_misses: _Optional[int] = ..., row_cache_hit_rate: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., cpu_seconds: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., upserts: _Optional[int] = ..., errors: _Optional[int] = ..., ready: _Optional[bool] = ..., instance_id: _Optional[str] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan_version", "plan_json", "table_model_versions")
    class TableModelVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    TABLE_MODEL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    plan_version: int
    plan_json: str
    table_model_versions: _containers.ScalarMap[str, str]
    def __init__(self, plan_version: _Optional[int] = ..., plan_json: _Optional[str] = ..., table_model_versions: _Optional[_Mapping[str, str]] = ...) -> None: ...
