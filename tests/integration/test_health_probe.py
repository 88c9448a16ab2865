"""`kvd-health` against a real daemon (unix socket and TCP) and a real gRPC server
whose health is NOT_SERVING."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvd.common.health_probe import check
from tests.conftest import SMALL_LAYOUT, free_port

PROBE = str(Path(sys.executable).parent / "kvd-health")


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROBE, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def tcp_daemon(daemon_factory, workdir):
    # TCP needs a token (health checks are answered without one: that is what this tests).
    token_file = Path(workdir) / "token"
    token_file.write_text("probe-test-token-0123456789\n")
    token_file.chmod(0o600)
    port = free_port()
    flags = ("--num-blocks", "8", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file))
    return daemon_factory(*SMALL_LAYOUT, *flags), port


def test_serving_daemon_on_unix_socket_and_tcp(tcp_daemon):
    daemon, port = tcp_daemon
    for address in (daemon.address, f"127.0.0.1:{port}"):
        result = probe(address)
        assert result.returncode == 0, result.stderr
        assert "SERVING" in result.stdout
    assert check(daemon.address, "kvd.daemon.v1.KVDaemon") == (0, f"{daemon.address}: SERVING")


def test_unknown_service_and_unreachable_address_fail(tcp_daemon, workdir):
    daemon, _ = tcp_daemon
    code, message = check(daemon.address, "no.such.Service")
    assert code == 2 and "NOT_FOUND" in message
    result = probe(f"unix:{workdir}/nobody.sock", "--timeout", "1")
    assert result.returncode == 2 and "UNAVAILABLE" in result.stderr
    result = probe(f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 2


def test_not_serving_is_exit_1():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = probe(f"127.0.0.1:{port}")
        assert result.returncode == 1 and "NOT_SERVING" in result.stderr
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(f"127.0.0.1:{port}").returncode == 0
    finally:
        server.stop(0)
