"""The checks of the gateway's requests' own fields, before anything is routed or stored.

Both APIs go through them: the request path (``gateway.request_path``) calls
them first, whichever API the request came by.
"""

from __future__ import annotations

from gateway.request_errors import InvalidField
from gateway.templates import check_description, check_name, check_ttl
from kvd_api.gateway.v1 import gateway_pb2 as pb

MAX_CACHE_SALT = 256
MAX_CACHE_KEY = 256

# Each check raises InvalidField naming the field (INVALID_ARGUMENT), its
# message starting with that name. Fields whose limits only an engine knows
# (token ids against its vocabulary, sampling values, lengths against its
# context) are checked by the engine, which names them the same way.


def check_generate(request: pb.GenerateRequest) -> None:
    kind = request.WhichOneof("prompt")
    if kind is None and not request.template:
        raise InvalidField("prompt", "prompt: give text, chat messages or token ids (or a template)")
    if request.template:
        check_name(request.template, "template")
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidField("chat.messages", "chat.messages is empty")
        for i, message in enumerate(request.chat.messages):
            if not message.role:
                raise InvalidField(f"chat.messages[{i}].role", f"chat.messages[{i}].role is empty")
    if kind == "token_ids" and not request.token_ids.ids and not request.template:
        raise InvalidField("token_ids.ids", "token_ids.ids is empty")
    if len(request.cache_salt) > MAX_CACHE_SALT:
        raise InvalidField("cache_salt", f"cache_salt is {len(request.cache_salt)} bytes; at most {MAX_CACHE_SALT}")
    if len(request.cache_key) > MAX_CACHE_KEY:
        raise InvalidField("cache_key", f"cache_key is {len(request.cache_key)} characters; at most {MAX_CACHE_KEY}")


def check_create(request: pb.CreateTemplateRequest) -> None:
    check_name(request.name)
    if not request.content and not request.messages:
        raise InvalidField("content", "content must not be empty (or give messages: a chat template)")
    if request.content and request.messages:
        raise InvalidField("content", "content, messages: give the template's content or its messages, not both")
    for i, message in enumerate(request.messages):
        if not message.role:
            raise InvalidField(f"messages[{i}].role", f"messages[{i}].role is empty")
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
        raise InvalidField("page_size", f"page_size must be >= 0, got {request.page_size}")
