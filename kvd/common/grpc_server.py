"""The gRPC server every process runs (daemon, engine, gateway): one builder.

Each server gets the standard health service (its own service and "" report
together), reflection, one interceptor that turns the process's exceptions
into gRPC statuses by a table, and a graceful stop. Pure shared code: the
engine and the gateway import it without importing anything of the daemon.

A table lists ``(exception type, status)`` pairs, first match wins; the
status may be a function of the exception returning ``(code, message)``
(e.g. passing an upstream ``grpc.RpcError`` on). Anything not in the table is
INTERNAL with the method named, and logged with its traceback. A
``FieldError``'s field goes beside its status (``kvd.common.field_error``).

A server may cap its long calls (generation: one holds a worker thread for
its whole length) with a ``CallLimit``: the thread pool gets that many threads
on top of those for everything else, and a long call past the cap is refused
with RESOURCE_EXHAUSTED at once. Without the cap, calls past the pool's size
wait unseen in its queue, behind streams that may run for minutes, and so
does the health check that would have said so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvd.common.field_error import FieldError, trailing_field

log = logging.getLogger("kvd.common.grpc_server")

StatusFor = grpc.StatusCode | Callable[[Exception], tuple[grpc.StatusCode, str]]
StatusTable = Sequence[tuple[type[BaseException], StatusFor]]

_HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def status_of(table: StatusTable, exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a table gives ``exc`` (its message from the exception), or None."""
    for kind, status in table:
        if isinstance(exc, kind):
            if isinstance(status, grpc.StatusCode):
                return status, str(exc.args[0]) if exc.args else str(exc)
            return status(exc)
    return None


class StatusInterceptor(grpc.ServerInterceptor):
    """Aborts a failed call with its exception's status from ``table``."""

    def __init__(self, table: StatusTable) -> None:
        self.table = tuple(table)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, method))
        return handler  # client streams: none in this project

    def _unary(self, behavior, method: str):
        def call(request, context):
            try:
                return behavior(request, context)
            except Exception as exc:
                self._abort(exc, context, method)

        return call

    def _stream(self, behavior, method: str):
        def call(request, context) -> Iterator:
            try:
                yield from behavior(request, context)
            except Exception as exc:
                self._abort(exc, context, method)

        return call

    def _abort(self, exc: Exception, context: grpc.ServicerContext, method: str) -> None:
        if context.code() is not None:
            raise exc  # the method set its status itself (context.abort)
        if not context.is_active():
            # The client left or the deadline passed: no one to tell, nothing to log.
            context.abort(grpc.StatusCode.CANCELLED, f"{method} ended with the call")
        status = status_of(self.table, exc)
        if status is None:
            log.error("internal error", exc_info=exc, extra={"rpc": method})
            status = grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server's log"
        elif isinstance(exc, FieldError):
            context.set_trailing_metadata(trailing_field(exc.field))
        context.abort(*status)


class OpenCalls:
    """Long calls open at once, at most ``limit``: the one count a process's
    APIs share (the gateway's gRPC and HTTP generations). ``what`` names the
    setting in the refusal (``--max-open-requests``)."""

    def __init__(self, limit: int, what: str) -> None:
        if limit < 1:
            raise ValueError(f"{what} must be >= 1, got {limit}")
        self.limit = limit
        self.what = what
        self._open = 0
        self._lock = threading.Lock()

    def try_open(self) -> bool:
        """Counts one more call, unless ``limit`` are open (then False)."""
        with self._lock:
            if self._open >= self.limit:
                return False
            self._open += 1
            return True

    def close(self) -> None:
        with self._lock:
            self._open -= 1

    def refusal(self) -> str:
        return f"overloaded: {self.limit} requests are open here ({self.what}); try again later"


@dataclass(frozen=True)
class CallLimit:
    """The calls of ``methods`` (short names) count in ``calls``."""

    methods: frozenset[str]
    calls: OpenCalls


class CallLimitInterceptor(grpc.ServerInterceptor):
    """Refuses a call of the limited methods past the limit (RESOURCE_EXHAUSTED);
    a call's place is given back when it terminates, however it ends."""

    def __init__(self, cap: CallLimit) -> None:
        self.cap = cap

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or method not in self.cap.methods:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary))
        return handler._replace(unary_stream=self._stream(handler.unary_stream))

    def _unary(self, behavior):
        def call(request, context):
            self._open(context)
            return behavior(request, context)

        return call

    def _stream(self, behavior):
        def call(request, context) -> Iterator:
            self._open(context)
            yield from behavior(request, context)

        return call

    def _open(self, context: grpc.ServicerContext) -> None:
        calls = self.cap.calls
        if not calls.try_open():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, calls.refusal())
        # Runs when the call terminates (completed, cancelled, deadline); at
        # once if it already has.
        if not context.add_callback(calls.close):
            calls.close()


@dataclass
class Server:
    """A built server: add ports, ``start``, report health, ``stop`` gracefully.

    Attributes:
        grpc_server: the underlying ``grpc.Server``.
        health: its health servicer.
        service_names: the full names reported healthy (plus "").
    """

    grpc_server: grpc.Server
    health: health.HealthServicer
    service_names: tuple[str, ...]

    def add_port(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listens on ``address`` (``unix:PATH`` or ``HOST:PORT``); returns the bound port."""
        if credentials is None:
            return self.grpc_server.add_insecure_port(address)
        return self.grpc_server.add_secure_port(address, credentials)

    def start(self) -> None:
        self.grpc_server.start()

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING, refuses new calls, lets calls in flight finish for ``grace_s``."""
        self.set_serving(False)
        self.grpc_server.stop(grace=grace_s).wait()


def build_server(
    add_servicers: Sequence[tuple[Callable[[object, grpc.Server], None], object, str]],
    errors: StatusTable,
    *,
    serving: bool,
    max_workers: int,
    thread_name_prefix: str,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    long_calls: CallLimit | None = None,
) -> Server:
    """A server with the given services, health, reflection and the status interceptor (no port yet).

    Args:
        add_servicers: ``(add_XServicer_to_server, servicer, service full name)`` per service.
        errors: the process's exception -> status table.
        serving: the health status it starts with.
        max_workers: threads serving calls (a stream holds one for its length),
            besides the ``long_calls`` limit's.
        thread_name_prefix: names those threads.
        interceptors: run before the status interceptor (e.g. the daemon's TCP token check).
        long_calls: the cap on long calls, refused past it.
    """
    if long_calls is not None:
        interceptors = [*interceptors, CallLimitInterceptor(long_calls)]
        max_workers += long_calls.calls.limit
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
        interceptors=[*interceptors, StatusInterceptor(errors)],
    )
    names = tuple(name for _, _, name in add_servicers)
    for add, servicer, _ in add_servicers:
        add(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, _HEALTH_NAME, reflection.SERVICE_NAME), server)
    built = Server(server, health_servicer, names)
    built.set_serving(serving)
    return built
