"""Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin translation over the request path, as the OpenAI surface is: the
same tenants and keys (``x-api-key``, or ``Authorization: Bearer``), limits,
routing and generation. Text blocks become chat messages (a message's blocks
joined by newlines, the system prompt first), ``cache_control`` marks become
cache breakpoints (``gateway.cache_marks``): on a block, the prompt through
that block; on the top level, through the last message.

The reply's ``usage`` is the daemon's count: ``cache_read_input_tokens``
the prompt tokens served from the cache (kvd caches every prefix, marked or
not, so a read needs no mark), ``cache_creation_input_tokens`` the tokens
this request computed that its marks now keep pinned (by TTL in
``cache_creation``), ``input_tokens`` the rest. A breakpoint the tenant's
pin quota or the daemon's pin cap refused is still served: the reply's
``x-kvd-cache-unpinned-breakpoints`` header (whole replies) and
``usage.kvd.unpinned_breakpoints`` (both) count it.

A stream is Anthropic's events: ``message_start``, one text block
(``content_block_start``, ``content_block_delta``..., ``content_block_stop``),
``message_delta`` with the stop reason and the whole usage (which is known
only then: ``message_start`` carries zeros), ``message_stop``; an error after
the first event is an ``error`` event. Errors are in Anthropic's
shape (``errors``). A request with ``diagnostics`` gets Anthropic's
``diagnostics.cache_miss_reason`` and kvd's token-level diagnosis beside it
(``anthropic_diagnostics``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway.cache_diagnosis import as_json
from gateway.cache_marks import check_breakpoints, mark_parts
from gateway.http_api.anthropic_diagnostics import MessageRecords, PromptRecord, miss_reason
from gateway.http_api.anthropic_schemas import BLOCK_JOINER, CountTokensRequest, MessagesRequest, TextBlock
from gateway.http_api.common import (
    StartedStream,
    api_state,
    caller_key,
    on_thread,
    open_generation,
    start_stream,
    whole,
)
from gateway.http_api.errors import anthropic_error_body, api_error
from gateway.http_api.models import served_model
from gateway.http_api.openai_completions import ignored_fields_header
from gateway.http_api.openai_translate import model_defaults
from gateway.http_api.threads import HttpCall
from gateway.request_path import add_message
from gateway.tenants import SCOPE_GENERATE
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

router = APIRouter()

#: Whole replies: breakpoints the tenant's quota or the daemon's cap left unpinned.
UNPINNED_HEADER = "x-kvd-cache-unpinned-breakpoints"
#: Anthropic's default temperature, for a model that sets none.
ANTHROPIC_TEMPERATURE = 1.0

_STOP_REASON = {
    epb.FINISH_REASON_EOS: "end_turn",
    epb.FINISH_REASON_LENGTH: "max_tokens",
    epb.FINISH_REASON_STOP: "stop_sequence",
    epb.FINISH_REASON_CANCELLED: "end_turn",
}


def anthropic_key(request: Request) -> str | None:
    """The caller's key: Anthropic's ``x-api-key``, else ``authorization: Bearer``."""
    return request.headers.get("x-api-key") or caller_key(request)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = api_state(request)
    requests, key = state.requests, anthropic_key(request)
    headers = ignored_fields_header(body)
    call = HttpCall()
    open_generation(state.open_calls, call)
    reply = Reply(body.model, body.stop_sequences or ())

    def replies() -> Iterator[pb.GenerateResponse]:
        _, info = served_model(state, key, body.model)
        tenant = requests.authorize(key, SCOPE_GENERATE).tenant
        gateway_request = generate_request(body, info.default_sampling)
        if body.diagnostics is not None:
            reply.diagnose(state.message_records, PromptRecord(tenant, body.model, gateway_request.chat),
                           body.diagnostics.previous_message_id, requests.tokenize_chat)  # fmt: skip
        yield from requests.generate(tenant, gateway_request, call)

    if not body.stream:

        def whole_body() -> dict:
            merged = pb.GenerateResponse()
            for message in replies():
                add_message(merged, message)
            return reply.whole(merged)

        out = await whole(request, call, whole_body)
        unpinned = out["usage"]["kvd"]["unpinned_breakpoints"]
        return JSONResponse(out, headers={**headers, **({UNPINNED_HEADER: str(unpinned)} if unpinned else {})})

    started = await start_stream(request, call, replies)
    return EventSourceResponse(_events(reply, started), ping=0, sep="\n", send_timeout=30, headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    state = api_state(request)
    requests, key = state.requests, anthropic_key(request)

    def count() -> dict:
        served_model(state, key, body.model)
        requests.authorize(key, SCOPE_GENERATE)
        counted = generate_request(body)
        check_breakpoints(counted)  # refused as /v1/messages would refuse them
        return {"input_tokens": len(requests.tokenize_chat(counted.chat))}

    return JSONResponse(await on_thread(request, count), headers=ignored_fields_header(body))


# ------------------------------------------------------------ translation


def generate_request(body: MessagesRequest, defaults: epb.SamplingParams | None = None) -> pb.GenerateRequest:
    """The gateway's request for a Messages body (its breakpoints placed on its messages)."""
    out = pb.GenerateRequest(diagnose_cache=body.diagnostics is not None)
    chat = out.chat
    if (system := body.system_text()) is not None:
        chat.messages.add(role="system", content=system)
        if isinstance(body.system, list):
            _mark_blocks(out, 0, body.system)
    for message in body.messages:
        chat.messages.add(role=message.role, content=message.text())
        if isinstance(message.content, list):
            _mark_blocks(out, len(chat.messages) - 1, message.content)
    if body.cache_control is not None:  # automatic: through the last message
        out.cache_breakpoints.add(message=len(chat.messages) - 1, ttl=body.cache_control.proto_ttl())
    if body.messages[-1].role == "assistant":  # a prefill: the reply continues it
        chat.continue_final_message = True
        chat.add_generation_prompt = False
    _sampling(out.sampling, body, defaults)
    return out


def _mark_blocks(out: pb.GenerateRequest, message: int, blocks: list[TextBlock]) -> None:
    ttls = [None if b.cache_control is None else b.cache_control.proto_ttl() for b in blocks]
    mark_parts(out, message, ttls, [len(b.text) for b in blocks], BLOCK_JOINER)


def _sampling(sampling: epb.SamplingParams, body: MessagesRequest, defaults: epb.SamplingParams | None) -> None:
    sampling.max_new_tokens = body.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(body, name)) is not None:
            setattr(sampling, name, value)
    model_defaults(sampling, defaults, ANTHROPIC_TEMPERATURE)
    if body.stop_sequences:
        sampling.stop.extend(body.stop_sequences)
        # Kept in the text so the reply can say which one ended it (``StopSequences`` takes it out).
        sampling.include_stop_str_in_output = True


class StopSequences:
    """Takes the stop sequence that ended the output out of its text, and names it.

    The engine keeps the matched sequence in the text (so it can be named);
    a stream holds back the text that could still be the start of one.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = sorted(stops, key=len, reverse=True)
        self._held = ""

    def text(self, delta: str) -> str:
        """The part of ``delta`` that can be sent now."""
        text = self._held + delta
        keep = max((self._held_back(text, stop) for stop in self.stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    @staticmethod
    def _held_back(text: str, stop: str) -> int:
        """The longest end of ``text`` that ``stop`` begins with (it may go on to match)."""
        for n in range(min(len(stop), len(text)), 0, -1):
            if stop.startswith(text[len(text) - n :]):
                return n
        return 0

    def end(self, finish: epb.FinishReason.ValueType) -> tuple[str, str | None]:
        """The text still held and the stop sequence that ended the output (None: none did)."""
        text, self._held = self._held, ""
        if finish == epb.FINISH_REASON_STOP:
            for stop in self.stops:
                if text.endswith(stop):
                    return text[: -len(stop)], stop
        return text, None


class Reply:
    """The Messages API's replies for one request: whole, or as events."""

    def __init__(self, model: str, stops: tuple[str, ...] | list[str]) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.stops = stops
        self.diagnostics: dict | None = None  # asked for: Anthropic's, then kvd's beside it at the end

    def diagnose(self, records: MessageRecords, record: PromptRecord, previous_id: str | None, token_ids) -> None:
        """Works out why this request missed ``previous_id``'s prefix (none: there is nothing to compare),
        and remembers this one for the next."""
        previous = records.get(previous_id) if previous_id else None
        reason = miss_reason(previous, record, token_ids) if previous_id else None
        self.diagnostics = {"cache_miss_reason": reason}
        records.add(self.id, record)

    def whole(self, merged: pb.GenerateResponse) -> dict:
        stops = StopSequences(self.stops)
        text = stops.text(merged.text)
        tail, stop = stops.end(merged.finish_reason)
        out = {
            **self._head(),
            "content": [{"type": "text", "text": text + tail}],
            "stop_reason": _STOP_REASON.get(merged.finish_reason, "end_turn"),
            "stop_sequence": stop,
            "usage": usage(merged.usage),
        }
        if self.diagnostics is not None:
            out["diagnostics"] = {**self.diagnostics, "kvd_cache_diagnosis": as_json(merged.cache_diagnosis)}
        return out

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def start_events(self) -> list[ServerSentEvent]:
        started = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None}
        if self.diagnostics is not None:  # known before the first token (kvd's comes with message_delta)
            started["diagnostics"] = self.diagnostics
        started["usage"] = usage(pb.Usage())  # known at the end only: message_delta has it
        return [
            _event("message_start", {"type": "message_start", "message": started}),
            _event("content_block_start",
                   {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ]  # fmt: skip

    def events(self, message: pb.GenerateResponse, stops: StopSequences) -> list[ServerSentEvent]:
        out = []
        if text := stops.text(message.text):
            out.append(_delta(text))
        if message.HasField("usage"):  # the last message
            tail, stop = stops.end(message.finish_reason)
            if tail:
                out.append(_delta(tail))
            delta = {"stop_reason": _STOP_REASON.get(message.finish_reason, "end_turn"), "stop_sequence": stop}
            end = {"type": "message_delta", "delta": delta, "usage": usage(message.usage)}
            if self.diagnostics is not None:
                end["kvd_cache_diagnosis"] = as_json(message.cache_diagnosis)
            out += [
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event("message_delta", end),
                _event("message_stop", {"type": "message_stop"}),
            ]
        return out


async def _events(reply: Reply, started: StartedStream[pb.GenerateResponse]) -> AsyncIterator[ServerSentEvent]:
    stops = StopSequences(reply.stops)
    try:
        for event in reply.start_events():
            yield event
        if started.first is not None:
            for event in reply.events(started.first, stops):
                yield event
            async for message in started.rest:
                for event in reply.events(message, stops):
                    yield event
    except Exception as exc:  # after the first event: the status is sent; the error goes in the stream
        error = api_error(exc)
        yield _event("error", anthropic_error_body(error.status, error.message))
    finally:
        await started.rest.aclose()  # the client left (or the stream ended): the call ends, the engine stops


def _delta(text: str) -> ServerSentEvent:
    delta = {"type": "text_delta", "text": text}
    return _event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})


def _event(name: str, data: dict) -> ServerSentEvent:
    return ServerSentEvent(event=name, data=json.dumps(data, separators=(",", ":"), ensure_ascii=False), sep="\n")


def usage(u: pb.Usage) -> dict:
    """Anthropic's usage from the daemon's counts (and kvd's own beside them)."""
    read, created = u.cached_prompt_tokens, u.cache_creation_tokens
    return {
        "input_tokens": max(u.prompt_tokens - read - created, 0),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": u.cache_creation_5m_tokens,
            "ephemeral_1h_input_tokens": u.cache_creation_1h_tokens,
        },
        "kvd": {
            "unpinned_breakpoints": u.unpinned_breakpoints,
            "host_cached_tokens": u.host_cached_prompt_tokens,
            "disk_cached_tokens": u.disk_cached_prompt_tokens,
            "time_to_first_token_s": u.time_to_first_token_s,
        },
    }
