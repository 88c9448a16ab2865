"""The steps of running the stack's processes, for benchmarks and tests.

The commands (``daemon_command``, ``engine_command``, ``gateway_command``), the
wait for a gRPC server to report SERVING (``wait_serving``), free ports, and
stopping a child and its process group (SIGTERM, then SIGKILL if it lingers).
The handles built from them (``DaemonProcess``, ``EngineProcess``,
``GatewayProcess``) are in ``handles``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .report import REPO_ROOT


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_at(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1 right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_for(condition: Callable[[], object], timeout_s: float = 15.0, interval_s: float = 0.05) -> bool:
    """Polls ``condition`` until it holds or the time is up; returns whether it held last.

    A test or a benchmark waits for a state this way, never for a fixed time:
    the machine may be slow or shared.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())


def wait_serving(address: str, timeout_s: float = 20.0, process: subprocess.Popen | None = None) -> None:
    """Waits until ``address`` answers the gRPC health check with SERVING.

    Raises:
        RuntimeError: ``process`` exited first.
        TimeoutError: not serving within ``timeout_s``.
    """
    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"process exited with {process.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not serving after {timeout_s}s")


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
    """Signals a child and waits for it; kills it if it does not stop in time,
    then ends what it left running in its process group (``spawn`` gives
    each child its own: a supervisor killed outright leaves its children)."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    end_group(process.pid, timeout_s)
    return process.returncode


def end_group(leader: int, timeout_s: float) -> None:
    """SIGTERMs what is left of ``leader``'s process group, waits for it to
    exit (a Redis flushing its AOF), and SIGKILLs what outlives ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _group_members(leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_group(leader)


def kill_group(leader: int) -> None:
    """SIGKILLs the process group ``leader`` led (nothing when there is none left)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def _group_members(leader: int) -> list[int]:
    """The live (not zombie) processes of ``leader``'s group."""
    import psutil

    members = []
    for process in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == leader:
                members.append(process.pid)
    return members


def spawn(
    command: Sequence[str], log_path: str | os.PathLike, env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.Popen:
    """Starts ``command`` with its output appended to ``log_path``, as the
    leader of a process group of its own (``stop_process`` ends the group).

    NOTE: started in this checkout's root (unless ``cwd``): ``python -m``
    puts the working folder first on sys.path, so a run from another checkout
    (a baseline beside the change) would otherwise measure that one's code.
    """
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd or REPO_ROOT, start_new_session=True
        )


def daemon_command(socket_path: str, shm_dir: str, args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "kvd.cli", "--socket", socket_path, "--shm-dir", shm_dir, *args]


def engine_command(kvd_address: str, listen: str, args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "inference.cli", "--kvd-address", kvd_address, "--listen", listen, *args]


def gateway_command(listen: str, engines: str, args: Sequence[str] = (), http_listen: str = "") -> list[str]:
    """The gateway's command; its HTTP API off unless ``http_listen`` is given
    (gateways started side by side would all take its default port)."""
    http = ["--http-listen", http_listen]
    return [sys.executable, "-m", "gateway.cli", "--listen", listen, "--engines", engines, *http, *args]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) another process has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
