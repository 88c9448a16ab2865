"""The HTTP API's Prometheus metrics: its requests by route and status, and the process's own.

Beside them, the prompt cache's per tenant (``cache_diagnosis``: hit rates,
where prompts diverge), counted by every request path. ``GET /metrics``
(``server_routes``) serves this registry in Prometheus' text format.
Requests are counted by an ASGI wrapper (not a ``BaseHTTPMiddleware``, which
would buffer a stream and hide its client's disconnect from the route).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, PlatformCollector, ProcessCollector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import cache_diagnosis
from kvd.common.grpc_server import OpenCalls


class HttpMetrics:
    """Args:
    open_calls: the generations open in the process (their limit is shown).
    """

    def __init__(self, open_calls: OpenCalls) -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.requests = Counter(
            "kvd_gateway_http_requests",
            "HTTP requests answered, by method, route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        limit = Gauge("kvd_gateway_max_open_requests", "generations held at once at most", registry=self.registry)
        limit.set(open_calls.limit)
        cache_diagnosis.register(self.registry)

    def count_requests(self, app: FastAPI) -> None:
        """Counts every request ``app`` answers, by its route's path (``unmatched``: no route)."""
        app.add_middleware(_CountRequests, metrics=self)


class _CountRequests:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # no reply started: the server answers 500

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(scope.get("method", ""), path, str(status)).inc()
