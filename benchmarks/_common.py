"""Helpers shared by the benchmark scripts: machine info, statistics, JSON,
progress, tables, plots, and a kvd daemon in a subprocess.

Kept free of any one benchmark's workload so every script under
``benchmarks/`` can import it (``import _common`` works because Python puts a
script's own folder first on ``sys.path``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The checkout these benchmarks belong to.
REPO_ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ machine


def machine_info() -> dict[str, Any]:
    """The machine block of every benchmark's JSON (see BENCHMARKS.md)."""
    try:
        import torch

        torch_version: str | None = torch.__version__
        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch is a dependency of kvd
        torch_version, device = None, "cpu"
    return {
        "cpus": os.cpu_count(),
        "torch": torch_version,
        "device": device,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


#: The router's code: what the routing benchmarks measure.
ROUTER_SOURCES = (
    "gateway/router.py",
    "gateway/route_types.py",
    "gateway/replica_load.py",
    "gateway/placement.py",
    "gateway/policies.py",
    "gateway/block_index.py",
)


def source_digest(globs: Sequence[str] = ("kvd/**/*.py", "protos/**/*.proto")) -> dict[str, Any]:
    """Which code was measured: a sha256 over the matching files of the repository.

    The tree is often uncommitted while benchmarks run, so a commit id alone
    would not tell two runs apart.
    """
    root = REPO_ROOT
    digest = hashlib.sha256()
    files = sorted({path for pattern in globs for path in root.glob(pattern) if path.is_file()})
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return {
        "sha256": digest.hexdigest()[:16],
        "files": len(files),
        "git_head": head.stdout.strip() or None,
    }


# --------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    """The median; ``nan`` for no values."""
    return percentile(values, 50.0)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when it is undefined."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    if math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


def rounded(value: Any, digits: int = 4) -> Any:
    """Rounds floats (recursively) to ``digits`` significant digits for readable JSON."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value == 0:
            return value
        return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


# ---------------------------------------------------------------- output


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Writes ``data`` as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.4g}"
        return "-" if value is None else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(out)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Progress:
    """A one-line progress bar on stderr (a line per phase when not a terminal)."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label = label
        self.total = max(1, total)
        self.width = width
        self.count = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def advance(self, n: int = 1) -> None:
        self.count += n
        now = time.perf_counter()
        if self._tty and now - self._last >= 0.2:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(1.0, self.count / self.total)
        bar = "#" * int(frac * self.width)
        sys.stderr.write(f"\r{self.label:<34} [{bar:<{self.width}}] {frac:4.0%}")
        sys.stderr.flush()

    def done(self, note: str = "") -> None:
        elapsed = time.perf_counter() - self.start
        if self._tty:
            self.count = self.total
            self._draw()
            sys.stderr.write(f" {elapsed:6.2f}s {note}\n")
        else:
            sys.stderr.write(f"{self.label:<34} done {elapsed:6.2f}s {note}\n")
        sys.stderr.flush()


def bar_chart(
    path: str | os.PathLike,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    ylabel: str,
    title: str,
) -> bool:
    """A grouped bar chart as PNG; returns False (and says so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"--plot: matplotlib is not installed; skipped {path}")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- daemon


class ChildProcess:
    """A subprocess with its output in a log file; stopped with SIGTERM (SIGKILL
    if it lingers). Subclasses set ``command`` and ``log_path`` and wait for
    readiness in ``start``; use them as context managers."""

    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def _spawn(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        # NOTE: started in this checkout's root: ``python -m`` puts the working
        # folder first on sys.path, so a benchmark run from another checkout
        # (a baseline beside the change) would otherwise measure that one's code.
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                self.command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
            )
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
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

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
        self.command = [sys.executable, "-m", "kvd.cli", "--socket", self.socket, "--shm-dir", str(self.workdir), *args]
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


# ---------------------------------------------------------------- engine


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) another process has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Waits until ``address`` answers the gRPC health check with SERVING.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: not serving within ``timeout_s``.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.perf_counter() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.perf_counter() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not serving after {timeout_s}s")


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
        self.command = [
            sys.executable, "-m", "inference.cli", "--kvd-address", kvd_address, "--listen", self.address, *args,
        ]  # fmt: skip
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

    def __init__(self, workdir: str | os.PathLike, engine_address: str, args: Sequence[str] = ()) -> None:
        workdir = Path(workdir)
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = workdir / "gateway.log"
        self.command = [
            sys.executable, "-m", "gateway.cli", "--listen", self.address, "--engines", engine_address,
            "--data-dir", str(workdir / "gateway-data"), *args,
        ]  # fmt: skip

    def start(self) -> GatewayProcess:
        try:
            wait_serving(self.address, 60, self._spawn())
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"gateway did not start ({exc}):\n{self.log_tail()}") from None
        return self
