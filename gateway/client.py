"""A small Python client of the gateway.

    from gateway.client import GatewayClient

    with GatewayClient("127.0.0.1:50051", api_key="kvd-...") as kvd:
        kvd.create_template("support-bot", "You are the support bot of ACME. ...")
        reply = kvd.complete("How do I reset my password?", template="support-bot", max_new_tokens=64)
        print(reply.text, reply.usage.cached_prompt_tokens)
        kvd.create_template("support-chat", messages=[("system", "You are the support bot of ACME.")])
        reply = kvd.complete(chat=[("user", "How do I reset my password?")], template="support-chat")
        for chunk in kvd.generate("Tell me a story", max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Errors are ``grpc.RpcError`` with the gateway's status and message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb
from kvd_api.gateway.v1 import gateway_pb2_grpc as pb_grpc


class GatewayClient:
    """Args:
    address: ``HOST:PORT`` of the gateway.
    api_key: sent as ``authorization: Bearer <key>`` (not needed in single-user mode).
    root_certificates: a PEM file to trust for TLS; None: plaintext.
    timeout_s: the deadline of every call.
    """

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        root_certificates: Path | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates.read_bytes())
            self.channel = grpc.secure_channel(address, credentials)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GatewayStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
        self.timeout_s = timeout_s

    # --------------------------------------------------------- generation

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Streams the output; see ``request`` for the arguments."""
        return self.stub.Generate(self.request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata)

    def complete(self, prompt: str | Sequence[int] | None = None, **kwargs) -> pb.GenerateResponse:
        """The whole output in one message; see ``request`` for the arguments."""
        return self.stub.Complete(self.request(prompt, **kwargs), timeout=self.timeout_s, metadata=self.metadata)

    @staticmethod
    def request(
        prompt: str | Sequence[int] | None = None,
        *,
        chat: Sequence[tuple[str, str]] = (),
        template: str = "",
        cache_salt: bytes = b"",
        cache_key: str = "",
        cache_breakpoints: Sequence[pb.CacheBreakpoint] = (),
        diagnose_cache: bool = False,
        **sampling,
    ) -> pb.GenerateRequest:
        """A request: ``prompt`` as text or token ids, or ``chat`` as (role,
        content) pairs; ``cache_key`` keeps requests sharing it on one replica;
        ``cache_breakpoints`` keep prefixes cached for a while (``gateway.cache_marks``);
        ``diagnose_cache`` asks why the prompt missed the cache; ``sampling``
        takes the SamplingParams fields (max_new_tokens, temperature, top_p,
        top_k, seed, stop, ignore_eos, ...)."""
        request = pb.GenerateRequest(
            template=template, cache_salt=cache_salt, cache_key=cache_key, sampling=epb.SamplingParams(**sampling),
            cache_breakpoints=cache_breakpoints, diagnose_cache=diagnose_cache,
        )  # fmt: skip
        if chat:
            request.chat.messages.extend(epb.ChatMessage(role=r, content=c) for r, c in chat)
        elif isinstance(prompt, str):
            request.text = prompt
        elif prompt is not None:
            request.token_ids.ids.extend(prompt)
        return request

    # ----------------------------------------------------------- templates

    def create_template(
        self,
        name: str,
        content: str = "",
        ttl_seconds: int = 0,
        description: str = "",
        messages: Sequence[tuple[str, str]] = (),
    ) -> pb.Template:
        """A text template (``content``) or a chat template (``messages`` as
        (role, content) pairs, for chat requests)."""
        request = pb.CreateTemplateRequest(
            name=name,
            content=content,
            ttl_seconds=ttl_seconds,
            description=description,
            messages=[epb.ChatMessage(role=r, content=c) for r, c in messages],
        )
        return self.stub.CreateTemplate(request, timeout=self.timeout_s, metadata=self.metadata)

    def get_template(self, name: str) -> pb.Template:
        return self.stub.GetTemplate(pb.GetTemplateRequest(name=name), timeout=self.timeout_s, metadata=self.metadata)

    def list_templates(self, page_size: int = 0) -> Iterator[pb.Template]:
        """Every template of the caller's tenant, in name order (page by page)."""
        token = ""
        while True:
            page = self.stub.ListTemplates(
                pb.ListTemplatesRequest(page_size=page_size, page_token=token),
                timeout=self.timeout_s,
                metadata=self.metadata,
            )
            yield from page.templates
            token = page.next_page_token
            if not token:
                return

    def update_template(self, name: str, ttl_seconds: int | None = None, description: str | None = None) -> pb.Template:
        request = pb.UpdateTemplateRequest(name=name, ttl_seconds=ttl_seconds, description=description)
        return self.stub.UpdateTemplate(request, timeout=self.timeout_s, metadata=self.metadata)

    def delete_template(self, name: str) -> None:
        self.stub.DeleteTemplate(pb.DeleteTemplateRequest(name=name), timeout=self.timeout_s, metadata=self.metadata)

    def info(self) -> pb.InfoResponse:
        return self.stub.Info(pb.InfoRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
