"""Errors as HTTP replies, in OpenAI's shape for every surface of the HTTP API
but Anthropic's (``/v1/messages``), whose errors are in its own shape.

A ``RequestError``'s gRPC status maps to HTTP as OpenAI's API uses them (the
``openai`` client picks its exception class by the HTTP status), and its
field, named as the gRPC request names it, to OpenAI's ``param``. The
request path's other exceptions get their status by its table
(``gateway.error_statuses``); anything else is a 500, logged.
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.error_statuses import as_request_error
from kvd.common.field_error import FieldError

log = logging.getLogger("gateway.http")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client left: nobody reads it
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# A gRPC request's field -> the HTTP request's name for it ("param").
OPENAI_PARAM = {
    "sampling.max_new_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "temperature": "temperature",
    "sampling.top_p": "top_p",
    "top_p": "top_p",
    "sampling.top_k": "top_k",
    "top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.stop": "stop",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.min_p": "min_p",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.logit_bias": "logit_bias",
    "sampling.min_tokens": "min_tokens",
    "chat.continue_final_message": "continue_final_message",
    "chat.add_generation_prompt": "add_generation_prompt",
    "chat.chat_template_kwargs": "chat_template_kwargs",
    "chat.tools": "tools",
    "tool_choice": "tool_choice",
    "tokens": "tokens",
    # the HTTP API's own names, raised by its translation on a worker thread
    "logit_bias": "logit_bias",
    "chat_template_kwargs": "chat_template_kwargs",
    "continue_final_message": "continue_final_message",
    "add_special_tokens": "add_special_tokens",
    "sampling.top_logprobs": "top_logprobs",
    "top_logprobs": "top_logprobs",
    "chat.messages": "messages",
    "messages": "messages",
    "token_ids": "prompt",
    "prompt.token_ids": "prompt",
    "prompt": "prompt",
    "text": "prompt",
    "template": "template",
    "cache_key": "prompt_cache_key",
    "cache_breakpoints": "cache_control",
    "name": "name",
    "content": "content",
    "ttl_seconds": "ttl_seconds",
    "description": "description",
    "page_size": "page_size",
    "page_token": "page_token",
}


#: Anthropic's error types by HTTP status.
ANTHROPIC_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "cancelled",
    503: "overloaded_error",
    504: "timeout_error",
}

#: The paths whose errors are in Anthropic's shape.
ANTHROPIC_PATHS = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPE.get(status, "api_error"), "message": message}}


class ApiError(Exception):
    """An error reply: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        kind = ERROR_TYPE.get(self.status, "internal_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def openai_param(field: str | None) -> str | None:
    """A gRPC request's field (``chat.messages[2].role``) as OpenAI's ``param`` (``messages``), if it has one."""
    if field is None:
        return None
    for name in (field, field.split("[", 1)[0]):
        if name in OPENAI_PARAM:
            return OPENAI_PARAM[name]
    return None


def api_error(exc: BaseException) -> ApiError:
    """The reply for an exception raised on the request path."""
    if isinstance(exc, ApiError):
        return exc
    error = as_request_error(exc)
    if error is None:
        log.error("internal error", exc_info=exc)
        return ApiError(500, "internal error; see the gateway's log", code="internal")
    http = HTTP_STATUS.get(error.code, 500)
    return ApiError(http, error.message, openai_param(error.field) if http == 400 else None, error.code.name.lower())


def add_error_handlers(app: FastAPI) -> None:
    """Every error of ``app`` in OpenAI's shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)


def _reply(request: Request, error: ApiError) -> JSONResponse:
    """``error`` in the shape of the API the request called."""
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(error.status, error.message), status_code=error.status)
    return JSONResponse(error.body(), status_code=error.status)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return _reply(request, exc)


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request body")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, FieldError):  # a body's own check (the schemas'): it names its field
        message, param = str(cause), cause.field
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    elif param:
        message = f"{param}: {message}"
    return _reply(request, ApiError(400, message, param, "invalid_argument"))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _reply(request, ApiError(exc.status_code, str(exc.detail)))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error", exc_info=exc, extra={"path": request.url.path})
    return _reply(request, ApiError(500, "internal error; see the gateway's log", code="internal"))
