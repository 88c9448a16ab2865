"""What every surface's routes share: the app's state, the caller's key, a
call on a worker thread, the count of open generations, and a stream whose
status waits for its first message.

A surface (``openai_completions``, ``models``, ``templates_routes``, ...) is
one module of routes that turns its API's bodies into the request path's
arguments (``gateway.request_path``) and its results into its API's replies;
errors reach the client in OpenAI's shape (``errors``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Generic, NamedTuple, TypeVar

from fastapi import Request
from pydantic import Field

from gateway.http_api.anthropic_diagnostics import MessageRecords
from gateway.http_api.errors import ApiError, api_error
from gateway.http_api.metrics import HttpMetrics
from gateway.http_api.threads import HttpCall, WorkerThreads
from gateway.request_path import RequestPath
from gateway.tenants import bearer_key
from kvd.common.grpc_server import OpenCalls

T = TypeVar("T")

# The integers the protos carry.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]
Int32 = Annotated[int, Field(ge=-(2**31), lt=2**31)]


@dataclass(frozen=True)
class ApiState:
    """What the routes reach through ``request.app.state.api``.

    Attributes:
        requests: the gateway's request path.
        threads: where its blocking calls run.
        open_calls: the generations open in this process (the gRPC API's too).
        started: when the app was made (seconds since the epoch), the model's ``created``.
        served_model_names: the model's names (``--served-model-name``); empty: its own (``models``).
        metrics: the HTTP API's Prometheus registry and counters.
        message_records: the Messages API's requests that later ones may ask diagnostics against.
    """

    requests: RequestPath
    threads: WorkerThreads
    open_calls: OpenCalls
    started: int
    served_model_names: tuple[str, ...]
    metrics: HttpMetrics
    message_records: MessageRecords


def api_state(request: Request) -> ApiState:
    return request.app.state.api


def caller_key(request: Request) -> str | None:
    """The caller's API key, from ``authorization: Bearer <key>``."""
    header = request.headers.get("authorization")
    return bearer_key([header] if header else [])


async def on_thread(request: Request, fn: Callable[[], T]) -> T:
    """``fn()`` on a worker thread, as one call; what it raises as an error reply."""
    state = api_state(request)
    try:
        return await state.threads.call(HttpCall(), fn)
    except Exception as exc:
        raise api_error(exc) from exc


def open_generation(open_calls: OpenCalls, call: HttpCall) -> None:
    """Counts the call among the gateway's open generations (gRPC's too) until
    it ends; past the limit, 429 at once."""
    if not open_calls.try_open():
        raise ApiError(429, open_calls.refusal(), code="resource_exhausted")
    call.add_callback(open_calls.close)


async def end_on_disconnect(request: Request, call: HttpCall) -> None:
    """Ends the call when its client leaves before the whole reply (its body was read: what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    call.end()


async def whole(request: Request, call: HttpCall, fn: Callable[[], T]) -> T:
    """``fn()`` on a worker thread as ``call``, ended early when the client leaves; errors as replies."""
    watch = asyncio.ensure_future(end_on_disconnect(request, call))
    try:
        return await api_state(request).threads.call(call, fn)
    except Exception as exc:
        raise api_error(exc) from exc
    finally:
        watch.cancel()


class StartedStream(NamedTuple, Generic[T]):
    """A stream whose first item came (None: it ended without one), and the rest of it."""

    first: T | None
    rest: AsyncIterator[T]


async def start_stream(request: Request, call: HttpCall, open_stream: Callable[[], Iterator[T]]) -> StartedStream[T]:
    """The items of ``open_stream()`` on a worker thread, as ``call``, once
    the first came: a request refused before any (a bad key, an unknown
    template, a limit) still gets its error status."""
    stream = api_state(request).threads.stream(call, open_stream)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    except Exception as exc:
        raise api_error(exc) from exc
    return StartedStream(first, stream)
