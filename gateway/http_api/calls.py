"""A gRPC call context for in-process calls, and errors as HTTP statuses.

``GatewayService`` takes a ``grpc.ServicerContext``: it reads the caller's
key from its metadata, registers what to do when the call ends (cancel the
engine's request, give back the tenant's slot), and aborts with a status.
``LocalCall`` is that context for a call from the HTTP API: ``abort`` raises
``CallFailed``, and ``end`` (the HTTP client left, or the reply was sent)
runs the callbacks, as gRPC runs them when a call terminates.

Statuses map to HTTP as OpenAI's API uses them (the ``openai`` client picks
its exception class by the HTTP status).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from gateway.service import STATUS_BY_ERROR
from kvd.common.grpc_server import status_of

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

# A ValueError's message starts with the field it is about, named as the
# gRPC request names it; the OpenAI request's name goes into "param".
_PARAMS = {
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
    "sampling.top_logprobs": "top_logprobs",
    "top_logprobs": "top_logprobs",
    "chat.messages": "messages",
    "messages": "messages",
    "token_ids": "prompt",
    "prompt": "prompt",
    "text": "prompt",
    "template": "template",
    "cache_key": "prompt_cache_key",
    "name": "name",
    "content": "content",
    "ttl_seconds": "ttl_seconds",
    "description": "description",
    "page_size": "page_size",
    "page_token": "page_token",
}


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


class CallFailed(Exception):
    """A call aborted with a gRPC status (``LocalCall.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class LocalCall:
    """What ``GatewayService`` needs of a ``grpc.ServicerContext``, for one HTTP request."""

    def __init__(self, authorization: str | None) -> None:
        self._metadata = (("authorization", authorization),) if authorization else ()
        self._callbacks: list[Callable[[], None]] = []
        self._active = True
        self._code: grpc.StatusCode | None = None
        self._lock = threading.Lock()

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # an HTTP request has no deadline; the client closes the connection instead

    def is_active(self) -> bool:
        return self._active

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
            return self._active

    def abort(self, code: grpc.StatusCode, details: str):
        self._code = code
        raise CallFailed(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def end(self) -> None:
        """The call is over (its reply sent, or its client gone): runs the
        callbacks once, which cancels an engine request still running."""
        with self._lock:
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others from running
                log.exception("call callback failed")


def api_error(exc: BaseException) -> ApiError:
    """The reply for an exception raised on a service call (as the gRPC server's status table gives it)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, CallFailed):
        code, message = exc.code, exc.details
    else:
        status = status_of(STATUS_BY_ERROR, exc) if isinstance(exc, Exception) else None
        if status is None:
            log.error("internal error", exc_info=exc)
            return ApiError(500, "internal error; see the gateway's log", code="internal")
        code, message = status
    http = HTTP_STATUS.get(code, 500)
    return ApiError(http, message, _param_of(message) if http == 400 else None, code.name.lower())


def _param_of(message: str) -> str | None:
    head = message.split(" ", 1)[0].rstrip(":,")
    for field in (head, head.split("[", 1)[0]):
        if field in _PARAMS:
            return _PARAMS[field]
    return None
