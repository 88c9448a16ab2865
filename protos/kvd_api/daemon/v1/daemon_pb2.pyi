from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class CacheLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "num_blocks")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: DType
    num_blocks: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("path", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("shared_memory", "cuda_ipc", "shape", "stride")
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    shared_memory: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shared_memory: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("ready", "layout", "memory", "cache_id")
    READY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    layout: CacheLayout
    memory: MemoryHandle
    cache_id: str
    def __init__(self, ready: _Optional[bool] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., cache_id: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "layout", "protocol_version", "process", "model")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    layout: CacheLayout
    protocol_version: int
    process: ProcessIdentity
    model: ModelIdentity
    def __init__(self, client_name: _Optional[str] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ..., protocol_version: _Optional[int] = ..., process: _Optional[_Union[ProcessIdentity, _Mapping]] = ..., model: _Optional[_Union[ModelIdentity, _Mapping]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("name", "model_type", "config_digest", "weights_digest", "tokenizer_digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    config_digest: bytes
    weights_digest: bytes
    tokenizer_digest: bytes
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., config_digest: _Optional[bytes] = ..., weights_digest: _Optional[bytes] = ..., tokenizer_digest: _Optional[bytes] = ...) -> None: ...

class ProcessIdentity(_message.Message):
    __slots__ = ("boot_id", "pid_namespace", "pid", "start_ticks")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int
    def __init__(self, boot_id: _Optional[str] = ..., pid_namespace: _Optional[str] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("session_id", "layout", "memory", "heartbeat_interval_s", "cache_id", "protocol_version", "lease_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    layout: CacheLayout
    memory: MemoryHandle
    heartbeat_interval_s: float
    cache_id: str
    protocol_version: int
    lease_s: float
    def __init__(self, session_id: _Optional[str] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ..., memory: _Optional[_Union[MemoryHandle, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., cache_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("released_requests",)
    RELEASED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    released_requests: int
    def __init__(self, released_requests: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_salt", "extra_keys", "priority", "max_new_tokens", "max_cached_tokens", "cache_marks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MARKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    priority: int
    max_new_tokens: int
    max_cached_tokens: int
    cache_marks: CacheMarks
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[bytes]] = ..., priority: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., cache_marks: _Optional[_Union[CacheMarks, _Mapping]] = ...) -> None: ...

class CacheMark(_message.Message):
    __slots__ = ("num_tokens", "ttl_seconds")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    ttl_seconds: int
    def __init__(self, num_tokens: _Optional[int] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class CacheMarks(_message.Message):
    __slots__ = ("marks", "owner", "owner_max_blocks")
    MARKS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    marks: _containers.RepeatedCompositeFieldContainer[CacheMark]
    owner: str
    owner_max_blocks: int
    def __init__(self, marks: _Optional[_Iterable[_Union[CacheMark, _Mapping]]] = ..., owner: _Optional[str] = ..., owner_max_blocks: _Optional[int] = ...) -> None: ...

class MarkResult(_message.Message):
    __slots__ = ("request_id", "num_tokens", "ttl_seconds", "num_pinned_tokens", "refused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    ttl_seconds: int
    num_pinned_tokens: int
    refused: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., ttl_seconds: _Optional[int] = ..., num_pinned_tokens: _Optional[int] = ..., refused: _Optional[str] = ...) -> None: ...

class Commits(_message.Message):
    __slots__ = ("request_ids", "num_computed_tokens", "num_new_tokens", "new_token_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionSettings(_message.Message):
    __slots__ = ("max_num_seqs", "token_budget")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    token_budget: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "new_requests", "commits", "finished", "forward_in_flight", "settings", "forward_event")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_EVENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    commits: Commits
    finished: _containers.RepeatedScalarFieldContainer[str]
    forward_in_flight: bool
    settings: SessionSettings
    forward_event: bytes
    def __init__(self, session_id: _Optional[str] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., commits: _Optional[_Union[Commits, _Mapping]] = ..., finished: _Optional[_Iterable[str]] = ..., forward_in_flight: _Optional[bool] = ..., settings: _Optional[_Union[SessionSettings, _Mapping]] = ..., forward_event: _Optional[bytes] = ...) -> None: ...

class Scheduled(_message.Message):
    __slots__ = ("request_ids", "first_positions", "num_tokens", "num_cached_tokens", "num_new_blocks", "new_block_ids", "num_host_cached_tokens", "num_disk_cached_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    first_positions: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_host_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_disk_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., first_positions: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_host_cached_tokens: _Optional[_Iterable[int]] = ..., num_disk_cached_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("scheduled", "preempted", "released", "num_waiting", "num_free_blocks", "copy_events", "arrival_cached_tokens", "marks")
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    scheduled: Scheduled
    preempted: _containers.RepeatedScalarFieldContainer[str]
    released: _containers.RepeatedScalarFieldContainer[str]
    num_waiting: int
    num_free_blocks: int
    copy_events: _containers.RepeatedScalarFieldContainer[bytes]
    arrival_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    marks: _containers.RepeatedCompositeFieldContainer[MarkResult]
    def __init__(self, scheduled: _Optional[_Union[Scheduled, _Mapping]] = ..., preempted: _Optional[_Iterable[str]] = ..., released: _Optional[_Iterable[str]] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., copy_events: _Optional[_Iterable[bytes]] = ..., arrival_cached_tokens: _Optional[_Iterable[int]] = ..., marks: _Optional[_Iterable[_Union[MarkResult, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "extra_keys")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "block_hashes", "num_host_cached_tokens", "num_disk_cached_tokens")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_host_cached_tokens: int
    num_disk_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_host_cached_tokens: _Optional[int] = ..., num_disk_cached_tokens: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("pin_id", "token_ids", "cache_salt", "extra_keys")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pin_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("num_pinned_tokens", "num_pinned_blocks")
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_pinned_tokens: int
    num_pinned_blocks: int
    def __init__(self, num_pinned_tokens: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    def __init__(self, pin_id: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("num_unpinned_blocks",)
    NUM_UNPINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_unpinned_blocks: int
    def __init__(self, num_unpinned_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "num_free_blocks", "num_used_blocks", "num_pinned_blocks", "num_cached_blocks", "max_pinned_blocks", "evictions", "query_tokens", "hit_tokens", "num_sessions", "num_requests", "num_pins", "num_host_blocks", "num_host_free_blocks", "num_host_cached_blocks", "num_copying_blocks", "num_host_blocks_read", "host_hit_tokens", "host_evictions", "bytes_to_host", "bytes_from_host", "copy_to_host_seconds", "copy_from_host_seconds", "copy_batches_to_host", "copy_batches_from_host", "num_quarantined_sessions", "num_quarantined_blocks", "num_disk_blocks", "disk_used_bytes", "disk_budget_bytes", "disk_hit_tokens", "disk_evictions", "disk_writes", "disk_writes_skipped", "disk_write_errors", "disk_writes_enabled", "disk_loads", "disk_corrupt_blocks", "bytes_to_disk", "bytes_from_disk", "disk_read_seconds", "disk_index_rebuild_seconds")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPYING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_HOST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    COPY_TO_HOST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_FROM_HOST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_BATCHES_TO_HOST_FIELD_NUMBER: _ClassVar[int]
    COPY_BATCHES_FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITES_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DISK_LOADS_FIELD_NUMBER: _ClassVar[int]
    DISK_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_DISK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_DISK_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_INDEX_REBUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_cached_blocks: int
    max_pinned_blocks: int
    evictions: int
    query_tokens: int
    hit_tokens: int
    num_sessions: int
    num_requests: int
    num_pins: int
    num_host_blocks: int
    num_host_free_blocks: int
    num_host_cached_blocks: int
    num_copying_blocks: int
    num_host_blocks_read: int
    host_hit_tokens: int
    host_evictions: int
    bytes_to_host: int
    bytes_from_host: int
    copy_to_host_seconds: float
    copy_from_host_seconds: float
    copy_batches_to_host: int
    copy_batches_from_host: int
    num_quarantined_sessions: int
    num_quarantined_blocks: int
    num_disk_blocks: int
    disk_used_bytes: int
    disk_budget_bytes: int
    disk_hit_tokens: int
    disk_evictions: int
    disk_writes: int
    disk_writes_skipped: int
    disk_write_errors: int
    disk_writes_enabled: bool
    disk_loads: int
    disk_corrupt_blocks: int
    bytes_to_disk: int
    bytes_from_disk: int
    disk_read_seconds: float
    disk_index_rebuild_seconds: float
    def __init__(self, num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., max_pinned_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_sessions: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_pins: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_host_free_blocks: _Optional[int] = ..., num_host_cached_blocks: _Optional[int] = ..., num_copying_blocks: _Optional[int] = ..., num_host_blocks_read: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., host_evictions: _Optional[int] = ..., bytes_to_host: _Optional[int] = ..., bytes_from_host: _Optional[int] = ..., copy_to_host_seconds: _Optional[float] = ..., copy_from_host_seconds: _Optional[float] = ..., copy_batches_to_host: _Optional[int] = ..., copy_batches_from_host: _Optional[int] = ..., num_quarantined_sessions: _Optional[int] = ..., num_quarantined_blocks: _Optional[int] = ..., num_disk_blocks: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_budget_bytes: _Optional[int] = ..., disk_hit_tokens: _Optional[int] = ..., disk_evictions: _Optional[int] = ..., disk_writes: _Optional[int] = ..., disk_writes_skipped: _Optional[int] = ..., disk_write_errors: _Optional[int] = ..., disk_writes_enabled: _Optional[bool] = ..., disk_loads: _Optional[int] = ..., disk_corrupt_blocks: _Optional[int] = ..., bytes_to_disk: _Optional[int] = ..., bytes_from_disk: _Optional[int] = ..., disk_read_seconds: _Optional[float] = ..., disk_index_rebuild_seconds: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("num_cleared_blocks",)
    NUM_CLEARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_cleared_blocks: int
    def __init__(self, num_cleared_blocks: _Optional[int] = ...) -> None: ...

class InspectBlockRequest(_message.Message):
    __slots__ = ("block_id",)
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    def __init__(self, block_id: _Optional[int] = ...) -> None: ...

class InspectBlockResponse(_message.Message):
    __slots__ = ("ref_cnt", "block_hash", "data_sha256", "in_free_queue")
    REF_CNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    IN_FREE_QUEUE_FIELD_NUMBER: _ClassVar[int]
    ref_cnt: int
    block_hash: bytes
    data_sha256: bytes
    in_free_queue: bool
    def __init__(self, ref_cnt: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., data_sha256: _Optional[bytes] = ..., in_free_queue: _Optional[bool] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    all_cleared: AllCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("events", "incarnation", "sequence", "snapshot")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    incarnation: str
    sequence: int
    snapshot: bool
    def __init__(self, events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ..., incarnation: _Optional[str] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...
