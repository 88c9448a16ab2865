"""OpenAI's ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model the engines serve."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.http_api.common import api_state, caller_key, on_thread
from gateway.http_api.errors import ApiError

router = APIRouter(prefix="/v1/models")


@router.get("")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [await _model(request)]}


@router.get("/{model:path}")
async def get_model(model: str, request: Request) -> dict:
    served = await _model(request)
    if model != served["id"]:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served['id']!r}", "model",
                       "model_not_found")  # fmt: skip
    return served


async def _model(request: Request) -> dict:
    """The served model, for any caller with a valid key."""
    state = api_state(request)
    key = caller_key(request)

    def model_info():
        state.requests.authorize(key, None)
        return state.requests.model_info()

    info = await on_thread(request, model_info)
    return {"id": info.model, "object": "model", "created": state.started, "owned_by": "kvd",
            "max_model_len": info.max_context, "context_length": info.max_context}  # fmt: skip
