"""Who may call the daemon: anyone on its unix socket, a token holder on TCP.

The unix socket is mode 0600 in a 0700 folder: only the daemon's own user
reaches it, and it may do everything. The optional TCP listener (``--listen``)
needs ``authorization: Bearer <token>`` on every call: the engine token for
the engine's calls, the admin token for ``Reset`` and ``InspectBlock`` (without
one configured, those two are served on the unix socket only). Health checks
need no token (probes). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from kvd_api.daemon.v1 import daemon_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["KVDaemon"].full_name
ADMIN_METHODS = frozenset({f"/{_SERVICE}/Reset", f"/{_SERVICE}/InspectBlock"})
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def read_token(path: str | Path, what: str) -> str:
    """A token from a file (surrounding whitespace dropped); ``ValueError`` when unusable."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} from {path}: {exc}") from exc
    if len(token) < 16:
        raise ValueError(f"the {what} in {path} is shorter than 16 characters")
    return token


class TokenAuth(grpc.ServerInterceptor):
    """Refuses TCP calls without the right token (UNAUTHENTICATED / PERMISSION_DENIED).

    Args:
        token: what engines send on TCP.
        admin_token: what ``Reset``/``InspectBlock`` need on TCP; None: refused there.
    """

    def __init__(self, token: str, admin_token: str | None = None) -> None:
        self._token = token.encode()
        self._admin_token = admin_token.encode() if admin_token else None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        # NOTE: the peer (unix socket or TCP) is known only inside the call,
        # so the check wraps the handler's behaviour.
        return _guarded(handler, lambda context: self._check(method, context))

    def _check(self, method: str, context: grpc.ServicerContext) -> None:
        if context.peer().startswith("unix:"):
            return
        sent = _bearer(context)
        if sent is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the daemon's TCP listener needs 'authorization: Bearer'")
        is_admin = self._admin_token is not None and hmac.compare_digest(sent, self._admin_token)
        if method in ADMIN_METHODS:
            if not is_admin:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the admin token")
            return
        if not (is_admin or hmac.compare_digest(sent, self._token)):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token")


def _bearer(context: grpc.ServicerContext) -> bytes | None:
    for name, value in context.invocation_metadata():
        if name == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip().encode()
    return None


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    def wrap(behaviour):
        def guarded(request_or_iterator, context):
            check(context)
            return behaviour(request_or_iterator, context)

        return guarded

    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attr, make in kinds:
        behaviour = getattr(handler, attr)
        if behaviour is not None:
            return make(
                wrap(behaviour),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self._metadata])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)
