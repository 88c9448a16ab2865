"""The HTTP listener of the gateway process: uvicorn on a thread of its own.

With the gateway's TLS certificate and key it serves HTTPS. The socket is
bound here, before the thread starts, so a port taken is an error at start
(as the gRPC port's) and port 0 names the port it got.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from gateway.http_api.app import create_app
from gateway.http_api.threads import WorkerThreads
from gateway.request_path import RequestPath
from kvd.common.grpc_server import OpenCalls

log = logging.getLogger("gateway.http")

#: Threads for the HTTP calls other than generations (models, templates), on
#: top of one per open generation (a stream holds a thread for its length).
OTHER_THREADS = 32


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too) as (host, port); ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--http-listen: {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class HttpServer:
    """Serves the request path over HTTP on ``address`` once started; its
    generations count in ``open_calls`` with the gRPC API's."""

    def __init__(
        self,
        requests: RequestPath,
        open_calls: OpenCalls,
        address: str,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        served_model_names: Sequence[str] = (),
    ) -> None:
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError:
            self.socket.close()
            raise
        self.socket.listen(2048)  # connections made before uvicorn runs wait for it
        self.host = host
        self.port = self.socket.getsockname()[1]
        self.threads = WorkerThreads(open_calls.limit + OTHER_THREADS)
        app = create_app(requests, self.threads, open_calls, served_model_names)
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=2, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._serve, name="gateway-http", daemon=True)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        except BaseException:  # the gRPC API goes on; say why the HTTP one stopped
            log.exception("the HTTP API stopped", extra={"http": self.address})

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.threads.close()
        self.socket.close()
