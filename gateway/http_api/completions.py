"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each runs the gateway's own ``Complete`` (whole) or ``Generate`` (streamed)
in-process. A stream's reply starts only once its first message is there, so
a request refused before any token (a bad key, an unknown template, a limit)
still gets its error status; an error after that ends the stream with an
``error`` event. The stream ends with ``data: [DONE]``. A client that leaves
before its reply (streamed or whole) ends the call, which cancels the
engine's request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, JSONServerSentEvent, ServerSentEvent

from gateway.http_api.calls import ApiError, LocalCall, api_error
from gateway.http_api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.http_api.translate import Chunks, completion_body, generate_request
from gateway.tenants import SCOPE_GENERATE
from kvd.common.grpc_server import OpenCalls

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _complete(request, body, chat=True, want_logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _complete(request, body, chat=False, want_logprobs=body.logprobs is not None)


async def _complete(request: Request, body, chat: bool, want_logprobs: bool):
    state = request.app.state
    service, relay = state.service, state.relay
    call = LocalCall(request.headers.get("authorization"))
    _open(state.open_calls, call)
    token_text = service.tokenizer.token_text
    if not body.stream:

        def whole():
            model = _served_model(service, call, body.model)
            return model, service.Complete(generate_request(body), call)

        watch = asyncio.ensure_future(_end_on_disconnect(request, call))
        try:
            model, reply = await relay.call(call, whole)
        except Exception as exc:
            raise api_error(exc) from exc
        finally:
            watch.cancel()
        return JSONResponse(completion_body(reply, chat, model, want_logprobs, token_text))

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = Chunks(chat, body.model, want_logprobs, include_usage, token_text)

    def messages():
        chunks.model = _served_model(service, call, body.model)
        yield from service.Generate(generate_request(body), call)

    stream = relay.stream(call, messages)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except Exception as exc:
        raise api_error(exc) from exc
    return EventSourceResponse(_events(chunks, first, stream), ping=15, send_timeout=30)


def _open(open_calls: OpenCalls, call: LocalCall) -> None:
    """Counts the call among the gateway's open generations (gRPC's too) until
    it ends; past the limit, 429 at once."""
    if not open_calls.try_open():
        raise ApiError(429, open_calls.refusal(), code="resource_exhausted")
    call.add_callback(open_calls.close)


async def _end_on_disconnect(request: Request, call: LocalCall) -> None:
    """Ends the call when its client leaves before the whole reply (its body was read: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    call.end()


async def _events(chunks: Chunks, first, stream: AsyncIterator) -> AsyncIterator[ServerSentEvent]:
    try:
        for chunk in chunks.first():
            yield JSONServerSentEvent(data=chunk)
        if first is not None:
            for chunk in chunks.of(first):
                yield JSONServerSentEvent(data=chunk)
            async for message in stream:
                for chunk in chunks.of(message):
                    yield JSONServerSentEvent(data=chunk)
    except Exception as exc:  # after the first token: the status is sent; the error goes in the stream
        error = api_error(exc)
        yield JSONServerSentEvent(data=error.body())
    finally:
        await stream.aclose()  # the client left (or the stream ended): the call ends, the engine stops
    yield ServerSentEvent(data="[DONE]")


def _served_model(service, call: LocalCall, asked: str) -> str:
    """The served model's name; a request naming another is NOT_FOUND (once its key is known good)."""
    served = service.pool.any_serving().model_info().model
    if asked != served:
        service.auth.authorize(call, SCOPE_GENERATE)
        raise ApiError(404, f"the model {asked!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")  # fmt: skip
    return served
