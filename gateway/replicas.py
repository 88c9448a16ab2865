"""The engine replicas behind a gateway: their links, health, block events and load.

Each replica is an ``EngineLink`` (its channel, stub and model info); engine
errors reach clients through ``engine_error`` (``gateway.error_statuses``).

A monitor thread, every ``health_interval_s``: resolves the endpoints again
(every ``resolve_interval_s``; ``dns:`` names follow their pods), checks each
replica's gRPC health, and tells the router. While a request waits for a
replica (``await_serving``: none serves during a drain or a restart) it checks
every ``HURRIED_INTERVAL_S``, so the request goes on as soon as one is back.
Two watcher threads per replica:

- one follows its ``BlockEvents`` stream into the router: a snapshot of what
  its daemon caches, then the live batches; a batch out of sequence, or of
  another incarnation (a new cache), means events were missed, and the stream
  is opened again for a fresh snapshot. When the stream breaks (the engine or
  its daemon went away) what the replica was known to hold is forgotten, and
  the stream is opened again. So a gateway that (re)starts sees what the
  daemons hold, as every other gateway does;
- one follows its ``Load`` stream (the engine reports on every change).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.endpoints import expand
from gateway.router import Cleared, Event, Load, NoReplica, Removed, Router, Stored
from kvd_api.daemon.v1 import daemon_pb2 as dpb
from kvd_api.engine.v1 import engine_pb2 as epb
from kvd_api.engine.v1 import engine_pb2_grpc as epb_grpc

log = logging.getLogger("gateway.replicas")

# Engine statuses a client can act on as they are; any other engine failure
# means the engine could not serve the call.
_PASSED_ON = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


# NOTE: gRPC's default reconnect backoff grows to two minutes: an engine that
# restarted would stay unreachable through this channel long after it serves.
# grpc.min_reconnect_backoff_ms is left alone: despite its name it is the least
# time a connection attempt is given (gRPC's MIN_CONNECT_TIMEOUT, 20 s). At
# 200 ms, an engine whose handshake took a second on a loaded machine was never
# reached again after a restart (every attempt cut short, tried again, cut short).
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A tokenizer's files (TokenizerFiles) can pass the default 4 MiB limit.
_MAX_RECEIVE = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


class EngineLink:
    """One engine: its stub, and its model info once it answered.

    Args:
        address: ``HOST:PORT`` of the engine's gRPC server.
        rpc_timeout_s: the limit on unary calls (TokenizerFiles, Info, Unpin);
            Warm and Generate get the caller's deadline.
    """

    def __init__(self, address: str, rpc_timeout_s: float = 10.0) -> None:
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.channel = grpc.insecure_channel(address, options=_RECONNECT + _MAX_RECEIVE)
        self.stub = epb_grpc.EngineStub(self.channel)
        self._info: epb.InfoResponse | None = None
        self._lock = threading.Lock()

    def info(self, timeout_s: float | None = None) -> epb.InfoResponse:
        """Asks the engine (raises grpc.RpcError) and remembers the answer."""
        info = self.stub.Info(epb.InfoRequest(), timeout=timeout_s or self.rpc_timeout_s)
        with self._lock:
            self._info = info
        return info

    def model_info(self) -> epb.InfoResponse:
        """The last answer, or a fresh one when there is none yet."""
        with self._lock:
            known = self._info
        return known if known is not None and known.block_size else self.info()

    def tokenizer_files(self) -> dict[str, bytes]:
        return dict(self.stub.TokenizerFiles(epb.TokenizerFilesRequest(), timeout=self.rpc_timeout_s).files)

    def close(self) -> None:
        self.channel.close()


# gRPC reports a call without a deadline as ~2**63 ns remaining; passed on as
# a timeout that overflows into an immediate DEADLINE_EXCEEDED. Anything past a
# year is taken for "no deadline".
_NO_DEADLINE_S = 365 * 24 * 3600.0


def remaining_s(context: grpc.ServicerContext, default_s: float | None = None) -> float | None:
    """The timeout of an engine call made for ``context``'s caller: what is left
    of its deadline, or ``default_s`` when the caller set none (most clients'
    default, grpcurl's included)."""
    left = context.time_remaining()
    if left is None or left > _NO_DEADLINE_S:
        return default_s
    return left


def engine_status(err: grpc.RpcError) -> grpc.StatusCode:
    """An engine call's status as the gateway reads it: CANCELLED is UNAVAILABLE.

    NOTE: a gRPC server that stops cancels the calls it had received but not
    yet taken up (grpc/grpc#41785): the engine went away before the request
    started, as when it refuses a connection. The gateway cancels an engine's
    call only when its own caller has left, and then answers no one.
    """
    code = err.code()
    return grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.CANCELLED else code


def engine_error(err: grpc.RpcError, who: str = "an engine replica") -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for an engine's error."""
    code = err.code()
    if code == grpc.StatusCode.CANCELLED:  # see engine_status
        return grpc.StatusCode.UNAVAILABLE, f"{who} is unavailable: its server cancelled the call as it stopped"
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"{who} is unavailable: {err.details()}"
    if code in _PASSED_ON:
        return code, err.details() or code.name
    return grpc.StatusCode.UNAVAILABLE, f"{who} failed: {code.name}: {err.details()}"


_SERVING = health_pb2.HealthCheckResponse.SERVING
#: The health rounds' interval while a request waits for a replica.
HURRIED_INTERVAL_S = 0.1


class ReplicaPool:
    """Args:
    endpoints: ``HOST:PORT`` and ``dns:NAME:PORT`` entries.
    router: told of replicas, health and events.
    health_interval_s: how often each replica's health is checked.
    resolve_interval_s: how often ``dns:`` names are resolved again.
    replica_wait_s: how long a request may wait for a replica (``await_serving``).
    on_health: told, each round, whether any replica serves.
    resolve: the endpoint expansion (tests give their own resolver).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        router: Router,
        health_interval_s: float = 0.5,
        resolve_interval_s: float = 5.0,
        replica_wait_s: float = 30.0,
        on_health: Callable[[bool], None] = lambda up: None,
        resolve: Callable[[Sequence[str]], list[str]] = expand,
    ) -> None:
        self.endpoints = list(endpoints)
        self.router = router
        self.health_interval_s = health_interval_s
        self.resolve_interval_s = resolve_interval_s
        self.replica_wait_s = replica_wait_s
        self.on_health = on_health
        self._resolve = resolve
        self._links: dict[str, EngineLink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._round_due = threading.Condition()  # the monitor's wait: woken by a request that waits, or stop
        self._waiting = 0  # requests in await_serving
        self._monitor = threading.Thread(target=self._run, name="replica-monitor", daemon=True)
        self._resolved_at = -float("inf")

    # -------------------------------------------------------------- links

    def link(self, address: str) -> EngineLink:
        with self._lock:
            return self._links[address]

    def links(self) -> dict[str, EngineLink]:
        with self._lock:
            return dict(self._links)

    def any_serving(self) -> EngineLink:
        """A serving replica's link (for calls any replica answers alike: Tokenize, Info);
        during a drain or a restart, the first to serve again (``await_serving``).

        Raises:
            NoReplica: none serves.
        """
        serving = self.router.serving()
        if not serving and self.await_serving({}, self.replica_wait_s):
            serving = self.router.serving()
        if not serving:
            raise NoReplica(f"no engine replica is serving (replicas: {', '.join(self.router.addresses()) or 'none'})")
        return self.link(serving[0])

    def mark_down(self, address: str) -> None:
        """A call found ``address`` unavailable: route around it until its health says otherwise."""
        if self.router.set_serving(address, False):
            log.info("engine replica down: a call found it unavailable", extra={"engine": address})

    def await_serving(self, tried: Mapping[str, int], timeout_s: float) -> bool:
        """Waits, at most ``timeout_s`` and ``replica_wait_s``, for a replica
        to serve that has not refused the request (``tried``: see
        ``Router.refusers``). Waits only when a replica served within
        ``replica_wait_s`` (a drain or a restart under way): a fleet that is
        down, or was never up, answers at once. False: none came."""
        timeout_s = min(timeout_s, self.replica_wait_s)
        if timeout_s <= 0 or not self.router.served_within(self.replica_wait_s):
            return False
        log.info("request waits for a replica to serve", extra={"refused_by": sorted(tried), "wait_s": timeout_s})
        with self._round_due:
            self._waiting += 1
            self._round_due.notify()  # a health round now, then hurried ones
        try:
            return self.router.wait_serving(tried, timeout_s)
        finally:
            with self._round_due:
                self._waiting -= 1

    # -------------------------------------------------------------- rounds

    def start(self) -> None:
        self.refresh()
        self._monitor.start()

    def stop(self) -> None:
        self._stop.set()
        with self._round_due:
            self._round_due.notify()
        self._monitor.join(timeout=5)
        with self._lock:
            links, self._links = self._links, {}
        for link in links.values():
            link.close()  # also ends its watchers' streams

    def refresh(self) -> None:
        """One round: the replicas (re-resolved when due), then their health."""
        if time.monotonic() - self._resolved_at >= self.resolve_interval_s:
            self._resolved_at = time.monotonic()
            self._set_addresses(self._resolve(self.endpoints))
        for address, link in self.links().items():
            serving = _serving(link)
            if serving is not None and self.router.set_serving(address, serving):
                log.info("engine replica serving" if serving else "engine replica down: its health check failed",
                         extra={"engine": address})  # fmt: skip
        self.on_health(bool(self.router.serving()))

    def _set_addresses(self, addresses: list[str]) -> None:
        with self._lock:
            added = [a for a in addresses if a not in self._links]
            removed = [self._links.pop(a) for a in list(self._links) if a not in addresses]
            for address in added:
                self._links[address] = EngineLink(address)
        self.router.set_replicas(addresses)
        for link in removed:
            log.info("engine replica gone", extra={"engine": link.address})
            link.close()
        for address in added:
            log.info("engine replica added", extra={"engine": address})
            threading.Thread(target=self._watch_events, args=(address,), name=f"events-{address}", daemon=True).start()
            threading.Thread(target=self._watch_load, args=(address,), name=f"load-{address}", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._round_due:
                self._round_due.wait(HURRIED_INTERVAL_S if self._waiting else self.health_interval_s)
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except Exception:  # a bug in one round must not stop the monitor
                log.exception("replica monitor round failed")

    def _watch_events(self, address: str) -> None:
        """Follows one replica's block events while it is in the pool."""
        while not self._stop.is_set():
            if (link := self._link_of(address)) is None:
                return  # dropped from the pool
            try:
                if self._follow_events(address, link):
                    continue  # out of sequence: a fresh snapshot at once
            except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
                pass
            # Events were missed while the stream was down: what we knew may be stale.
            self.router.forget(address)
            self._stop.wait(0.5)

    def _follow_events(self, address: str, link: EngineLink) -> bool:
        """Applies one subscription's batches; True when one came out of
        sequence (the caller subscribes again), False when the stream ended."""
        stream = link.stub.BlockEvents(epb.BlockEventsRequest())
        expected: tuple[str, int] | None = None  # (incarnation, next sequence)
        try:
            for batch in stream:
                if batch.snapshot:
                    expected = (batch.incarnation, batch.sequence + 1)
                elif expected is not None:
                    if (batch.incarnation, batch.sequence) != expected:
                        log.info("block events out of sequence: a fresh snapshot",
                                 extra={"engine": address, "expected": expected, "got": batch.sequence})  # fmt: skip
                        return True
                    expected = (batch.incarnation, batch.sequence + 1)
                self.router.record_events(address, [_event(e) for e in batch.events])
            return False
        finally:
            stream.cancel()

    def _watch_load(self, address: str) -> None:
        """Follows one replica's load reports while it is in the pool."""
        while not self._stop.is_set():
            if (link := self._link_of(address)) is None:
                return
            try:
                for r in link.stub.Load(epb.LoadRequest()):
                    self.router.report_load(address, _load(r))
            except (grpc.RpcError, ValueError):
                pass
            self.router.forget_load(address)  # back to counting this gateway's own requests
            self._stop.wait(0.5)

    def _link_of(self, address: str) -> EngineLink | None:
        with self._lock:
            return self._links.get(address)


def _load(r: epb.LoadReport) -> Load:
    return Load(r.queued_tokens, r.running, r.free_blocks, r.forward_s, r.token_s, r.token_budget)


def _serving(link: EngineLink) -> bool | None:
    """The replica's health; None when it answered too slowly to tell.

    NOTE: a busy replica (every core generating) may answer a health check
    late; taking it out for that turned a loaded single-replica gateway into
    a stream of UNAVAILABLE. A replica that is gone fails fast (connection
    refused: UNAVAILABLE) and is marked down at once.
    """
    try:
        reply = health_pb2_grpc.HealthStub(link.channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.RpcError as err:
        return None if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
    return reply.status == _SERVING


def _event(event: dpb.BlockEvent) -> Event:
    kind = event.WhichOneof("kind")
    if kind == "all_cleared":
        return Cleared()
    # A block counts as held while it is stored in any tier (device or host):
    # a host-tier hit costs a copy, far less than recomputing it.
    if kind == "stored":
        return Stored(tuple(event.stored.block_hashes), event.stored.tier)
    return Removed(tuple(event.removed.block_hashes), event.removed.tier)
