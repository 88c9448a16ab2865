import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvd_api.daemon.v1 import daemon_pb2 as _daemon_pb2
from kvd_api.engine.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheTtl(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TTL_5M: _ClassVar[CacheTtl]
    CACHE_TTL_1H: _ClassVar[CacheTtl]
CACHE_TTL_5M: CacheTtl
CACHE_TTL_1H: CacheTtl

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "template", "sampling", "cache_salt", "cache_key", "tool_choice", "cache_breakpoints", "diagnose_cache")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSE_CACHE_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: _engine_pb2.ChatPrompt
    token_ids: _engine_pb2.TokenIds
    template: str
    sampling: _engine_pb2.SamplingParams
    cache_salt: bytes
    cache_key: str
    tool_choice: ToolChoice
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[CacheBreakpoint]
    diagnose_cache: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[_engine_pb2.ChatPrompt, _Mapping]] = ..., token_ids: _Optional[_Union[_engine_pb2.TokenIds, _Mapping]] = ..., template: _Optional[str] = ..., sampling: _Optional[_Union[_engine_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., cache_key: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[CacheBreakpoint, _Mapping]]] = ..., diagnose_cache: _Optional[bool] = ...) -> None: ...

class CacheBreakpoint(_message.Message):
    __slots__ = ("message", "prompt", "content_chars", "ttl")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_CHARS_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    message: int
    prompt: bool
    content_chars: int
    ttl: CacheTtl
    def __init__(self, message: _Optional[int] = ..., prompt: _Optional[bool] = ..., content_chars: _Optional[int] = ..., ttl: _Optional[_Union[CacheTtl, str]] = ...) -> None: ...

class CacheDiagnosis(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "cached_runs", "has_earlier", "common_tokens", "token", "earlier_token", "text_before", "text_after", "earlier_text_after")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_RUNS_FIELD_NUMBER: _ClassVar[int]
    HAS_EARLIER_FIELD_NUMBER: _ClassVar[int]
    COMMON_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EARLIER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    EARLIER_TEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    cached_runs: _containers.RepeatedCompositeFieldContainer[CachedRun]
    has_earlier: bool
    common_tokens: int
    token: int
    earlier_token: int
    text_before: str
    text_after: str
    earlier_text_after: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_runs: _Optional[_Iterable[_Union[CachedRun, _Mapping]]] = ..., has_earlier: _Optional[bool] = ..., common_tokens: _Optional[int] = ..., token: _Optional[int] = ..., earlier_token: _Optional[int] = ..., text_before: _Optional[str] = ..., text_after: _Optional[str] = ..., earlier_text_after: _Optional[str] = ...) -> None: ...

class CachedRun(_message.Message):
    __slots__ = ("tier", "first_token", "num_tokens")
    TIER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tier: _daemon_pb2.Tier
    first_token: int
    num_tokens: int
    def __init__(self, tier: _Optional[_Union[_daemon_pb2.Tier, str]] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("none", "auto", "required", "function", "parallel")
    NONE_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    none: bool
    auto: bool
    required: bool
    function: str
    parallel: bool
    def __init__(self, none: _Optional[bool] = ..., auto: _Optional[bool] = ..., required: _Optional[bool] = ..., function: _Optional[str] = ..., parallel: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "template_tokens", "cached_prompt_tokens", "completion_tokens", "time_to_first_token_s", "host_cached_prompt_tokens", "disk_cached_prompt_tokens", "cache_creation_tokens", "cache_creation_5m_tokens", "cache_creation_1h_tokens", "unpinned_breakpoints")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CREATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CREATION_5M_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CREATION_1H_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    template_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    host_cached_prompt_tokens: int
    disk_cached_prompt_tokens: int
    cache_creation_tokens: int
    cache_creation_5m_tokens: int
    cache_creation_1h_tokens: int
    unpinned_breakpoints: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., template_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., host_cached_prompt_tokens: _Optional[int] = ..., disk_cached_prompt_tokens: _Optional[int] = ..., cache_creation_tokens: _Optional[int] = ..., cache_creation_5m_tokens: _Optional[int] = ..., cache_creation_1h_tokens: _Optional[int] = ..., unpinned_breakpoints: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "top_logprobs", "prompt_logprobs", "tool_calls", "cache_diagnosis")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CACHE_DIAGNOSIS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _engine_pb2.FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_engine_pb2.TopLogprobs]
    prompt_logprobs: _engine_pb2.PromptLogprobs
    tool_calls: _containers.RepeatedCompositeFieldContainer[_engine_pb2.ToolCall]
    cache_diagnosis: CacheDiagnosis
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_engine_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_engine_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_engine_pb2.PromptLogprobs, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[_engine_pb2.ToolCall, _Mapping]]] = ..., cache_diagnosis: _Optional[_Union[CacheDiagnosis, _Mapping]] = ...) -> None: ...

class Template(_message.Message):
    __slots__ = ("name", "description", "token_count", "cached_token_count", "create_time", "expire_time", "content", "messages")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    token_count: int
    cached_token_count: int
    create_time: _timestamp_pb2.Timestamp
    expire_time: _timestamp_pb2.Timestamp
    content: str
    messages: _containers.RepeatedCompositeFieldContainer[_engine_pb2.ChatMessage]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., token_count: _Optional[int] = ..., cached_token_count: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., content: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_engine_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class CreateTemplateRequest(_message.Message):
    __slots__ = ("name", "content", "messages", "ttl_seconds", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: str
    messages: _containers.RepeatedCompositeFieldContainer[_engine_pb2.ChatMessage]
    ttl_seconds: int
    description: str
    def __init__(self, name: _Optional[str] = ..., content: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_engine_pb2.ChatMessage, _Mapping]]] = ..., ttl_seconds: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class GetTemplateRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListTemplatesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListTemplatesResponse(_message.Message):
    __slots__ = ("templates", "next_page_token")
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    templates: _containers.RepeatedCompositeFieldContainer[Template]
    next_page_token: str
    def __init__(self, templates: _Optional[_Iterable[_Union[Template, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateTemplateRequest(_message.Message):
    __slots__ = ("name", "ttl_seconds", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    ttl_seconds: int
    description: str
    def __init__(self, name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class DeleteTemplateRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTemplateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "block_size", "max_context", "templates", "version", "replicas", "model_type")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    max_context: int
    templates: int
    version: str
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    model_type: str
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., max_context: _Optional[int] = ..., templates: _Optional[int] = ..., version: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., model_type: _Optional[str] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("address", "serving", "in_flight", "known_blocks", "templates")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KNOWN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    address: str
    serving: bool
    in_flight: int
    known_blocks: int
    templates: int
    def __init__(self, address: _Optional[str] = ..., serving: _Optional[bool] = ..., in_flight: _Optional[int] = ..., known_blocks: _Optional[int] = ..., templates: _Optional[int] = ...) -> None: ...
