"""The checks of the gateway's requests' own fields, before anything is routed or stored.

Both APIs go through them: the request path (``gateway.request_path``) calls
them first, whichever API the request came by.
"""

from __future__ import annotations

from gateway.cache_marks import check_breakpoints
from gateway.templates import check_description, check_name, check_ttl
from kvd.common.field_error import FieldError
from kvd_api.gateway.v1 import gateway_pb2 as pb

MAX_CACHE_SALT = 256
MAX_CACHE_KEY = 256

# Each check raises FieldError naming the field (INVALID_ARGUMENT), its
# message starting with that name. Fields whose limits only an engine knows
# (token ids against its vocabulary, sampling values, lengths against its
# context) are checked by the engine, which names them the same way.


def check_generate(request: pb.GenerateRequest) -> None:
    kind = request.WhichOneof("prompt")
    if kind is None and not request.template:
        raise FieldError("prompt", "prompt: give text, chat messages or token ids (or a template)")
    if request.template:
        check_name(request.template, "template")
    if kind == "chat":
        if not request.chat.messages:
            raise FieldError("chat.messages", "chat.messages is empty")
        for i, message in enumerate(request.chat.messages):
            if not message.role:
                raise FieldError(f"chat.messages[{i}].role", f"chat.messages[{i}].role is empty")
    if kind == "token_ids" and not request.token_ids.ids and not request.template:
        raise FieldError("token_ids.ids", "token_ids.ids is empty")
    if len(request.cache_salt) > MAX_CACHE_SALT:
        raise FieldError("cache_salt", f"cache_salt is {len(request.cache_salt)} bytes; at most {MAX_CACHE_SALT}")
    if len(request.cache_key) > MAX_CACHE_KEY:
        raise FieldError("cache_key", f"cache_key is {len(request.cache_key)} characters; at most {MAX_CACHE_KEY}")
    check_breakpoints(request)


def check_create(request: pb.CreateTemplateRequest) -> None:
    check_name(request.name)
    if not request.content and not request.messages:
        raise FieldError("content", "content must not be empty (or give messages: a chat template)")
    if request.content and request.messages:
        raise FieldError("content", "content, messages: give the template's content or its messages, not both")
    for i, message in enumerate(request.messages):
        if not message.role:
            raise FieldError(f"messages[{i}].role", f"messages[{i}].role is empty")
    check_ttl(request.ttl_seconds)
    check_description(request.description)


def check_update(request: pb.UpdateTemplateRequest) -> None:
    check_name(request.name)
    if request.HasField("ttl_seconds"):
        check_ttl(request.ttl_seconds)
    if request.HasField("description"):
        check_description(request.description)


def check_list(request: pb.ListTemplatesRequest) -> None:
    if request.page_size < 0:
        raise FieldError("page_size", f"page_size must be >= 0, got {request.page_size}")
