"""The gateway's embedded Redis stops with its gateway, however the gateway went,
and keeps what was written (its AOF) for the next gateway on the same folder.

The gateways here have no engine (they never serve): only their Redis matters.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import psutil
import pytest
import redis

from gateway.embedded_redis import EmbeddedRedis
from tests.conftest import free_port, start_gateway, wait_for


def _redis_pid(data_dir: Path) -> int:
    # Redis truncates its pid file before writing it, so a read can see it empty;
    # wait for a pid that names a live process as well as for the socket.
    pid_file = data_dir / "redis.pid"

    def live_pid() -> int | None:
        text = pid_file.read_text().strip() if pid_file.exists() else ""
        return int(text) if text.isdigit() and psutil.pid_exists(int(text)) else None

    assert wait_for(lambda: live_pid() is not None and (data_dir / "redis.sock").exists(), timeout_s=60)
    return live_pid()


def _client(data_dir: Path) -> redis.Redis:
    client = redis.Redis(unix_socket_path=str(data_dir / "redis.sock"))
    assert wait_for(lambda: _pings(client), timeout_s=20)
    return client


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_embedded_redis_stops_with_its_gateway(workdir, sig):
    data_dir = Path(workdir) / "gateway-data"
    args = ["--data-dir", str(data_dir)]
    gateway = start_gateway(f"127.0.0.1:{free_port()}", args, workdir, wait=False)
    pid = _redis_pid(data_dir)
    _client(data_dir).set("kept", "yes")
    gateway.stop(sig)
    assert wait_for(lambda: _gone(pid), timeout_s=15), f"redis-server {pid} outlived its gateway ({sig.name})"

    # The next gateway on the folder has the data (the AOF).
    gateway = start_gateway(f"127.0.0.1:{free_port()}", args, workdir, wait=False)
    pid = _redis_pid(data_dir)
    assert _client(data_dir).get("kept") == b"yes"
    gateway.stop()
    assert wait_for(lambda: _gone(pid), timeout_s=15)


def test_embedded_redis_stops_after_its_folder_was_removed(workdir):
    # Redis's final RDB save fails in a removed folder, and a Redis with save
    # points then refuses to exit on SIGTERM; this one has none.
    data_dir = Path(workdir) / "gateway-data"
    gateway = start_gateway(f"127.0.0.1:{free_port()}", ["--data-dir", str(data_dir)], workdir, wait=False)
    pid = _redis_pid(data_dir)
    _client(data_dir).set("k", "v")
    shutil.rmtree(data_dir)
    gateway.stop()
    assert wait_for(lambda: _gone(pid), timeout_s=15), "redis-server outlived a gateway whose folder was removed"


def test_a_second_user_of_the_folder_shares_the_running_server(workdir):
    data_dir = Path(workdir) / "shared"
    owner, guest = EmbeddedRedis(data_dir), EmbeddedRedis(data_dir)
    first = owner.start()
    try:
        second = guest.start()
        assert guest.process is None  # no second server on the same files
        first.set("seen", "1")
        assert second.get("seen") == b"1"
        guest.stop()  # not its server: still running
        assert first.ping()
    finally:
        owner.stop()
    assert owner.process is None
