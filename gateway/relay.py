"""Relays a generation from the replica the router picks to its caller.

A replica that refuses the request before its first token (UNAVAILABLE:
draining, stopping, gone; RESOURCE_EXHAUSTED: full) hands it to the next one the
router picks, until none is left; during a drain or a restart the request
waits for a replica to come back (``ReplicaPool.await_serving``). Once a
message reached the caller the request is never tried elsewhere.

The call is the caller's, whichever API it came by (``CallLifetime``): its
deadline bounds the engine's call and the waits, and when it ends early (the
client left, its deadline passed) the engine's request is cancelled, which
frees its blocks at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.cache_marks import NO_MARKS, PlacedMarks, creation_usage
from gateway.error_statuses import from_engine
from gateway.replicas import ReplicaPool, remaining_s
from gateway.request_errors import RequestError
from gateway.router import NoReplica, Route, RouteKey
from gateway.tenants import RequestSlots
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger("gateway.relay")

#: An engine's refusals before a request's first token that another replica may answer.
_HANDED_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class CallLifetime(Protocol):
    """What the relay needs of the call it serves: its deadline, whether it
    still runs, and to be told when it ends. A ``grpc.ServicerContext`` is
    one; the HTTP API's ``HttpCall`` is another."""

    def time_remaining(self) -> float | None: ...

    def is_active(self) -> bool: ...

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs ``callback`` when the call ends; False (and never runs it) when it already has."""
        ...


@dataclass(frozen=True)
class EngineRequest:
    """A request as an engine takes it, and what the relay needs beside it.

    Attributes:
        message: the engine's request (a template's tokens first).
        template_tokens: how many of its prompt's tokens are its template's
            (reported in its usage).
        route_key: what the router picks its replica by.
        marks: its cache breakpoints as the engine's cache marks (their
            usage is counted from what the daemon did with them).
    """

    message: epb.GenerateRequest
    template_tokens: int
    route_key: RouteKey
    marks: PlacedMarks = NO_MARKS


class Relay:
    """Args:
    pool: the replicas (the router is ``pool.router``).
    slots: each tenant's requests running here, taken for a request's length.
    """

    def __init__(self, pool: ReplicaPool, slots: RequestSlots) -> None:
        self.pool = pool
        self.router = pool.router
        self.slots = slots

    def stream(self, tenant: str, request: EngineRequest, call: CallLifetime) -> Iterator[pb.GenerateResponse]:
        """The request's replies, from the replica the router picks (see the module's docstring).

        Raises:
            NoReplica: none serves (or came back in time).
            LimitExceeded: the tenant runs its limit of requests already.
            RequestError: every replica refused it, or the one streaming it failed.
        """
        tried: dict[str, int] = {}  # replicas that refused it -> their comebacks then
        route = self._next_route(request.route_key, tried, call)
        self.slots.take(tenant)
        released = _Once(lambda: self.slots.give_back(tenant))
        call.add_callback(released)  # a cancelled stream may never resume this generator
        try:
            while True:
                comebacks = self.router.comebacks(route.address)
                refused = yield from self._try_replica(route, request, call)
                if refused is None:
                    return
                tried[route.address] = comebacks
                try:
                    # A full replica (RESOURCE_EXHAUSTED) is no reason to wait: the client backs off.
                    wait = refused.code == grpc.StatusCode.UNAVAILABLE
                    route = self._next_route(request.route_key, tried, call, wait=wait)
                except NoReplica:
                    raise refused from None
                log.info("request handed to another replica",
                         extra={"refused_by": sorted(tried), "refusal": refused.message})  # fmt: skip
        finally:
            released()

    def _next_route(self, key: RouteKey, tried: dict[str, int], call: CallLifetime, wait: bool = True) -> Route:
        """The replica for the request's next try: a serving one that has not
        refused it. When there is none but one served lately (a drain or a
        restart under way), waits for one, within ``--replica-wait-s`` and the
        caller's deadline (``ReplicaPool.await_serving``).

        Raises:
            NoReplica: none came.
        """
        left = remaining_s(call)
        give_up_at = time.monotonic() + (self.pool.replica_wait_s if left is None else left)
        while True:
            try:
                return self.router.route(key, exclude=self.router.refusers(tried))
            except NoReplica:
                if not wait or not self.pool.await_serving(tried, give_up_at - time.monotonic()):
                    raise

    def _try_replica(
        self, route: Route, request: EngineRequest, call: CallLifetime
    ) -> Generator[pb.GenerateResponse, None, RequestError | None]:
        """One replica's try (a generator). Returns None when the call is over,
        or the error a client would get when the replica refused the request
        before anything reached the client (another replica may take it)."""
        address = route.address
        link = self.pool.link(address)
        ticket = self.router.started(address, route.uncached_tokens, route.new_keys)
        finished = _Once(lambda: self.router.finished(address, ticket))
        call.add_callback(finished)
        engine_call = link.stub.Generate(request.message, timeout=remaining_s(call))
        # A client that cancels (or whose deadline passes) cancels the engine's
        # request, which frees its blocks. NOTE: a call the client abandoned
        # before a worker thread took it up is already over: add_callback
        # refuses the callback then, and the engine's request is cancelled here.
        if not call.add_callback(engine_call.cancel):
            engine_call.cancel()
        streamed = False
        try:
            for message in engine_call:
                if not streamed:  # its prefill is done: no longer queued work there
                    self.router.prefilled(address, ticket)
                    streamed = True
                yield gateway_response(message, request)
        except grpc.RpcError as err:
            if not call.is_active():
                return None  # its caller left (which cancelled the engine's call): no one to answer
            # NOTE: once a message reached the client, never retried elsewhere.
            # New requests route around the replica until its health check
            # says it serves again.
            error = from_engine(err, f"the engine at {address}")
            if error.code == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(address)
            if error.code in _HANDED_OVER and not streamed:
                return error
            raise error from None
        finally:
            engine_call.cancel()  # the stream was closed early (its client left): stop the engine's request
            finished()
        return None


class _Once:
    """Calls ``fn`` the first time it is called, from whichever thread."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def gateway_response(message: epb.GenerateResponse, request: EngineRequest) -> pb.GenerateResponse:
    """An engine's reply as the gateway's (its usage with the template's share and the cache marks' creation)."""
    out = pb.GenerateResponse(
        token_ids=message.token_ids,
        text=message.text,
        logprobs=message.logprobs,
        finish_reason=message.finish_reason,
        top_logprobs=message.top_logprobs,
    )
    if message.HasField("prompt_logprobs"):
        out.prompt_logprobs.CopyFrom(message.prompt_logprobs)
    if message.HasField("usage"):
        u = message.usage
        out.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                template_tokens=request.template_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                completion_tokens=u.completion_tokens,
                time_to_first_token_s=u.time_to_first_token_s,
                host_cached_prompt_tokens=u.host_cached_prompt_tokens,
                disk_cached_prompt_tokens=u.disk_cached_prompt_tokens,
            )
        )
        if not request.marks.empty:
            creation_usage(out.usage, u.marks, request.marks)
    return out
