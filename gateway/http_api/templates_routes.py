"""``/v1/templates``: named prefix templates over HTTP.

Each route is the gRPC call of the same name, in-process, so the semantics and
limits are the gRPC API's: create (warmed before it returns), get, list by
pages (``page_size``, ``page_token``), update (TTL, description) and delete.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.http_api.calls import LocalCall, api_error
from gateway.http_api.schemas import Int32, TemplateCreate, TemplateUpdate
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

router = APIRouter(prefix="/v1/templates")


async def _run(request: Request, method: str, make_message):
    """The service's ``method`` on the message ``make_message()`` builds (its
    ValueError too is a 400), on a worker thread."""
    state = request.app.state
    call = LocalCall(request.headers.get("authorization"))
    try:
        return await state.relay.call(call, lambda: getattr(state.service, method)(make_message(), call))
    except Exception as exc:
        raise api_error(exc) from exc


@router.post("")
async def create_template(body: TemplateCreate, request: Request) -> dict:
    def message():
        return pb.CreateTemplateRequest(
            name=body.name, content=body.content, ttl_seconds=body.ttl_seconds, description=body.description,
            messages=[epb.ChatMessage(role=m.role, content=m.content) for m in body.messages],
        )  # fmt: skip

    return template_json(await _run(request, "CreateTemplate", message))


@router.get("")
async def list_templates(request: Request, page_size: Int32 = 0, page_token: str = "") -> dict:
    reply = await _run(
        request, "ListTemplates", lambda: pb.ListTemplatesRequest(page_size=page_size, page_token=page_token)
    )
    return {
        "object": "list",
        "data": [template_json(t) for t in reply.templates],
        "next_page_token": reply.next_page_token,
        "has_more": bool(reply.next_page_token),
    }


@router.get("/{name}")
async def get_template(name: str, request: Request) -> dict:
    return template_json(await _run(request, "GetTemplate", lambda: pb.GetTemplateRequest(name=name)))


@router.patch("/{name}")
async def update_template(name: str, body: TemplateUpdate, request: Request) -> dict:
    def message():
        out = pb.UpdateTemplateRequest(name=name)
        if body.ttl_seconds is not None:
            out.ttl_seconds = body.ttl_seconds
        if body.description is not None:
            out.description = body.description
        return out

    return template_json(await _run(request, "UpdateTemplate", message))


@router.delete("/{name}")
async def delete_template(name: str, request: Request) -> dict:
    await _run(request, "DeleteTemplate", lambda: pb.DeleteTemplateRequest(name=name))
    return {"id": name, "object": "template.deleted", "deleted": True}


def template_json(t: pb.Template) -> dict:
    return {
        "object": "template",
        "id": t.name,
        "name": t.name,
        "description": t.description,
        "token_count": t.token_count,
        "cached_token_count": t.cached_token_count,
        "created_at": t.create_time.seconds,
        "expires_at": t.expire_time.seconds if t.HasField("expire_time") else None,
        "content": t.content,
        "messages": [{"role": m.role, "content": m.content} for m in t.messages],
    }
