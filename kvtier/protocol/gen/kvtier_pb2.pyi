from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataEndpoint(_message.Message):
    __slots__ = ("kind", "address", "port", "tls")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    port: int
    tls: bool
    def __init__(self, kind: _Optional[str] = ..., address: _Optional[str] = ..., port: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("server_version", "key_bytes", "max_message_bytes", "max_chunk_bytes", "max_batch_keys", "data_endpoints", "tenant", "auth_required", "node_id")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    key_bytes: int
    max_message_bytes: int
    max_chunk_bytes: int
    max_batch_keys: int
    data_endpoints: _containers.RepeatedCompositeFieldContainer[DataEndpoint]
    tenant: str
    auth_required: bool
    node_id: str
    def __init__(self, server_version: _Optional[str] = ..., key_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., max_batch_keys: _Optional[int] = ..., data_endpoints: _Optional[_Iterable[_Union[DataEndpoint, _Mapping]]] = ..., tenant: _Optional[str] = ..., auth_required: _Optional[bool] = ..., node_id: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits", "reason")
    HITS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    hits: int
    reason: str
    def __init__(self, hits: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "chunk", "depth", "parent")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    chunk: bytes
    depth: int
    parent: bytes
    def __init__(self, key: _Optional[bytes] = ..., chunk: _Optional[bytes] = ..., depth: _Optional[int] = ..., parent: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, stored: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetItem(_message.Message):
    __slots__ = ("index", "chunk", "miss_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    chunk: bytes
    miss_reason: str
    def __init__(self, index: _Optional[int] = ..., chunk: _Optional[bytes] = ..., miss_reason: _Optional[str] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GetItem, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted", "existed")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    existed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, deleted: _Optional[int] = ..., existed: _Optional[_Iterable[bool]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "used_bytes", "capacity_bytes", "entries")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    used_bytes: int
    capacity_bytes: int
    entries: int
    def __init__(self, name: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "used_bytes", "quota_bytes", "entries", "tiers", "evictions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    used_bytes: int
    quota_bytes: int
    entries: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    evictions: int
    def __init__(self, tenant: _Optional[str] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tenants", "node_id", "uptime_s")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    node_id: str
    uptime_s: float
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., node_id: _Optional[str] = ..., uptime_s: _Optional[float] = ...) -> None: ...
