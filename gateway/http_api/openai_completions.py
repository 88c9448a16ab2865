"""OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each runs the request path's ``complete`` (whole) or ``generate`` (streamed)
on a worker thread. A stream's reply starts only once its first message is
there, so a request refused before any token (a bad key, an unknown
template, a limit) still gets its error status; an error after that ends the
stream with an ``error`` event. The stream ends with ``data: [DONE]``. A
client that leaves before its reply (streamed or whole) ends the call, which
cancels the engine's request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, JSONServerSentEvent, ServerSentEvent

from gateway.http_api.common import StartedStream, api_state, caller_key, open_generation, start_stream, whole
from gateway.http_api.errors import ApiError, api_error
from gateway.http_api.openai_schemas import ChatCompletionRequest, CompletionRequest
from gateway.http_api.openai_translate import Chunks, completion_body, generate_request
from gateway.http_api.threads import HttpCall
from gateway.request_path import RequestPath
from gateway.tenants import SCOPE_GENERATE

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _complete(request, body, chat=True, want_logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _complete(request, body, chat=False, want_logprobs=body.logprobs is not None)


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool, want_logprobs: bool):
    state = api_state(request)
    requests, key = state.requests, caller_key(request)
    call = HttpCall()
    open_generation(state.open_calls, call)
    if not body.stream:

        def whole_body() -> dict:
            model = _served_model(requests, key, body.model)
            gateway_request = generate_request(body)
            tenant = requests.authorize(key, SCOPE_GENERATE).tenant
            reply = requests.complete(tenant, gateway_request, call)
            return completion_body(reply, chat, model, want_logprobs, requests.token_text)

        return JSONResponse(await whole(request, call, whole_body))

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = Chunks(chat, body.model, want_logprobs, include_usage, requests.token_text)

    def messages():
        chunks.model = _served_model(requests, key, body.model)
        gateway_request = generate_request(body)
        tenant = requests.authorize(key, SCOPE_GENERATE).tenant
        yield from requests.generate(tenant, gateway_request, call)

    started = await start_stream(request, call, messages)
    return EventSourceResponse(_events(chunks, started), ping=15, send_timeout=30)


async def _events(chunks: Chunks, started: StartedStream) -> AsyncIterator[ServerSentEvent]:
    try:
        for chunk in chunks.first():
            yield JSONServerSentEvent(data=chunk)
        if started.first is not None:
            for chunk in chunks.of(started.first):
                yield JSONServerSentEvent(data=chunk)
            async for message in started.rest:
                for chunk in chunks.of(message):
                    yield JSONServerSentEvent(data=chunk)
    except Exception as exc:  # after the first token: the status is sent; the error goes in the stream
        error = api_error(exc)
        yield JSONServerSentEvent(data=error.body())
    finally:
        await started.rest.aclose()  # the client left (or the stream ended): the call ends, the engine stops
    yield ServerSentEvent(data="[DONE]")


def _served_model(requests: RequestPath, key: str | None, asked: str) -> str:
    """The served model's name; a request naming another is NOT_FOUND (once its key is known good)."""
    served = requests.model_info().model
    if asked != served:
        requests.authorize(key, SCOPE_GENERATE)
        raise ApiError(404, f"the model {asked!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")  # fmt: skip
    return served
