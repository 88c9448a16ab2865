"""The ASGI app: the routes, ``/v1/models``, the probes, and every error in OpenAI's shape."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.http_api import completions, templates_routes
from gateway.http_api.calls import ApiError, LocalCall, api_error, log
from gateway.http_api.relay import Relay
from gateway.service import GatewayService
from kvd.common.grpc_server import OpenCalls
from kvd_api.gateway.v1 import gateway_pb2 as pb


def create_app(service: GatewayService, relay: Relay, open_calls: OpenCalls) -> FastAPI:
    # No redirects: a path with a trailing slash (an empty template name) is a 404, as any unknown path.
    app = FastAPI(title="kvd", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.service = service
    app.state.relay = relay
    app.state.open_calls = open_calls
    app.state.started = int(time.time())
    app.include_router(completions.router)
    app.include_router(templates_routes.router)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    return app


async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [await _model(request)]}


async def get_model(model: str, request: Request) -> dict:
    served = await _model(request)
    if model != served["id"]:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served['id']!r}", "model",
                       "model_not_found")  # fmt: skip
    return served


async def _model(request: Request) -> dict:
    """The served model, from the gateway's ``Info`` (which checks the key)."""
    state = request.app.state
    call = LocalCall(request.headers.get("authorization"))
    try:
        info = await state.relay.call(call, lambda: state.service.Info(pb.InfoRequest(), call))
    except Exception as exc:
        raise api_error(exc) from exc
    return {"id": info.model, "object": "model", "created": state.started, "owned_by": "kvd",
            "max_model_len": info.max_context, "context_length": info.max_context}  # fmt: skip


async def health() -> dict:
    """The process answers (liveness)."""
    return {"status": "ok"}


async def ready(request: Request) -> JSONResponse:
    """At least one engine replica serves (readiness), as the gRPC health check says."""
    serving = request.app.state.service.router.serving()
    return JSONResponse({"status": "ready" if serving else "no engine replica serving", "replicas": len(serving)},
                        status_code=200 if serving else 503)  # fmt: skip


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request body")
    if message.startswith("Value error, "):  # our own checks name their field first
        message = message.removeprefix("Value error, ")
        param = message.split(":", 1)[0] if ":" in message else param
    elif param:
        message = f"{param}: {message}"
    return JSONResponse(ApiError(400, message, param, "invalid_argument").body(), status_code=400)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error", exc_info=exc, extra={"path": request.url.path})
    return JSONResponse(ApiError(500, "internal error; see the gateway's log", code="internal").body(), 500)
