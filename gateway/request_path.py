"""The gateway's request path: what both public APIs call, with plain arguments.

``RequestPath`` checks a request's fields (``gateway.request_checks``),
authorizes its caller (``gateway.tenants``), builds the engine's request and
what routes it, and relays it from the replica the router picks
(``gateway.relay``); it creates, reads, lists, updates and deletes templates,
and tells what the engines serve. The gRPC servicer (``gateway.service``) and
the HTTP routes (``gateway.http_api``) are adapters from their protocol to it.
What it refuses raises ``RequestError`` (or an exception
``gateway.error_statuses`` gives a status).

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from gateway import cache_diagnosis, tool_calls
from gateway.cache_diagnosis import PromptHistory
from gateway.cache_marks import NO_MARKS, CacheTtls, PlacedMarks, chat_prefix, place
from gateway.keeper import TemplateKeeper
from gateway.prompts import own_ids, template_ids, templated_ids
from gateway.relay import CallLifetime, EngineRequest, Relay
from gateway.replicas import ReplicaPool
from gateway.request_checks import check_create, check_generate, check_list, check_update
from gateway.route_types import ReplicaView
from gateway.router import NoReplica, RouteKey
from gateway.template_cache import TemplateCache
from gateway.templates import StoreUnavailable, Template, TemplatePage, TemplateStore, check_name, warm_member
from gateway.tenants import Authenticator, Principal, RequestSlots, TenantLimits, tenant_salt
from gateway.tokenizer import GatewayTokenizer, Message
from kvd.common.field_error import FieldError
from kvd.common.hashing import encode_extra_keys, hash_token_ids
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger("gateway.request_path")

# A template's warming prefill, for a caller that set no deadline.
WARM_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NewTemplate:
    """A template to create, as a caller gives it."""

    name: str
    content: str = ""
    messages: tuple[Message, ...] = ()  # a chat template's (role, content)
    ttl_seconds: int = 0
    description: str = ""

    def as_request(self) -> pb.CreateTemplateRequest:
        """The gRPC request it is (what the checks read)."""
        return pb.CreateTemplateRequest(
            name=self.name, content=self.content, ttl_seconds=self.ttl_seconds, description=self.description,
            messages=[epb.ChatMessage(role=role, content=content) for role, content in self.messages],
        )  # fmt: skip


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica as ``info`` shows it: the router's view, and the templates pinned in its cache."""

    view: ReplicaView
    templates: int


@dataclass(frozen=True)
class GatewayInfo:
    """What ``info`` tells a tenant."""

    model: epb.InfoResponse  # the engines' (any replica answers alike)
    templates: int  # the tenant's (0 while Redis is down)
    replicas: tuple[ReplicaInfo, ...]


class RequestPath:
    """Args:
    store: the templates, in Redis.
    pool: the engine replicas (and their router, ``pool.router``).
    keeper: keeps templates warm and pinned.
    auth: checks callers' keys.
    limits: each tenant's limits.
    tool_prompt: how tools reach the model when a request leaves it unset (--tool-prompt).
    cache_ttls: how long cache breakpoints keep their prefixes (--cache-ttl-5m-s, --cache-ttl-1h-s).
    """

    def __init__(
        self,
        store: TemplateStore,
        pool: ReplicaPool,
        keeper: TemplateKeeper,
        auth: Authenticator,
        limits: TenantLimits | None = None,
        tool_prompt: epb.ToolPrompt.ValueType = epb.TOOL_PROMPT_AUTO,
        cache_ttls: CacheTtls | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.router = pool.router
        self.keeper = keeper
        self.auth = auth
        self.limits = limits or TenantLimits()
        self.relay = Relay(pool, RequestSlots(self.limits.max_concurrent_requests))
        self.tokenizer = GatewayTokenizer(lambda: pool.any_serving().tokenizer_files())
        self.templates = TemplateCache(store)
        self.tool_prompt = tool_prompt
        self.cache_ttls = cache_ttls or CacheTtls()
        self.history = PromptHistory()

    def authorize(self, key: str | None, scope: str | None) -> Principal:
        """The caller of ``key`` (see ``Authenticator.authorize``)."""
        return self.auth.authorize(key, scope)

    # --------------------------------------------------------- generation

    def generate(self, tenant: str, request: pb.GenerateRequest, call: CallLifetime) -> Iterator[pb.GenerateResponse]:
        """The request's replies as they come (a generator: nothing runs before the first ``next``);
        with tools, the calls the model made on the last one (``gateway.tool_calls``); asked for,
        why its prompt missed the cache (``gateway.cache_diagnosis``)."""
        engine_request = self.engine_request(tenant, request)
        prompt = engine_request.message
        divergence = self.history.observe(prompt.cache_salt, prompt.token_ids.ids) if prompt.token_ids.ids else None
        replies = self.relay.stream(tenant, engine_request, call)
        calls = tool_calls.reader(request)
        for reply in replies if calls is None else calls.relay(replies):
            if reply.HasField("usage"):
                cache_diagnosis.record(tenant, reply.usage, divergence)
                if request.diagnose_cache:
                    reply.cache_diagnosis.CopyFrom(
                        cache_diagnosis.diagnosis(prompt.token_ids.ids, divergence, reply.usage, self.tokenizer.decode)
                    )
            yield reply

    def complete(self, tenant: str, request: pb.GenerateRequest, call: CallLifetime) -> pb.GenerateResponse:
        """The request's replies as one."""
        whole = pb.GenerateResponse()
        for message in self.generate(tenant, request, call):
            add_message(whole, message)
        return whole

    def engine_request(self, tenant: str, request: pb.GenerateRequest) -> EngineRequest:
        """The engine's request for a checked ``request``, and what routes it.

        Its prompt goes as token ids (tokenized here, as the engines would):
        its blocks' hashes route it, its cache breakpoints are token counts
        of it, and the prompt history compares it with the tenant's last ones.
        """
        check_generate(request)
        if self.tool_prompt and request.WhichOneof("prompt") == "chat" and not request.chat.tool_prompt:
            request = _with_tool_prompt(request, self.tool_prompt)
        out = epb.GenerateRequest(cache_salt=tenant_salt(tenant, request.cache_salt))
        out.sampling.CopyFrom(request.sampling)
        tool_calls.constrain(out.sampling, request)
        kind = request.WhichOneof("prompt")
        template = self.templates.get(tenant, request.template) if request.template else None
        if template is not None:
            prompt = templated_ids(self.tokenizer, template, request)
            out.token_ids.ids.extend(prompt.token_ids)
            member, template_tokens = warm_member(tenant, request.template), prompt.template_tokens
        elif kind == "text" and not request.text:  # the engine says what an empty prompt is
            out.text = request.text
            return EngineRequest(out, 0, RouteKey())
        else:
            out.token_ids.ids.extend(own_ids(self.tokenizer, request))
            # A cache key routes as a template would (its rendezvous home), within the tenant.
            member = cache_key_member(tenant, request.cache_key) if request.cache_key else ""
            template_tokens = 0
        marks = self._marks(tenant, request, template, out)
        if not marks.empty:
            out.cache_marks.CopyFrom(marks.marks)
        if template is None and not self._by_prefix():
            return EngineRequest(out, 0, RouteKey(template=member), marks)
        return EngineRequest(out, template_tokens, self._route_key(out, member, template_tokens), marks)

    def _marks(self, tenant: str, request: pb.GenerateRequest, template: Template | None, out) -> PlacedMarks:
        """The request's cache breakpoints as cache marks over its prompt's tokens."""
        if not request.cache_breakpoints:
            return NO_MARKS

        def prefix_ids(message: int, content_chars: int) -> list[int]:
            cut = pb.GenerateRequest(chat=chat_prefix(request.chat, message, content_chars))
            if template is not None:
                return templated_ids(self.tokenizer, template, cut).token_ids
            return self.tokenizer.chat_ids(cut.chat)

        block_size = self.pool.any_serving().model_info().block_size
        quota = self.limits.max_pinned_blocks
        return place(request, out.token_ids.ids, prefix_ids, block_size, self.cache_ttls, tenant, quota)

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

    # ----------------------------------------------------------- templates

    def create_template(self, tenant: str, new: NewTemplate, timeout_s: float | None = WARM_TIMEOUT_S) -> Template:
        """Stores a template and warms it (pinned on a replica) before it returns.

        Args:
            timeout_s: the warming's limit (None: ``--replica-wait-s`` for a replica, none for the prefill).
        """
        check_create(new.as_request())
        token_ids = template_ids(self.tokenizer, new.content, new.messages)
        engine = self.pool.any_serving()
        max_context = engine.model_info().max_context
        if len(token_ids) >= max_context:
            raise FieldError(
                None,
                f"the template is {len(token_ids)} tokens; the model's context of {max_context} tokens "
                "leaves no room for a prompt",
            )
        pin_blocks = len(token_ids) // engine.model_info().block_size
        template = self.store.create(
            tenant, new.name, new.content, token_ids, new.ttl_seconds, new.description,
            self.limits, pin_blocks, new.messages,
        )  # fmt: skip
        try:
            self.keeper.warm(template, timeout_s=timeout_s)
        except (grpc.RpcError, NoReplica):
            # Not usable as promised: the name stays free for another try.
            self.store.delete(tenant, new.name)
            raise
        log.info("template created", extra={"tenant": tenant, "template": new.name, "tokens": len(token_ids)})
        return self.store.get(tenant, new.name)

    def get_template(self, tenant: str, name: str) -> Template:
        check_name(name)
        return self.store.get(tenant, name)

    def list_templates(self, tenant: str, page_size: int = 0, page_token: str = "") -> TemplatePage:
        check_list(pb.ListTemplatesRequest(page_size=page_size, page_token=page_token))
        return self.store.list(tenant, page_size, page_token)

    def update_template(
        self, tenant: str, name: str, ttl_seconds: int | None = None, description: str | None = None
    ) -> Template:
        """Sets a template's TTL and description (None: unchanged)."""
        request = pb.UpdateTemplateRequest(name=name, ttl_seconds=ttl_seconds, description=description)
        check_update(request)
        return self.store.update(tenant, name, ttl_seconds, description)

    def delete_template(self, tenant: str, name: str) -> None:
        check_name(name)
        self.store.delete(tenant, name)
        self.keeper.release(tenant, name)  # or the keeper's sweep, if a replica is down
        log.info("template deleted", extra={"tenant": tenant, "template": name})

    # ---------------------------------------------------------------- info

    def model_info(self) -> epb.InfoResponse:
        """The served model (any serving replica answers alike).

        Raises:
            NoReplica: none serves.
        """
        return self.pool.any_serving().model_info()

    def info(self, tenant: str) -> GatewayInfo:
        model = self.model_info()
        try:
            templates = self.store.count(tenant)
        except StoreUnavailable:
            templates = 0  # Info stays useful while Redis is down
        replicas = tuple(ReplicaInfo(r, self.keeper.pinned_on(r.address)) for r in self.router.snapshot())
        return GatewayInfo(model, templates, replicas)

    def serving(self) -> Sequence[str]:
        """The replicas serving now (readiness)."""
        return self.router.serving()

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` as the engines tokenize a text prompt (``add_special_tokens=False``: no BOS)."""
        return self.tokenizer.text_ids(text, add_special_tokens)

    def tokenize_chat(self, chat: epb.ChatPrompt) -> list[int]:
        """``chat`` as the engines render a chat prompt (FieldError naming ``chat.messages``: refused)."""
        return self.tokenizer.chat_ids(chat)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def free_slots(self, tenant: str) -> int | None:
        """How many more requests ``tenant`` may run at once here now (None: no limit)."""
        limit = self.limits.max_concurrent_requests
        return max(limit - self.relay.slots.running(tenant), 1) if limit else None


def cache_key_member(tenant: str, cache_key: str) -> str:
    """The router's key for a request's cache key: ':' is in no template name,
    so it never meets a template's, and the tenant keeps tenants' keys apart."""
    return f"{tenant}/:key:{cache_key}"


def _with_tool_prompt(request: pb.GenerateRequest, tool_prompt: epb.ToolPrompt.ValueType) -> pb.GenerateRequest:
    """A copy of ``request`` whose tools reach the model as the gateway's --tool-prompt says."""
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.chat.tool_prompt = tool_prompt
    return out


def add_message(whole: pb.GenerateResponse, message: pb.GenerateResponse) -> None:
    """Adds one streamed message to a whole reply (the last one brings the finish and the usage)."""
    whole.token_ids.extend(message.token_ids)
    whole.text += message.text
    whole.logprobs.extend(message.logprobs)
    whole.top_logprobs.extend(message.top_logprobs)
    if message.HasField("prompt_logprobs"):
        whole.prompt_logprobs.CopyFrom(message.prompt_logprobs)
    whole.tool_calls.extend(message.tool_calls)
    if message.HasField("cache_diagnosis"):
        whole.cache_diagnosis.CopyFrom(message.cache_diagnosis)
    if message.HasField("usage"):
        whole.finish_reason = message.finish_reason
        whole.usage.CopyFrom(message.usage)
