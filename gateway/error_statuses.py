"""Every exception of the gateway's request path as the status its caller gets.

The gRPC API hands ``STATUS_BY_ERROR`` to its server's interceptor
(``kvd.common.grpc_server``); the HTTP API turns an exception into a
``RequestError`` with ``as_request_error`` and that into OpenAI's error JSON.
One table for both, so both APIs answer a failure alike.
"""

from __future__ import annotations

import grpc

from gateway.replicas import engine_error
from gateway.request_errors import RequestError
from gateway.router import NoReplica
from gateway.templates import StoreUnavailable, TemplateExists, TemplateNotFound
from gateway.tenants import LimitExceeded
from kvd.common.field_error import FieldError, field_of
from kvd.common.grpc_server import StatusTable, status_of

# First match wins.
STATUS_BY_ERROR: StatusTable = (
    (RequestError, RequestError.status),
    (grpc.RpcError, engine_error),  # from an engine
    (TemplateNotFound, grpc.StatusCode.NOT_FOUND),
    (TemplateExists, grpc.StatusCode.ALREADY_EXISTS),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NoReplica, grpc.StatusCode.UNAVAILABLE),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def from_engine(err: grpc.RpcError, who: str = "an engine replica") -> RequestError:
    """An engine's error as its caller's (``engine_error`` says which statuses pass
    on), with the field an INVALID_ARGUMENT names (``kvd.common.field_error``)."""
    code, message = engine_error(err, who)
    return RequestError(code, message, field_of(err) if code == grpc.StatusCode.INVALID_ARGUMENT else None)


def as_request_error(exc: BaseException) -> RequestError | None:
    """``exc`` as its caller's error, with its field when one is known; None:
    not the caller's to act on (a bug: an internal error)."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, FieldError):
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field)
    if isinstance(exc, grpc.RpcError):
        return from_engine(exc)
    status = status_of(STATUS_BY_ERROR, exc) if isinstance(exc, Exception) else None
    return None if status is None else RequestError(*status)
