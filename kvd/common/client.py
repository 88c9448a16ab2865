"""A small client of the daemon: a session with heartbeats and the mapped cache.

with DaemonClient.connect("unix:/tmp/kvd-0/kvd.sock") as client:
    session = client.attach("my-engine", layout)   # maps the KV memory
    reply = session.step(pb.StepRequest(new_requests=[pb.NewRequest(...)]))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import torch

from kvd.common import wire
from kvd.common.auth import BearerToken
from kvd.common.identity import ModelIdentity
from kvd.common.layout import CacheLayout
from kvd.common.memory import map_kv_cache
from kvd.common.process_identity import ProcessIdentity
from kvd_api.daemon.v1 import daemon_pb2 as pb
from kvd_api.daemon.v1 import daemon_pb2_grpc as pb_grpc


class DaemonClient:
    """A channel and stub to one daemon."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.KVDaemonStub(channel)

    @classmethod
    def connect(cls, address: str, timeout_s: float = 10.0, token: str | None = None) -> DaemonClient:
        """Connects to ``unix:PATH`` or ``HOST:PORT`` (``token``: what its TCP
        listener needs, see ``kvd.common.auth``); waits until it answers."""
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ConnectionError(f"the daemon at {address} did not answer within {timeout_s}s") from None
        return cls(grpc.intercept_channel(channel, BearerToken(token)) if token else channel)

    def attach(
        self,
        client_name: str,
        layout: CacheLayout | None = None,
        map_memory: bool = True,
        model: ModelIdentity | None = None,
    ) -> DaemonSession:
        """Opens a session; ``layout`` is the model's (its block size is the
        daemon's to choose), ``model`` names it (kvd.common.identity).

        Raises:
            grpc.RpcError: FAILED_PRECONDITION when the daemon's cache has another
                layout or model, or the daemon speaks another Step protocol.
        """
        request = pb.AttachRequest(client_name=client_name, protocol_version=wire.PROTOCOL_VERSION)
        # NOTE: naming this process lets the daemon hand a lapsed session's
        # blocks out again as soon as it sees this process gone, and never
        # while it may still be writing them (kvd/quarantine.py).
        process = ProcessIdentity.of_this_process()
        if process is not None:
            request.process.CopyFrom(wire.process_to_pb(process))
        if layout is not None:
            request.layout.CopyFrom(wire.layout_to_pb(layout))
            request.layout.block_size = 0  # the daemon's setting
        if model is not None:
            request.model.CopyFrom(wire.model_to_pb(model))
        sent_at = time.monotonic()
        return DaemonSession(self, self.stub.Attach(request), map_memory, sent_at)

    def device_cached_tokens(self, token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Leading tokens of ``token_ids`` cached on the device (block-aligned; the Lookup RPC)."""
        return self.stub.Lookup(pb.LookupRequest(token_ids=token_ids, cache_salt=cache_salt)).num_cached_tokens

    def pin(self, pin_id: str, token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Pins the cached prefix of ``token_ids``; returns the tokens pinned.

        Raises:
            grpc.RpcError: RESOURCE_EXHAUSTED past the daemon's pin cap.
        """
        request = pb.PinRequest(pin_id=pin_id, token_ids=token_ids, cache_salt=cache_salt)
        return self.stub.Pin(request).num_pinned_tokens

    def unpin(self, pin_id: str) -> int:
        """Releases a pin; returns its blocks. Raises grpc.RpcError NOT_FOUND for an unknown pin."""
        return self.stub.Unpin(pb.UnpinRequest(pin_id=pin_id)).num_unpinned_blocks

    def events(self) -> Iterator[pb.BlockEvents]:
        return self.stub.Events(pb.EventsRequest())

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LeaseLapsed(Exception):
    """The session's lease may have lapsed: its blocks may be someone else's."""


class DaemonSession:
    """An attached session: keeps its lease alive from a background thread.

    Attributes:
        layout: the cache's layout (block size included).
        num_blocks: blocks in the cache.
        cache_id: the cache's identity; a new one after a daemon restart.
        lost: set (to the reason) when a heartbeat finds the session gone.
        cache: the mapped cache tensor ``[num_blocks, layers, 2, block, heads, dim]``.
        lease_s: the daemon releases the session this long after the last
            call it answered (Step or Heartbeat).
        renewed_at: when the last answered call was sent (monotonic clock):
            the lease runs at least until ``renewed_at + lease_s``.
    """

    def __init__(self, client: DaemonClient, reply: pb.AttachResponse, map_memory: bool, sent_at: float) -> None:
        self.client = client
        self.session_id = reply.session_id
        self.lease_s = reply.lease_s
        self.renewed_at = sent_at
        self.layout = wire.layout_from_pb(reply.layout, reply.layout.block_size)
        self.num_blocks = reply.layout.num_blocks
        self.cache_id = reply.cache_id
        self.cache: torch.Tensor | None = None
        if map_memory:
            export = wire.export_from_pb(reply.memory)
            self.cache = map_kv_cache(export, self.layout, tuple(reply.memory.shape), tuple(reply.memory.stride))
        self.lost: str | None = None  # why, once a heartbeat found the session gone
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(reply.heartbeat_interval_s,), name="kvd-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def step(self, request: pb.StepRequest, timeout_s: float | None = None) -> pb.StepResponse:
        """One Step RPC (its ``session_id`` is set here); renews the lease."""
        request.session_id = self.session_id
        sent_at = time.monotonic()
        reply = self.client.stub.Step(request, timeout=timeout_s)
        self.renewed_at = max(self.renewed_at, sent_at)
        return reply

    def check_lease(self) -> None:
        """Raises ``LeaseLapsed`` once the lease may have run out (before
        writing into the cache: lapsed blocks may be another session's)."""
        if time.monotonic() >= self.renewed_at + self.lease_s:
            raise LeaseLapsed(
                f"no answer from the daemon for {time.monotonic() - self.renewed_at:.1f}s "
                f"(lease {self.lease_s:g}s): session {self.session_id} may be released"
            )

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                sent_at = time.monotonic()
                self.client.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=interval_s)
                self.renewed_at = max(self.renewed_at, sent_at)
            except grpc.RpcError as err:
                # NOT_FOUND: the daemon no longer knows us (it restarted, or our
                # lease lapsed); UNAVAILABLE: it is gone. Either way the blocks
                # and the memory we map are no longer ours. Other errors (a slow
                # beat) are left to the next one.
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    self.lost = f"{err.code().name}: {err.details()}"
                    return

    def stop_heartbeats(self) -> None:
        """Lets the lease lapse (the daemon then quarantines the session's blocks)."""
        self._stop.set()

    def detach(self) -> int:
        """Ends the session; call only once nothing of this process writes
        into the cache any more (the daemon then hands its blocks out again,
        those of a lapsed session included)."""
        self._stop.set()
        return self.client.stub.Detach(pb.DetachRequest(session_id=self.session_id)).released_requests
