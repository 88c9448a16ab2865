"""The ASGI app: each surface's routes, the probes, the request counters, and errors in each API's shape."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.http_api import (
    anthropic_messages,
    models,
    openai_completions,
    server_routes,
    templates_routes,
    tokenize_routes,
)
from gateway.http_api.anthropic_diagnostics import MessageRecords
from gateway.http_api.common import ApiState, api_state
from gateway.http_api.errors import add_error_handlers
from gateway.http_api.metrics import HttpMetrics
from gateway.http_api.threads import WorkerThreads
from gateway.request_path import RequestPath
from kvd.common.grpc_server import OpenCalls

#: The API surfaces, one module of routes each.
SURFACES = (openai_completions, anthropic_messages, models, tokenize_routes, templates_routes, server_routes)


def create_app(
    requests: RequestPath, threads: WorkerThreads, open_calls: OpenCalls, served_model_names: Sequence[str] = ()
) -> FastAPI:
    """Args:
    served_model_names: the names the model answers to (``--served-model-name``); empty: its own.
    """
    # No redirects: a path with a trailing slash (an empty template name) is a 404, as any unknown path.
    app = FastAPI(title="kvd", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    metrics = HttpMetrics(open_calls)
    app.state.api = ApiState(
        requests, threads, open_calls, int(time.time()), tuple(served_model_names), metrics, MessageRecords()
    )
    for surface in SURFACES:
        app.include_router(surface.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    metrics.count_requests(app)
    add_error_handlers(app)
    return app


async def health() -> dict:
    """The process answers (liveness)."""
    return {"status": "ok"}


async def ready(request: Request) -> JSONResponse:
    """At least one engine replica serves (readiness), as the gRPC health check says."""
    serving = api_state(request).requests.serving()
    return JSONResponse({"status": "ready" if serving else "no engine replica serving", "replicas": len(serving)},
                        status_code=200 if serving else 503)  # fmt: skip
