"""The server's own routes beside the APIs: ``GET /version`` and ``GET /metrics`` (open, as ``/health``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvd
from gateway.http_api.common import api_state

router = APIRouter()


@router.get("/version")
async def version() -> dict:
    """kvd's version, as vLLM's ``/version`` gives its own."""
    return {"version": kvd.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The HTTP API's Prometheus registry, in the text format."""
    return Response(generate_latest(api_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
