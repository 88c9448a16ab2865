"""Starting the stack: a daemon, an engine and a gateway as subprocesses, for benchmarks and tests.

The commands (``daemon_command``, ``engine_command``, ``gateway_command``), the
wait for a gRPC server to report SERVING (``wait_serving``), free ports, and
stopping a child (SIGTERM, then SIGKILL if it lingers) are shared with the
test suite (``tests/conftest.py``). The classes (``KvdProcess``,
``EngineProcess``, ``GatewayProcess``) are the benchmarks' context managers
around them.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

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


class ChildProcess:
    """A subprocess with its output in a log file; stopped with SIGTERM (SIGKILL
    if it lingers). Subclasses set ``command`` and ``log_path`` and wait for
    readiness in ``start``; use them as context managers."""

    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def _spawn(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_path.unlink(missing_ok=True)  # each start's log of its own
        self.proc = spawn(self.command, self.log_path, env)
        return self.proc

    def start(self) -> ChildProcess:
        raise NotImplementedError

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> int | None:
        proc, self.proc = self.proc, None
        return None if proc is None else stop_process(proc, signal.SIGTERM, timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class KvdProcess(ChildProcess):
    """A ``kvd`` daemon subprocess listening on a unix socket in ``workdir``.

    Use as a context manager; the daemon gets SIGTERM on exit (SIGKILL if it
    lingers). Its log goes to ``workdir/NAME.log``.

    Args:
        workdir: folder for the socket, the shared-memory file and the log.
        args: further flags (layout, ``--num-blocks``, ...).
        name: names the socket and log files.
        ready_timeout_s: how long to wait for the socket to appear.
    """

    def __init__(
        self, workdir: str | os.PathLike, args: Sequence[str] = (), name: str = "kvd", ready_timeout_s: float = 60.0
    ) -> None:
        self.workdir = Path(workdir)
        self.socket = str(self.workdir / f"{name}.sock")
        self.log_path = self.workdir / f"{name}.log"
        self.command = daemon_command(self.socket, str(self.workdir), args)
        self.ready_timeout_s = ready_timeout_s
        self.startup_s = math.nan

    @property
    def address(self) -> str:
        return f"unix:{self.socket}"

    def start(self) -> KvdProcess:
        start = time.perf_counter()
        self._spawn()
        deadline = start + self.ready_timeout_s
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            if time.perf_counter() > deadline:
                self.stop()
                raise TimeoutError(f"kvd did not create {self.socket} within {self.ready_timeout_s}s")
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - start
        return self


class EngineProcess(ChildProcess):
    """A ``kvd-engine`` subprocess (``python -m inference.cli``) on a TCP port of 127.0.0.1.

    Use as a context manager; the engine gets SIGTERM on exit (SIGKILL if it
    lingers). Its log goes to ``workdir/NAME.log``. ``start`` returns once the
    engine's health check says SERVING (it has loaded its model and attached
    to the daemon).

    Args:
        workdir: folder for the log.
        kvd_address: the daemon (``unix:PATH``).
        args: further flags (``--model``, ``--no-prefix-caching``, ...).
        name: names the log file.
        ready_timeout_s: how long to wait for SERVING.
        port: its port (0: a free one; a replacement takes its predecessor's).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        kvd_address: str,
        args: Sequence[str] = (),
        name: str = "engine",
        ready_timeout_s: float = 300.0,
        port: int = 0,
    ) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = self.workdir / f"{name}.log"
        self.command = engine_command(kvd_address, self.address, args)
        self.ready_timeout_s = ready_timeout_s
        self.startup_s = math.nan

    def start(self) -> EngineProcess:
        start = time.perf_counter()
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self._spawn(env)
        try:
            wait_serving(self.address, self.ready_timeout_s, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"engine did not start ({exc}):\n{self.log_tail()}") from None
        self.startup_s = time.perf_counter() - start
        return self


class GatewayProcess(ChildProcess):
    """A ``kvd-gateway`` subprocess with its own embedded Redis in ``workdir``;
    ``start`` returns once it serves (its engine is attached)."""

    def __init__(
        self, workdir: str | os.PathLike, engine_address: str, args: Sequence[str] = (), http: bool = False
    ) -> None:
        workdir = Path(workdir)
        self.address = f"127.0.0.1:{free_port()}"
        self.http_address = f"127.0.0.1:{free_port()}" if http else ""  # its OpenAI-compatible HTTP API
        self.log_path = workdir / "gateway.log"
        self.command = gateway_command(
            self.address, engine_address, ["--data-dir", str(workdir / "gateway-data"), *args], self.http_address
        )

    def start(self) -> GatewayProcess:
        try:
            wait_serving(self.address, 60, self._spawn())
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"gateway did not start ({exc}):\n{self.log_tail()}") from None
        return self
