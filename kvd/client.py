"""A small client of the daemon: a session with heartbeats and the mapped cache.

with DaemonClient.connect("unix:/tmp/kvd-0/kvd.sock") as client:
    session = client.attach("my-engine", layout)   # maps the KV memory
    reply = session.step(pb.StepRequest(admissions=[...], token_budget=512))
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import torch

from kvd import wire
from kvd.auth import BearerToken
from kvd.layout import CacheLayout
from kvd.memory import map_kv_cache
from kvd.step import StepInput, StepOutput
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
        listener needs, see ``kvd.auth``); waits until it answers."""
        channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ConnectionError(f"the daemon at {address} did not answer within {timeout_s}s") from None
        return cls(grpc.intercept_channel(channel, BearerToken(token)) if token else channel)

    def attach(self, client_name: str, layout: CacheLayout | None = None, map_memory: bool = True) -> DaemonSession:
        """Opens a session; ``layout`` is the model's (its block size is the daemon's to choose).

        Raises:
            grpc.RpcError: FAILED_PRECONDITION when the daemon's cache has another layout.
        """
        request = pb.AttachRequest(client_name=client_name)
        if layout is not None:
            request.layout.CopyFrom(wire.layout_to_pb(layout))
            request.layout.block_size = 0  # the daemon's setting
        return DaemonSession(self, self.stub.Attach(request), map_memory)

    def lookup(self, token_ids: list[int], cache_salt: bytes = b"") -> int:
        """Cached leading tokens of ``token_ids`` (block-aligned)."""
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


class DaemonSession:
    """An attached session: keeps its lease alive from a background thread.

    Attributes:
        layout: the cache's layout (block size included).
        num_blocks: blocks in the cache.
        cache_id: the cache's identity; a new one after a daemon restart.
        lost: set (to the reason) when a heartbeat finds the session gone.
        cache: the mapped cache tensor ``[num_blocks, layers, 2, block, heads, dim]``.
    """

    def __init__(self, client: DaemonClient, reply: pb.AttachResponse, map_memory: bool) -> None:
        self.client = client
        self.session_id = reply.session_id
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

    def step(self, step: StepInput, timeout_s: float | None = None) -> StepOutput:
        """One Step RPC: the same types as ``kvd.step.run_step`` in-process."""
        reply = self.client.stub.Step(wire.step_to_pb(step, self.session_id), timeout=timeout_s)
        return wire.step_output_from_pb(reply)

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.client.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.session_id), timeout=interval_s)
            except grpc.RpcError as err:
                # NOT_FOUND: the daemon no longer knows us (it restarted, or our
                # lease lapsed); UNAVAILABLE: it is gone. Either way the blocks
                # and the memory we map are no longer ours. Other errors (a slow
                # beat) are left to the next one.
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                    self.lost = f"{err.code().name}: {err.details()}"
                    return

    def detach(self) -> int:
        self._stop.set()
        return self.client.stub.Detach(pb.DetachRequest(session_id=self.session_id)).released_requests
