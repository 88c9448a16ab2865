"""kvd's ``/v1/templates``: named prefix templates over HTTP.

Each route is the request path's template call (the gRPC API's semantics and
limits): create (warmed before it returns), get, list by pages
(``page_size``, ``page_token``), update (TTL, description) and delete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from gateway.http_api.common import Int32, Int64, api_state, caller_key, on_thread
from gateway.request_path import NewTemplate, RequestPath
from gateway.templates import Template
from gateway.tenants import SCOPE_TEMPLATES_WRITE

T = TypeVar("T")

router = APIRouter(prefix="/v1/templates")


class TemplateMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str


class TemplateCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    content: str = ""
    messages: list[TemplateMessage] = []
    ttl_seconds: Int64 = 0
    description: str = ""


class TemplateUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_seconds: Int64 | None = None
    description: str | None = None


async def _as_tenant(request: Request, scope: str | None, fn: Callable[[RequestPath, str], T]) -> T:
    """``fn(request path, the caller's tenant)`` on a worker thread, once the caller's key has ``scope``."""
    requests, key = api_state(request).requests, caller_key(request)
    return await on_thread(request, lambda: fn(requests, requests.authorize(key, scope).tenant))


@router.post("")
async def create_template(body: TemplateCreate, request: Request) -> dict:
    new = NewTemplate(body.name, body.content, tuple((m.role, m.content) for m in body.messages),
                      body.ttl_seconds, body.description)  # fmt: skip
    template = await _as_tenant(request, SCOPE_TEMPLATES_WRITE, lambda r, tenant: r.create_template(tenant, new))
    return template_json(template)


@router.get("")
async def list_templates(request: Request, page_size: Int32 = 0, page_token: str = "") -> dict:
    page = await _as_tenant(request, None, lambda r, tenant: r.list_templates(tenant, page_size, page_token))
    return {
        "object": "list",
        "data": [template_json(t, with_content=False) for t in page.templates],
        "next_page_token": page.next_page_token,
        "has_more": bool(page.next_page_token),
    }


@router.get("/{name}")
async def get_template(name: str, request: Request) -> dict:
    return template_json(await _as_tenant(request, None, lambda r, tenant: r.get_template(tenant, name)))


@router.patch("/{name}")
async def update_template(name: str, body: TemplateUpdate, request: Request) -> dict:
    template = await _as_tenant(
        request, SCOPE_TEMPLATES_WRITE,
        lambda r, tenant: r.update_template(tenant, name, body.ttl_seconds, body.description),
    )  # fmt: skip
    return template_json(template)


@router.delete("/{name}")
async def delete_template(name: str, request: Request) -> dict:
    await _as_tenant(request, SCOPE_TEMPLATES_WRITE, lambda r, tenant: r.delete_template(tenant, name))
    return {"id": name, "object": "template.deleted", "deleted": True}


def template_json(t: Template, with_content: bool = True) -> dict:
    """A template as the API shows it (a listing's without content or messages)."""
    return {
        "object": "template",
        "id": t.name,
        "name": t.name,
        "description": t.description,
        "token_count": len(t.token_ids),
        "cached_token_count": t.cached_tokens,
        "created_at": _whole_seconds(t.create_time),
        "expires_at": _whole_seconds(t.expire_time) if t.expire_time is not None else None,
        "content": t.content if with_content else "",
        "messages": [{"role": role, "content": content} for role, content in t.messages] if with_content else [],
    }


def _whole_seconds(seconds: float) -> int:
    """Seconds since the epoch, truncated as the gRPC API's ``Timestamp`` carries them (whole nanoseconds)."""
    return int(seconds * 1e9) // 1_000_000_000
