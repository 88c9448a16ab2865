"""The gateway's channel to an engine (``gateway.replicas``) over real
sockets: an engine that answers its connection's handshake slowly, as one
on a loaded machine does, is still reached and seen serving."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from gateway.replicas import ReplicaPool
from gateway.router import Router
from tests.conftest import wait_for

#: How long the engine's first bytes (its HTTP/2 settings) take to reach the gateway.
HANDSHAKE_DELAY_S = 1.5


def _pipe(source: socket.socket, sink: socket.socket, first_delay_s: float) -> None:
    """Copies ``source`` to ``sink``, holding the first chunk back ``first_delay_s``."""
    with contextlib.suppress(OSError):
        delay = first_delay_s
        while data := source.recv(65536):
            time.sleep(delay)
            delay = 0.0
            sink.sendall(data)
    for sock in (source, sink):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class SlowHandshakeProxy:
    """A TCP proxy in front of ``target`` whose replies start ``delay_s`` late."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target, self.delay_s = target, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # closed: the test is over
            while True:
                client, _ = self.listener.accept()
                engine = socket.create_connection(self.target)
                threading.Thread(target=_pipe, args=(client, engine, 0.0), daemon=True).start()
                threading.Thread(target=_pipe, args=(engine, client, self.delay_s), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def slow_engine() -> Iterator[str]:
    """A gRPC server reporting SERVING, reached through a slow-handshake proxy."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" is SERVING
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = SlowHandshakeProxy(("127.0.0.1", port), HANDSHAKE_DELAY_S)
    yield proxy.address
    proxy.close()
    server.stop(grace=None)


def test_an_engine_whose_handshake_is_slow_is_still_reached_and_seen_serving(slow_engine):
    router = Router()
    pool = ReplicaPool([slow_engine], router, health_interval_s=0.2, resolve=list)
    pool.start()
    try:
        # 60 s: far past the handshake; a channel that cuts it short never gets there.
        assert wait_for(lambda: router.serving() == [slow_engine], timeout_s=60, interval_s=0.1), router.serving()
    finally:
        pool.stop()
