"""The public gRPC API: generation through the engine replicas, templates in Redis.

A templated request's prompt is the template's token ids followed by the
prompt's own (tokenized separately, so the template's cached blocks are
reused exactly), or for a chat template its messages and the request's
rendered together (``gateway.prompts``). The gateway tokenizes with the
engines' tokenizer, fetched once (``gateway.tokenizer``), and keeps templates
in memory (``gateway.template_cache``), so a templated request costs one
small Redis read more than a plain one. Every request carries its tenant's
cache salt.

Each request goes to the replica the router picks (see ``gateway.router``):
a templated one by its template; any other by the block hashes of its
tokens. A text or chat prompt is tokenized first, in the gateway with the
replicas' tokenizer (every replica has the same), and sent on as those token
ids, so the replica computes exactly the blocks its hashes name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from gateway.keeper import TemplateKeeper
from gateway.prompts import own_ids, template_ids, templated_ids
from gateway.replicas import ReplicaPool, engine_error, remaining_s
from gateway.request_checks import check_create, check_generate, check_list, check_update
from gateway.router import NoReplica, RouteKey
from gateway.template_cache import TemplateCache
from gateway.templates import (
    StoreUnavailable,
    Template,
    TemplateExists,
    TemplateNotFound,
    TemplateStore,
    check_name,
    warm_member,
)
from gateway.tenants import (
    SCOPE_GENERATE,
    SCOPE_TEMPLATES_WRITE,
    Authenticator,
    LimitExceeded,
    RequestSlots,
    TenantLimits,
    tenant_salt,
)
from gateway.tokenizer import GatewayTokenizer
from kvd.common.grpc_server import StatusTable
from kvd.common.hashing import encode_extra_keys, hash_token_ids
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pb_grpc

log = logging.getLogger("gateway.service")

VERSION = "0.1.0"
# A template's warming prefill, for a caller that set no deadline.
WARM_TIMEOUT_S = 120.0
#: An engine's refusals before a request's first token that another replica may answer.
_HANDED_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

# The gateway's exceptions and the statuses callers get for them (kvd.common.grpc_server).
STATUS_BY_ERROR: StatusTable = (
    (grpc.RpcError, engine_error),  # from an engine
    (TemplateNotFound, grpc.StatusCode.NOT_FOUND),
    (TemplateExists, grpc.StatusCode.ALREADY_EXISTS),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NoReplica, grpc.StatusCode.UNAVAILABLE),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


class GatewayService(pb_grpc.GatewayServicer):
    def __init__(
        self,
        store: TemplateStore,
        pool: ReplicaPool,
        keeper: TemplateKeeper,
        auth: Authenticator,
        limits: TenantLimits | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.router = pool.router
        self.keeper = keeper
        self.auth = auth
        self.limits = limits or TenantLimits()
        self.slots = RequestSlots(self.limits.max_concurrent_requests)
        self.tokenizer = GatewayTokenizer(lambda: pool.any_serving().tokenizer_files())
        self.templates = TemplateCache(store)

    # --------------------------------------------------------- generation

    def Generate(self, request, context):
        principal = self.auth.authorize(context, SCOPE_GENERATE)
        engine_request, template_tokens, key = self._engine_request(principal.tenant, request)
        yield from self._relay(principal.tenant, engine_request, template_tokens, key, context)

    def Complete(self, request, context):
        principal = self.auth.authorize(context, SCOPE_GENERATE)
        engine_request, template_tokens, key = self._engine_request(principal.tenant, request)
        whole = pb.GenerateResponse()
        for message in self._relay(principal.tenant, engine_request, template_tokens, key, context):
            whole.token_ids.extend(message.token_ids)
            whole.text += message.text
            whole.logprobs.extend(message.logprobs)
            whole.top_logprobs.extend(message.top_logprobs)
            if message.HasField("usage"):
                whole.finish_reason = message.finish_reason
                whole.usage.CopyFrom(message.usage)
        return whole

    def _engine_request(self, tenant: str, request) -> tuple[epb.GenerateRequest, int, RouteKey]:
        """The engine's request (template tokens first), its template's token
        count, and what routes it."""
        check_generate(request)
        out = epb.GenerateRequest(cache_salt=tenant_salt(tenant, request.cache_salt))
        out.sampling.CopyFrom(request.sampling)
        kind = request.WhichOneof("prompt")
        if request.template:
            template = self.templates.get(tenant, request.template)
            ids, template_tokens = templated_ids(self.tokenizer, template, request)
            out.token_ids.ids.extend(ids)
            member = warm_member(tenant, request.template)
            return out, template_tokens, self._route_key(out, member, template_tokens)
        # A cache key routes as a template would (its rendezvous home), within the tenant.
        affinity = cache_key_member(tenant, request.cache_key) if request.cache_key else ""
        if not self._by_prefix() or (kind == "text" and not request.text):
            if kind == "text":
                out.text = request.text
            elif kind == "chat":
                out.chat.CopyFrom(request.chat)
            else:
                out.token_ids.CopyFrom(request.token_ids)
            return out, 0, RouteKey(template=affinity)
        out.token_ids.ids.extend(own_ids(self.tokenizer, request))
        return out, 0, self._route_key(out, affinity)

    def _route_key(self, out: epb.GenerateRequest, template: str = "", template_tokens: int = 0) -> RouteKey:
        """What routes a request whose token ids are known: its blocks' hashes, as its daemon will compute them."""
        if self.router.config.policy == "round-robin":
            return RouteKey(template=template)
        block_size = self.pool.any_serving().model_info().block_size
        hashes = hash_token_ids(out.token_ids.ids, block_size, encode_extra_keys(out.cache_salt))
        return RouteKey(template, tuple(hashes), len(out.token_ids.ids), block_size, template_tokens // block_size)

    def _by_prefix(self) -> bool:
        """Whether a plain request's blocks should pick its replica: only when
        there is a choice to make (tokenizing and hashing cost time)."""
        return self.router.config.policy != "round-robin" and len(self.router.serving()) > 1

    def _relay(
        self, tenant: str, engine_request: epb.GenerateRequest, template_tokens: int, key: RouteKey, context
    ) -> Iterator:
        """Streams the request from the replica the router picks. A replica
        that refuses the request before its first token (UNAVAILABLE:
        draining, gone; RESOURCE_EXHAUSTED: full) hands it to the next one the
        router picks, until none is left (``_next_route``: during a drain or a
        restart, a request waits for a replica to come back)."""
        # NoReplica and LimitExceeded reach the client through the status table.
        tried: dict[str, int] = {}  # replicas that refused it -> their comebacks then
        route = self._next_route(key, tried, context)
        self.slots.take(tenant)
        released = _Once(lambda: self.slots.give_back(tenant))
        context.add_callback(released)  # a cancelled stream may never resume this generator
        try:
            while True:
                comebacks = self.router.comebacks(route.address)
                refused = yield from self._relay_once(route, engine_request, template_tokens, context)
                if refused is None:
                    return
                tried[route.address] = comebacks
                try:
                    # A full replica (RESOURCE_EXHAUSTED) is no reason to wait: the client backs off.
                    route = self._next_route(key, tried, context, wait=refused[0] == grpc.StatusCode.UNAVAILABLE)
                except NoReplica:
                    context.abort(*refused)
                log.info("request handed to another replica", extra={"refused_by": sorted(tried)})
        finally:
            released()

    def _next_route(self, key: RouteKey, tried: dict[str, int], context, wait: bool = True):
        """The replica for the request's next try: a serving one that has not
        refused it. When there is none but one served lately (a drain or a
        restart under way), waits for one, within ``--replica-wait-s`` and the
        caller's deadline (``ReplicaPool.await_serving``).

        Raises:
            NoReplica: none came.
        """
        left = remaining_s(context)
        give_up_at = time.monotonic() + (self.pool.replica_wait_s if left is None else left)
        while True:
            try:
                return self.router.route(key, exclude=self.router.refusers(tried))
            except NoReplica:
                if not wait or not self.pool.await_serving(tried, give_up_at - time.monotonic()):
                    raise

    def _relay_once(self, route, engine_request: epb.GenerateRequest, template_tokens: int, context):
        """One replica's try (a generator). Returns None when the call is over,
        or the status a client would get when the replica refused the request
        before anything reached the client (another replica may take it)."""
        address = route.address
        link = self.pool.link(address)
        ticket = self.router.started(address, route.uncached_tokens, route.new_keys)
        finished = _Once(lambda: self.router.finished(address, ticket))
        context.add_callback(finished)
        call = link.stub.Generate(engine_request, timeout=remaining_s(context))
        # A client that cancels (or whose deadline passes) cancels the engine's
        # request, which frees its blocks. NOTE: a call the client abandoned
        # before a worker thread took it up is already over: add_callback
        # refuses the callback then, and the engine's request is cancelled here.
        if not context.add_callback(call.cancel):
            call.cancel()
        streamed = False
        try:
            for message in call:
                if not streamed:  # its prefill is done: no longer queued work there
                    self.router.prefilled(address, ticket)
                    streamed = True
                yield _response(message, template_tokens)
        except grpc.RpcError as err:
            # NOTE: once a message reached the client, never retried elsewhere.
            # New requests route around the replica until its health check
            # says it serves again.
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(address)
            if err.code() in _HANDED_OVER and not streamed and context.is_active():
                return link.error(err)
            if context.is_active():
                context.abort(*link.error(err))
        finally:
            call.cancel()  # the stream was closed early (its client left): stop the engine's request
            finished()
        return None

    # ----------------------------------------------------------- templates

    def CreateTemplate(self, request, context):
        tenant = self.auth.authorize(context, SCOPE_TEMPLATES_WRITE).tenant
        check_create(request)
        messages = [(m.role, m.content) for m in request.messages]
        token_ids = template_ids(self.tokenizer, request.content, messages)
        engine = self.pool.any_serving()
        max_context = engine.model_info().max_context
        if len(token_ids) >= max_context:
            raise ValueError(
                f"the template is {len(token_ids)} tokens; the model's context of {max_context} tokens "
                "leaves no room for a prompt"
            )
        pin_blocks = len(token_ids) // engine.model_info().block_size
        template = self.store.create(
            tenant, request.name, request.content, token_ids, request.ttl_seconds, request.description,
            self.limits, pin_blocks, messages,
        )  # fmt: skip
        try:
            self.keeper.warm(template, timeout_s=remaining_s(context, WARM_TIMEOUT_S))
        except (grpc.RpcError, NoReplica):
            # Not usable as promised: the name stays free for another try.
            self.store.delete(tenant, request.name)
            raise
        log.info("template created", extra={"tenant": tenant, "template": request.name, "tokens": len(token_ids)})
        return _template_pb(self.store.get(tenant, request.name), with_content=True)

    def GetTemplate(self, request, context):
        tenant = self.auth.authorize(context, None).tenant
        check_name(request.name)
        return _template_pb(self.store.get(tenant, request.name), with_content=True)

    def ListTemplates(self, request, context):
        tenant = self.auth.authorize(context, None).tenant
        check_list(request)
        templates, next_token = self.store.list(tenant, request.page_size, request.page_token)
        return pb.ListTemplatesResponse(
            templates=[_template_pb(t, with_content=False) for t in templates], next_page_token=next_token
        )

    def UpdateTemplate(self, request, context):
        tenant = self.auth.authorize(context, SCOPE_TEMPLATES_WRITE).tenant
        check_update(request)
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        description = request.description if request.HasField("description") else None
        return _template_pb(self.store.update(tenant, request.name, ttl, description), with_content=True)

    def DeleteTemplate(self, request, context):
        tenant = self.auth.authorize(context, SCOPE_TEMPLATES_WRITE).tenant
        check_name(request.name)
        self.store.delete(tenant, request.name)
        self.keeper.release(tenant, request.name)  # or the keeper's sweep, if a replica is down
        log.info("template deleted", extra={"tenant": tenant, "template": request.name})
        return pb.DeleteTemplateResponse()

    # ---------------------------------------------------------------- info

    def Info(self, request, context):
        tenant = self.auth.authorize(context, None).tenant
        info = self.pool.any_serving().model_info()
        try:
            templates = self.store.count(tenant)
        except StoreUnavailable:
            templates = 0  # Info stays useful while Redis is down
        return pb.InfoResponse(
            model=info.model,
            model_type=info.model_type,
            block_size=info.block_size,
            max_context=info.max_context,
            templates=templates,
            version=VERSION,
            replicas=[
                pb.Replica(address=r.address, serving=r.serving, in_flight=r.in_flight,
                           known_blocks=r.known_blocks, templates=self.keeper.pinned_on(r.address))
                for r in self.router.snapshot()
            ],
        )  # fmt: skip


class _Once:
    """Calls ``fn`` the first time it is called, from whichever thread."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _response(message: epb.GenerateResponse, template_tokens: int) -> pb.GenerateResponse:
    out = pb.GenerateResponse(
        token_ids=message.token_ids,
        text=message.text,
        logprobs=message.logprobs,
        finish_reason=message.finish_reason,
        top_logprobs=message.top_logprobs,
    )
    if message.HasField("usage"):
        u = message.usage
        out.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                template_tokens=template_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                completion_tokens=u.completion_tokens,
                time_to_first_token_s=u.time_to_first_token_s,
                host_cached_prompt_tokens=u.host_cached_prompt_tokens,
                disk_cached_prompt_tokens=u.disk_cached_prompt_tokens,
            )
        )
    return out


def _template_pb(t: Template, with_content: bool) -> pb.Template:
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


def cache_key_member(tenant: str, cache_key: str) -> str:
    """The router's key for a request's cache key: ':' is in no template name,
    so it never meets a template's, and the tenant keeps tenants' keys apart."""
    return f"{tenant}/:key:{cache_key}"
