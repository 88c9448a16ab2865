"""OpenAI's ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model the engines serve, and its names.

The model answers to every name of ``--served-model-name`` (the first is the
one ``/v1/models`` lists); without it, to the engines' name for it (its
folder's name) and, for a model whose Hugging Face id the engines know (the
bundled SmolLM2, a snapshot in the Hugging Face cache: Info's ``hub_id``),
that id too, so a client configured from the model card finds it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.http_api.common import ApiState, api_state, caller_key, on_thread
from gateway.http_api.errors import ApiError
from gateway.tenants import SCOPE_GENERATE
from kvd_api.engine.v1 import engine_pb2 as epb

router = APIRouter(prefix="/v1/models")


@router.get("")
async def list_models(request: Request) -> dict:
    state = api_state(request)
    info = await _info(request, state)
    return {"object": "list", "data": [_card(state, info, model_names(state, info)[0])]}


@router.get("/{model:path}")
async def get_model(model: str, request: Request) -> dict:
    state = api_state(request)
    info = await _info(request, state)
    names = model_names(state, info)
    if model not in names:
        raise ApiError(404, _unknown(model, names), "model", "model_not_found")
    return _card(state, info, model)


def model_names(state: ApiState, info: epb.InfoResponse) -> list[str]:
    """Every name the served model answers to, the listed one first."""
    if state.served_model_names:
        return list(state.served_model_names)
    return [info.model, *([info.hub_id] if info.hub_id and info.hub_id != info.model else [])]


def served_model(state: ApiState, key: str | None, asked: str | None) -> tuple[str, epb.InfoResponse]:
    """The name a generation's reply gives the model (the one asked for; none
    asked: the listed one), and the engines' info. Another name is NOT_FOUND
    (once the key is known good). Runs on a worker thread."""
    info = state.requests.model_info()
    names = model_names(state, info)
    if asked is None:
        return names[0], info
    if asked not in names:
        state.requests.authorize(key, SCOPE_GENERATE)
        raise ApiError(404, _unknown(asked, names), "model", "model_not_found")
    return asked, info


def _unknown(asked: str, names: list[str]) -> str:
    return f"the model {asked!r} does not exist; this server serves {', '.join(repr(n) for n in names)}"


async def _info(request: Request, state: ApiState) -> epb.InfoResponse:
    """The engines' info, for any caller with a valid key."""
    key = caller_key(request)

    def model_info():
        state.requests.authorize(key, None)
        return state.requests.model_info()

    return await on_thread(request, model_info)


def _card(state: ApiState, info: epb.InfoResponse, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.started,
        "owned_by": "kvd",
        "root": info.hub_id or info.model,
        "parent": None,
        "max_model_len": info.max_context,
        "context_length": info.max_context,
    }
