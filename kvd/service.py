"""The daemon's gRPC service: protobuf in, plain Python calls, protobuf out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import grpc

from kvd.block_pool import DEVICE, DISK, HOST, AllCleared, BlockEvent, BlockRemoved, BlockStored, FreeBlockQueue
from kvd.common import wire
from kvd.common.grpc_server import Server, StatusTable
from kvd.common.grpc_server import build_server as build_grpc_server
from kvd.daemon import Daemon
from kvd.errors import CapacityError, NotFoundError, PreconditionError
from kvd.events import EventsSnapshot
from kvd.metrics import DaemonMetrics
from kvd_api.daemon.v1 import daemon_pb2 as pb
from kvd_api.daemon.v1 import daemon_pb2_grpc as pb_grpc

log = logging.getLogger("kvd.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVDaemon"].full_name

# The daemon's exceptions and the statuses callers get for them (kvd.common.grpc_server).
STATUS_BY_ERROR: StatusTable = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
)


class KVDaemonService(pb_grpc.KVDaemonServicer):
    def __init__(self, daemon: Daemon, metrics: DaemonMetrics | None = None) -> None:
        self.daemon = daemon
        self.metrics = metrics

    def Describe(self, request, context):
        memory = self.daemon.cache_memory()
        if memory is None:
            return pb.DescribeResponse(ready=False)
        return pb.DescribeResponse(
            ready=True,
            layout=wire.layout_to_pb(memory.layout, memory.num_blocks),
            memory=wire.memory_to_pb(memory),
            cache_id=self.daemon.cache_id,
        )

    def Attach(self, request, context):
        version = request.protocol_version or 1
        if version != wire.PROTOCOL_VERSION:
            raise PreconditionError(
                f"the engine speaks Step protocol v{version}, this daemon speaks v{wire.PROTOCOL_VERSION}: "
                "run an engine and a daemon of the same release"
            )
        layout = None
        if request.HasField("layout"):
            layout = wire.layout_from_pb(request.layout, self.daemon.config.block_size)
            if layout.block_size != self.daemon.config.block_size:
                raise PreconditionError(
                    f"block_size {layout.block_size} differs from the daemon's {self.daemon.config.block_size}"
                )
        process = wire.process_from_pb(request.process) if request.HasField("process") else None
        model = wire.model_from_pb(request.model) if request.HasField("model") else None
        session, memory = self.daemon.attach(request.client_name, layout, process, model)
        return pb.AttachResponse(
            session_id=session.session_id,
            layout=wire.layout_to_pb(memory.layout, memory.num_blocks),
            memory=wire.memory_to_pb(memory),
            heartbeat_interval_s=self.daemon.config.lease_s / 3,
            cache_id=self.daemon.cache_id,
            protocol_version=wire.PROTOCOL_VERSION,
            lease_s=self.daemon.config.lease_s,
        )

    def Heartbeat(self, request, context):
        self.daemon.heartbeat(request.session_id)
        return pb.HeartbeatResponse()

    def Detach(self, request, context):
        return pb.DetachResponse(released_requests=self.daemon.detach(request.session_id))

    def Step(self, request, context):
        start = time.perf_counter()
        reply = self.daemon.step(request.session_id, request)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - start)
        return reply

    def Lookup(self, request, context):
        cached = self.daemon.cached_prefix(list(request.token_ids), request.cache_salt, list(request.extra_keys))
        block_size = self.daemon.config.block_size
        return pb.LookupResponse(
            num_cached_tokens=len(cached.device_hashes) * block_size,
            block_hashes=cached.device_hashes,
            num_host_cached_tokens=cached.num_host_blocks * block_size,
            num_disk_cached_tokens=cached.num_disk_blocks * block_size,
        )

    def Pin(self, request, context):
        blocks = self.daemon.pin(request.pin_id, list(request.token_ids), request.cache_salt, list(request.extra_keys))
        return pb.PinResponse(num_pinned_blocks=blocks, num_pinned_tokens=blocks * self.daemon.config.block_size)

    def Unpin(self, request, context):
        return pb.UnpinResponse(num_unpinned_blocks=self.daemon.unpin(request.pin_id))

    def Stats(self, request, context):
        return pb.StatsResponse(**vars(self.daemon.stats()))

    def Reset(self, request, context):
        return pb.ResetResponse(num_cleared_blocks=self.daemon.reset())

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
                batch = subscriber.get()
                if batch is None:
                    return
                yield pb.BlockEvents(
                    events=[event_to_pb(e) for e in batch.events],
                    incarnation=batch.incarnation,
                    sequence=batch.sequence,
                )
        finally:
            self.daemon.unsubscribe(subscriber)


#: Hashes per snapshot message: 32-byte hashes stay far under gRPC's 4 MB message limit.
SNAPSHOT_CHUNK = 50_000


def snapshot_to_pb(snapshot: EventsSnapshot) -> Iterator[pb.BlockEvents]:
    """The snapshot's messages: all cleared, then each tier's blocks stored, in chunks."""
    header = {"incarnation": snapshot.incarnation, "sequence": snapshot.sequence, "snapshot": True}
    yield pb.BlockEvents(events=[pb.BlockEvent(all_cleared=pb.AllCleared())], **header)
    tiers = ((pb.TIER_DEVICE, snapshot.device), (pb.TIER_HOST, snapshot.host), (pb.TIER_DISK, snapshot.disk))
    for tier, hashes in tiers:
        for start in range(0, len(hashes), SNAPSHOT_CHUNK):
            stored = pb.BlockStored(block_hashes=hashes[start : start + SNAPSHOT_CHUNK], tier=tier)
            yield pb.BlockEvents(events=[pb.BlockEvent(stored=stored)], **header)


_TIER_TO_PB = {DEVICE: pb.TIER_DEVICE, HOST: pb.TIER_HOST, DISK: pb.TIER_DISK}


def event_to_pb(event: BlockEvent) -> pb.BlockEvent:
    if isinstance(event, BlockStored):
        return pb.BlockEvent(stored=pb.BlockStored(block_hashes=event.block_hashes, tier=_TIER_TO_PB[event.tier]))
    if isinstance(event, BlockRemoved):
        return pb.BlockEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes, tier=_TIER_TO_PB[event.tier]))
    assert isinstance(event, AllCleared)
    return pb.BlockEvent(all_cleared=pb.AllCleared())


def build_server(
    daemon: Daemon, metrics: DaemonMetrics | None, max_workers: int = 32, interceptors: tuple = ()
) -> Server:
    """The daemon's server: its service, health (serving from the start), reflection (no port yet)."""
    service = KVDaemonService(daemon, metrics)
    return build_grpc_server(
        [(pb_grpc.add_KVDaemonServicer_to_server, service, SERVICE_NAME)],
        STATUS_BY_ERROR,
        serving=True,
        max_workers=max_workers,
        thread_name_prefix="kvd-rpc",
        interceptors=interceptors,
    )
