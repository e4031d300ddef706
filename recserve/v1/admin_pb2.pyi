from recserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RefreshIndexRequest(_message.Message):
    __slots__ = ("header", "index_path", "admin_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INDEX_PATH_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    index_path: str
    admin_token: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., index_path: _Optional[str] = ..., admin_token: _Optional[str] = ...) -> None: ...

class RefreshIndexResponse(_message.Message):
    __slots__ = ("index_version", "previous_version", "items", "seconds")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    previous_version: str
    items: int
    seconds: float
    def __init__(self, index_version: _Optional[str] = ..., previous_version: _Optional[str] = ..., items: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AddItemsRequest(_message.Message):
    __slots__ = ("header", "item_ids", "categories", "tag_ids", "tag_lengths", "admin_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    TAG_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    item_ids: _common_pb2.Tensor
    categories: _common_pb2.Tensor
    tag_ids: _common_pb2.Tensor
    tag_lengths: _common_pb2.Tensor
    admin_token: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., item_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., categories: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tag_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tag_lengths: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admin_token: _Optional[str] = ...) -> None: ...

class AddItemsResponse(_message.Message):
    __slots__ = ("index_version", "added", "upserted_rows", "vectors", "num_items")
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    UPSERTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    index_version: str
    added: int
    upserted_rows: int
    vectors: _common_pb2.Tensor
    num_items: int
    def __init__(self, index_version: _Optional[str] = ..., added: _Optional[int] = ..., upserted_rows: _Optional[int] = ..., vectors: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_items: _Optional[int] = ...) -> None: ...

class ReloadModelsRequest(_message.Message):
    __slots__ = ("header", "models_dir", "model_version", "admin_token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODELS_DIR_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    models_dir: str
    model_version: str
    admin_token: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., models_dir: _Optional[str] = ..., model_version: _Optional[str] = ..., admin_token: _Optional[str] = ...) -> None: ...

class ReloadModelsResponse(_message.Message):
    __slots__ = ("model_version", "previous_version", "tables", "load_seconds")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    previous_version: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    load_seconds: float
    def __init__(self, model_version: _Optional[str] = ..., previous_version: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class ModelStatusRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class ModelStatusResponse(_message.Message):
    __slots__ = ("model_version", "models_dir", "models", "tables", "reloads", "forwards", "requests", "lookup_windows", "lookup_ids", "lookup_unique_ids")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_DIR_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_IDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_UNIQUE_IDS_FIELD_NUMBER: _ClassVar[int]
    model_version: str
    models_dir: str
    models: _containers.RepeatedScalarFieldContainer[str]
    tables: _containers.RepeatedScalarFieldContainer[str]
    reloads: int
    forwards: int
    requests: int
    lookup_windows: int
    lookup_ids: int
    lookup_unique_ids: int
    def __init__(self, model_version: _Optional[str] = ..., models_dir: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., tables: _Optional[_Iterable[str]] = ..., reloads: _Optional[int] = ..., forwards: _Optional[int] = ..., requests: _Optional[int] = ..., lookup_windows: _Optional[int] = ..., lookup_ids: _Optional[int] = ..., lookup_unique_ids: _Optional[int] = ...) -> None: ...
