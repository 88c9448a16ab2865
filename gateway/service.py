"""The public gRPC API: each RPC is the request path's call of the same name.

This adapter reads the caller's key from the call's metadata, turns the
protos into the request path's arguments (``gateway.request_path``) and its
results back into protos; the gRPC call context is the generation's
``CallLifetime`` (its deadline, its end). What the request path raises
reaches the caller through the server's status interceptor
(``gateway.error_statuses.STATUS_BY_ERROR``).
"""

from __future__ import annotations

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from gateway.replicas import remaining_s
from gateway.request_path import WARM_TIMEOUT_S, NewTemplate, RequestPath
from gateway.templates import Template
from gateway.tenants import SCOPE_GENERATE, SCOPE_TEMPLATES_WRITE, bearer_key
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pb_grpc

VERSION = "0.1.0"


class GatewayService(pb_grpc.GatewayServicer):
    def __init__(self, requests: RequestPath) -> None:
        self.requests = requests

    def _tenant(self, context: grpc.ServicerContext, scope: str | None) -> str:
        key = bearer_key(value for name, value in context.invocation_metadata() if name == "authorization")
        return self.requests.authorize(key, scope).tenant

    # --------------------------------------------------------- generation

    def Generate(self, request, context):
        tenant = self._tenant(context, SCOPE_GENERATE)
        yield from self.requests.generate(tenant, request, context)

    def Complete(self, request, context):
        tenant = self._tenant(context, SCOPE_GENERATE)
        return self.requests.complete(tenant, request, context)

    # ----------------------------------------------------------- templates

    def CreateTemplate(self, request, context):
        tenant = self._tenant(context, SCOPE_TEMPLATES_WRITE)
        new = NewTemplate(
            request.name, request.content, tuple((m.role, m.content) for m in request.messages),
            request.ttl_seconds, request.description,
        )  # fmt: skip
        template = self.requests.create_template(tenant, new, timeout_s=remaining_s(context, WARM_TIMEOUT_S))
        return template_pb(template, with_content=True)

    def GetTemplate(self, request, context):
        tenant = self._tenant(context, None)
        return template_pb(self.requests.get_template(tenant, request.name), with_content=True)

    def ListTemplates(self, request, context):
        tenant = self._tenant(context, None)
        page = self.requests.list_templates(tenant, request.page_size, request.page_token)
        return pb.ListTemplatesResponse(
            templates=[template_pb(t, with_content=False) for t in page.templates],
            next_page_token=page.next_page_token,
        )

    def UpdateTemplate(self, request, context):
        tenant = self._tenant(context, SCOPE_TEMPLATES_WRITE)
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        description = request.description if request.HasField("description") else None
        return template_pb(self.requests.update_template(tenant, request.name, ttl, description), with_content=True)

    def DeleteTemplate(self, request, context):
        tenant = self._tenant(context, SCOPE_TEMPLATES_WRITE)
        self.requests.delete_template(tenant, request.name)
        return pb.DeleteTemplateResponse()

    # ---------------------------------------------------------------- info

    def Info(self, request, context):
        info = self.requests.info(self._tenant(context, None))
        return pb.InfoResponse(
            model=info.model.model,
            model_type=info.model.model_type,
            block_size=info.model.block_size,
            max_context=info.model.max_context,
            templates=info.templates,
            version=VERSION,
            replicas=[
                pb.Replica(address=r.view.address, serving=r.view.serving, in_flight=r.view.in_flight,
                           known_blocks=r.view.known_blocks, templates=r.templates)
                for r in info.replicas
            ],
        )  # fmt: skip


def template_pb(t: Template, with_content: bool) -> pb.Template:
    out = pb.Template(
        name=t.name,
        description=t.description,
        token_count=len(t.token_ids),
        cached_token_count=t.cached_tokens,
        content=t.content if with_content else "",
        messages=[epb.ChatMessage(role=role, content=content) for role, content in t.messages] if with_content else [],
    )
    out.create_time.CopyFrom(_timestamp(t.create_time))
    if t.expire_time is not None:
        out.expire_time.CopyFrom(_timestamp(t.expire_time))
    return out


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp
