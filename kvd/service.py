"""The daemon's gRPC service: protobuf in, plain Python calls, protobuf out."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvd import wire
from kvd.block_pool import DEVICE, HOST, AllCleared, BlockEvent, BlockRemoved, BlockStored
from kvd.daemon import Daemon, EventsSnapshot
from kvd.errors import CapacityError, NotFoundError, PreconditionError
from kvd.free_queue import FreeBlockQueue
from kvd.metrics import DaemonMetrics
from kvd_api.daemon.v1 import daemon_pb2 as pb
from kvd_api.daemon.v1 import daemon_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVDaemon"].full_name

_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
)


def _rpc(method):
    """Maps the daemon's exceptions to gRPC status codes with their message."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except tuple(e for e, _ in _STATUS_BY_ERROR) as exc:
            code = next(c for e, c in _STATUS_BY_ERROR if isinstance(exc, e))
            message = str(exc.args[0]) if exc.args else str(exc)
            context.abort(code, message)
        except Exception:
            log.exception("internal error", extra={"rpc": method.__name__})
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}; see the daemon's log")

    return wrapper


class KVDaemonService(pb_grpc.KVDaemonServicer):
    def __init__(self, daemon: Daemon, metrics: DaemonMetrics | None = None) -> None:
        self.daemon = daemon
        self.metrics = metrics

    @_rpc
    def Describe(self, request, context):
        memory = self.daemon.describe()
        if memory is None:
            return pb.DescribeResponse(ready=False)
        return pb.DescribeResponse(
            ready=True,
            layout=wire.layout_to_pb(memory.layout, memory.num_blocks),
            memory=wire.memory_to_pb(memory),
            cache_id=self.daemon.cache_id,
        )

    @_rpc
    def Attach(self, request, context):
        layout = None
        if request.HasField("layout"):
            layout = wire.layout_from_pb(request.layout, self.daemon.config.block_size)
            if layout.block_size != self.daemon.config.block_size:
                raise PreconditionError(
                    f"block_size {layout.block_size} differs from the daemon's {self.daemon.config.block_size}"
                )
        session, memory = self.daemon.attach(request.client_name, layout)
        return pb.AttachResponse(
            session_id=session.session_id,
            layout=wire.layout_to_pb(memory.layout, memory.num_blocks),
            memory=wire.memory_to_pb(memory),
            heartbeat_interval_s=self.daemon.config.lease_s / 3,
            cache_id=self.daemon.cache_id,
        )

    @_rpc
    def Heartbeat(self, request, context):
        self.daemon.heartbeat(request.session_id)
        return pb.HeartbeatResponse()

    @_rpc
    def Detach(self, request, context):
        return pb.DetachResponse(released_requests=self.daemon.detach(request.session_id))

    @_rpc
    def Step(self, request, context):
        start = time.perf_counter()
        out = self.daemon.step(request.session_id, wire.step_from_pb(request))
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - start)
        return wire.step_output_to_pb(out)

    @_rpc
    def Lookup(self, request, context):
        hashes, on_host = self.daemon.lookup(list(request.token_ids), request.cache_salt, list(request.extra_keys))
        block_size = self.daemon.config.block_size
        return pb.LookupResponse(
            num_cached_tokens=len(hashes) * block_size, block_hashes=hashes, num_host_cached_tokens=on_host * block_size
        )

    @_rpc
    def Pin(self, request, context):
        blocks = self.daemon.pin(request.pin_id, list(request.token_ids), request.cache_salt, list(request.extra_keys))
        return pb.PinResponse(num_pinned_blocks=blocks, num_pinned_tokens=blocks * self.daemon.config.block_size)

    @_rpc
    def Unpin(self, request, context):
        return pb.UnpinResponse(num_unpinned_blocks=self.daemon.unpin(request.pin_id))

    @_rpc
    def Stats(self, request, context):
        return pb.StatsResponse(**vars(self.daemon.stats()))

    @_rpc
    def Reset(self, request, context):
        return pb.ResetResponse(num_cleared_blocks=self.daemon.reset())

    @_rpc
    def InspectBlock(self, request, context):
        block, digest = self.daemon.inspect_block(request.block_id)
        return pb.InspectBlockResponse(
            ref_cnt=block.ref_cnt,
            block_hash=block.block_hash or b"",
            data_sha256=digest,
            in_free_queue=FreeBlockQueue.is_linked(block),
        )

    def Events(self, request, context):
        subscriber, snapshot = self.daemon.subscribe()
        context.add_callback(lambda: subscriber.put(None))  # wakes us on cancel
        try:
            yield from snapshot_to_pb(snapshot)
            while True:
                item = subscriber.get()
                if item is None:
                    return
                incarnation, sequence, batch = item
                yield pb.BlockEvents(
                    events=[event_to_pb(e) for e in batch], incarnation=incarnation, sequence=sequence
                )
        finally:
            self.daemon.unsubscribe(subscriber)


#: Hashes per snapshot message: 32-byte hashes stay far under gRPC's 4 MB message limit.
SNAPSHOT_CHUNK = 50_000


def snapshot_to_pb(snapshot: EventsSnapshot) -> Iterator[pb.BlockEvents]:
    """The snapshot's messages: all cleared, then each tier's blocks stored, in chunks."""
    header = {"incarnation": snapshot.incarnation, "sequence": snapshot.sequence, "snapshot": True}
    yield pb.BlockEvents(events=[pb.BlockEvent(all_cleared=pb.AllCleared())], **header)
    for tier, hashes in ((pb.TIER_DEVICE, snapshot.device), (pb.TIER_HOST, snapshot.host)):
        for start in range(0, len(hashes), SNAPSHOT_CHUNK):
            stored = pb.BlockStored(block_hashes=hashes[start : start + SNAPSHOT_CHUNK], tier=tier)
            yield pb.BlockEvents(events=[pb.BlockEvent(stored=stored)], **header)


_TIER_TO_PB = {DEVICE: pb.TIER_DEVICE, HOST: pb.TIER_HOST}


def event_to_pb(event: BlockEvent) -> pb.BlockEvent:
    if isinstance(event, BlockStored):
        return pb.BlockEvent(stored=pb.BlockStored(block_hashes=event.block_hashes, tier=_TIER_TO_PB[event.tier]))
    if isinstance(event, BlockRemoved):
        return pb.BlockEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes, tier=_TIER_TO_PB[event.tier]))
    assert isinstance(event, AllCleared)
    return pb.BlockEvent(all_cleared=pb.AllCleared())


def build_server(daemon: Daemon, metrics: DaemonMetrics | None, max_workers: int = 32) -> grpc.Server:
    """A gRPC server with the daemon, health and reflection services (no port yet)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvd-rpc"))
    pb_grpc.add_KVDaemonServicer_to_server(KVDaemonService(daemon, metrics), server)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return server
