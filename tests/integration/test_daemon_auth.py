"""The daemon's TCP listener: a token on every call, the admin token for Reset
and InspectBlock; its unix socket (0600) needs none."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.common.client import DaemonClient
from kvd_api.daemon.v1 import daemon_pb2 as pb
from kvd_api.daemon.v1 import daemon_pb2_grpc as pb_grpc
from tests.conftest import SMALL_LAYOUT, free_port, start_daemon

TOKEN = "engine-token-0123456789"
ADMIN = "admin-token-0123456789ab"


def _token_file(folder: str, name: str, token: str) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(token + "\n")
    return path


@pytest.fixture(scope="module")
def tcp_daemon():
    """A daemon on its socket and on TCP, with both tokens: (daemon, TCP address)."""
    folder = tempfile.mkdtemp(prefix="kvd-auth-", dir="/tmp")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(
        [*SMALL_LAYOUT, "--num-blocks", "16", "--listen", address,
         "--token-file", _token_file(folder, "token", TOKEN),
         "--admin-token-file", _token_file(folder, "admin", ADMIN)],
        folder,
    )  # fmt: skip
    yield daemon, address
    daemon.stop()
    shutil.rmtree(folder, ignore_errors=True)


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _calls(stub, metadata):
    return {
        "Stats": lambda: stub.Stats(pb.StatsRequest(), metadata=metadata, timeout=10),
        "Reset": lambda: stub.Reset(pb.ResetRequest(), metadata=metadata, timeout=10),
        "InspectBlock": lambda: stub.InspectBlock(pb.InspectBlockRequest(block_id=0), metadata=metadata, timeout=10),
    }


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (None, {"Stats": "UNAUTHENTICATED", "Reset": "UNAUTHENTICATED", "InspectBlock": "UNAUTHENTICATED"}),
        ("wrong-token-0123456789", {"Stats": "UNAUTHENTICATED", "Reset": "PERMISSION_DENIED",
                                    "InspectBlock": "PERMISSION_DENIED"}),
        (TOKEN, {"Stats": "OK", "Reset": "PERMISSION_DENIED", "InspectBlock": "PERMISSION_DENIED"}),
        (ADMIN, {"Stats": "OK", "Reset": "OK", "InspectBlock": "OK"}),
    ],
    ids=["none", "wrong", "engine", "admin"],
)  # fmt: skip
def test_tcp_calls_need_the_token(tcp_daemon, token, expected):
    _, address = tcp_daemon
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVDaemonStub(channel)
        codes = {name: _code(call).name for name, call in _calls(stub, metadata).items()}
        # Probes need no token.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert codes == expected
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_unix_socket_needs_no_token_and_is_private(tcp_daemon):
    daemon, _ = tcp_daemon
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600
    with grpc.insecure_channel(daemon.address) as channel:
        codes = {name: _code(call).name for name, call in _calls(pb_grpc.KVDaemonStub(channel), None).items()}
    assert codes == {"Stats": "OK", "Reset": "OK", "InspectBlock": "OK"}


def test_an_engine_client_with_the_token_attaches_over_tcp(tcp_daemon):
    _, address = tcp_daemon
    with DaemonClient.connect(address, token=TOKEN) as client:
        session = client.attach("tcp-engine", map_memory=False)
        assert session.num_blocks == 16
        session.detach()
        assert client.stats().num_sessions == 0


def test_listening_on_tcp_without_a_token_is_refused(workdir):
    cmd = [sys.executable, "-m", "kvd.cli", "--socket", f"{workdir}/k.sock", "--metrics-port", "0",
           "--listen", f"127.0.0.1:{free_port()}", *SMALL_LAYOUT, "--num-blocks", "8"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--token-file" in run.stderr
