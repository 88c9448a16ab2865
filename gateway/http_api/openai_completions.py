"""OpenAI's ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each runs the request path's ``generate`` on a worker thread, once per
prompt (a completions request may hold several: ``prompt_batch``), and
replies whole or streamed. A stream's reply starts only once its first
message is there, so a request refused before any token (a bad key, an
unknown template, a limit) still gets its error status; an error after that
ends the stream with an ``error`` event. Events are ``data: <json>\n\n``,
the last ``data: [DONE]``. A client that leaves before its reply (streamed
or whole) ends the call, which cancels the engine's requests. Fields the
body does not know are ignored, logged once per name, and named in the
reply's ``x-kvd-ignored-fields`` header.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway.http_api.common import StartedStream, api_state, caller_key, open_generation, start_stream, whole
from gateway.http_api.errors import api_error
from gateway.http_api.models import served_model
from gateway.http_api.openai_schemas import Body, ChatCompletionRequest, CompletionRequest
from gateway.http_api.openai_translate import Chunks, completion_body, completion_requests, generate_request
from gateway.http_api.prompt_batch import MAX_WIDTH, Indexed, batch_messages, forked
from gateway.http_api.prompt_scores import PromptScores, forks_share_scores, share_prefixes
from gateway.http_api.threads import HttpCall
from gateway.request_path import RequestPath, add_message
from gateway.tenants import SCOPE_GENERATE
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger("gateway.http")

router = APIRouter()

#: The response header that lists the request's fields kvd ignored (unknown to it).
IGNORED_HEADER = "x-kvd-ignored-fields"

#: Ignored names logged at most (a client inventing names must not grow the set forever).
_MAX_LOGGED = 1000
#: The header's length at most.
_MAX_HEADER = 1000

_logged_fields: set[str] = set()
_logged_lock = threading.Lock()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await _complete(request, body, chat=True, want_logprobs=bool(body.logprobs))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _complete(request, body, chat=False, want_logprobs=body.logprobs is not None)


async def _complete(request: Request, body: ChatCompletionRequest | CompletionRequest, chat: bool, want_logprobs: bool):
    state = api_state(request)
    requests, key = state.requests, caller_key(request)
    headers = ignored_fields_header(body)
    call = HttpCall()
    open_generation(state.open_calls, call)
    forks = body.forks()
    choices = (1 if chat else len(body.prompts())) * forks
    chunks = Chunks(chat, body.model or "", want_logprobs, body.include_usage(), requests.token_text, choices, forks)

    def messages() -> Iterator[Indexed]:
        model, info = served_model(state, key, body.model)
        chunks.model = model
        tenant = requests.authorize(key, SCOPE_GENERATE).tenant
        gateway_requests, leaders = forked(_gateway_requests(requests, body, info.default_sampling), forks)
        if isinstance(body, CompletionRequest):
            chunks.echoes = _echoes(requests, body)
            if body.scores_prompt and forks == 1:  # a shared context is scored once
                leaders = share_prefixes(gateway_requests, info.block_size)
            elif body.scores_prompt:  # and a prompt once for all its forks
                forks_share_scores(gateway_requests, leaders)
        scores = PromptScores(leaders)
        width = requests.free_slots(tenant) or MAX_WIDTH
        run = lambda r: requests.generate(tenant, r, call)  # noqa: E731
        for index, message in batch_messages(run, gateway_requests, width, call, leaders):
            yield Indexed(index, scores.complete(index, message))

    if not body.stream:

        def whole_body() -> dict:
            replies = _merged(messages(), choices)
            return completion_body(
                replies, chat, chunks.model, want_logprobs, requests.token_text, forks, chunks.echoes
            )

        return JSONResponse(await whole(request, call, whole_body), headers=headers)

    started = await start_stream(request, call, messages)
    # NOTE: "data: ...\n\n" only, no ping comments: clients (vLLM's benchmark
    # among them) split events on a blank line of "\n\n".
    return EventSourceResponse(_events(chunks, started), ping=0, sep="\n", send_timeout=30, headers=headers)


def _gateway_requests(
    requests: RequestPath, body: ChatCompletionRequest | CompletionRequest, defaults: epb.SamplingParams
) -> list[pb.GenerateRequest]:
    if isinstance(body, ChatCompletionRequest):
        return [generate_request(body, defaults)]
    out = completion_requests(body, defaults)
    # Tokenized here, sent as token ids: without a BOS; or scored, to find the prompts' shared prefixes.
    if (body.add_special_tokens is False or body.scores_prompt) and not body.template:
        bos = body.add_special_tokens is not False
        for one in out:
            if one.WhichOneof("prompt") == "text":
                one.token_ids.ids.extend(requests.tokenize_text(one.text, add_special_tokens=bos))
    return out


def _echoes(requests: RequestPath, body: CompletionRequest) -> list[str] | None:
    """Each prompt's text for ``echo`` (a token-id prompt's decoded), or None without it."""
    if not body.echo:
        return None
    return [prompt if isinstance(prompt, str) else requests.detokenize(prompt) for prompt in body.prompts()]


def _merged(messages: Iterator[Indexed], choices: int) -> list[pb.GenerateResponse]:
    """Each prompt's messages as one reply, in the prompts' order."""
    replies = [pb.GenerateResponse() for _ in range(choices)]
    for index, message in messages:
        add_message(replies[index], message)
    return replies


async def _events(chunks: Chunks, started: StartedStream[Indexed]) -> AsyncIterator[ServerSentEvent]:
    try:
        for chunk in chunks.first():
            yield _event(chunk)
        if started.first is not None:
            for chunk in chunks.of(started.first.message, started.first.index):
                yield _event(chunk)
            async for index, message in started.rest:
                for chunk in chunks.of(message, index):
                    yield _event(chunk)
    except Exception as exc:  # after the first token: the status is sent; the error goes in the stream
        error = api_error(exc)
        yield _event(error.body())
    finally:
        await started.rest.aclose()  # the client left (or the stream ended): the call ends, the engine stops
    yield ServerSentEvent(data="[DONE]", sep="\n")


def _event(data: dict) -> ServerSentEvent:
    """One ``data: <json>\n\n`` event (compact JSON: one line)."""
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":"), ensure_ascii=False), sep="\n")


def ignored_fields_header(body: Body) -> dict[str, str]:
    """The header naming the body's fields kvd ignored (none: no header); each name logged once."""
    names = [_printable(n) for n in body.ignored_fields()]
    if not names:
        return {}
    with _logged_lock:
        new = [n for n in names if n not in _logged_fields]
        if len(_logged_fields) < _MAX_LOGGED:
            _logged_fields.update(new)
    if new:
        log.warning("request fields ignored (unknown to kvd)", extra={"fields": new})
    return {IGNORED_HEADER: ", ".join(names)[:_MAX_HEADER]}


def _printable(name: str) -> str:
    """A field's name as a header can carry it (printable ASCII; anything else, a line break above all, as '?')."""
    return "".join(c if " " <= c <= "~" and c != "," else "?" for c in name)
