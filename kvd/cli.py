"""`kvd`: runs the KV-cache daemon.

Its settings are declared once: the cache's on the fields of ``DaemonConfig``
(``kvd/config.py``), where their values live, and the listener's here, in
``COMMAND``. Each flag comes with the environment variable that sets it (for
containers); both are read here, once, and nowhere deeper.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import click

from kvd.common import logs
from kvd.common.config_fields import config_from, settings_of
from kvd.common.settings import SOCKET, Setting, SettingsCommand, log_level, parse, refuse_retired_variables
from kvd.config import DaemonConfig

log = logging.getLogger("kvd")

_LISTENING = "listening"

COMMAND = SettingsCommand(
    "kvd",
    help="The KV-cache daemon: owns the paged KV memory, block metadata and prefix hashes.",
    params=[
        SOCKET,
        Setting(
            "--listen",
            env="KVD_LISTEN",
            section=_LISTENING,
            help="also listen on TCP HOST:PORT, e.g. 0.0.0.0:50061 (needs --token-file)",
        ),
        Setting(
            "--token-file",
            env="KVD_TOKEN_FILE",
            section=_LISTENING,
            help="a file with the token every TCP call but health checks must send (authorization: Bearer TOKEN, "
            "compared in constant time); needed with --listen",
        ),
        Setting(
            "--admin-token-file",
            env="KVD_ADMIN_TOKEN_FILE",
            section=_LISTENING,
            help="a file with the token of Reset and InspectBlock on TCP; without it they are unix-socket only",
        ),
        Setting(
            "--metrics-port",
            env="KVD_METRICS_PORT",
            type=click.INT,
            default=9401,
            section=_LISTENING,
            help="Prometheus metrics HTTP port on 127.0.0.1; 0: none",
        ),
        *settings_of(DaemonConfig),
        log_level(),
    ],
)


def _prepare_socket(path: str) -> None:
    """Creates a private folder for the socket; refuses a live one."""
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: left by a daemon that died
        else:
            raise SystemExit(f"kvd: another daemon is listening on {path}")
        finally:
            probe.close()


#: What the CUDA allocator must do for the cache to be exported by IPC handle:
#: allocate it as its own cudaMalloc segment (expandable segments map memory
#: otherwise and export it as file descriptors, which a sandboxed GPU machine
#: may refuse), with the native allocator (cudaMallocAsync memory has no IPC handle).
IPC_ALLOCATOR = {"expandable_segments": "False", "backend": "native"}
#: Where torch reads its allocator settings (the first wins; the second is the older name).
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def ipc_allocator_conf(preset: str | None) -> str:
    """``preset`` (an allocator setting such as ``max_split_size_mb:512``) with
    what :data:`IPC_ALLOCATOR` needs put in place of its own values."""
    kept = [entry for entry in (preset or "").split(",") if entry and entry.split(":")[0].strip() not in IPC_ALLOCATOR]
    return ",".join([*kept, *(f"{key}:{value}" for key, value in IPC_ALLOCATOR.items())])


def _force_ipc_allocator() -> None:
    """Sets the allocator up for the export, whatever the environment preset
    (before the first CUDA allocation reads it); says so when it changed a preset."""
    for name in ALLOCATOR_VARIABLES:
        preset = os.environ.get(name)
        if preset is None and name != "PYTORCH_CUDA_ALLOC_CONF":
            continue
        os.environ[name] = ipc_allocator_conf(preset)
        if preset is not None and preset != os.environ[name]:
            log.warning("CUDA allocator settings changed for the cache's IPC export",
                        extra={"variable": name, "preset": preset, "now": os.environ[name]})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    refuse_retired_variables("kvd")
    args = parse(COMMAND, argv)
    logs.configure(args.log_level)
    if args.device.startswith("cuda") or args.device == "auto":
        _force_ipc_allocator()
    from prometheus_client import start_http_server

    from kvd.daemon import Daemon
    from kvd.metrics import DaemonMetrics
    from kvd.service import build_server

    try:
        daemon = Daemon(config_from(DaemonConfig, args))
    except ValueError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    try:
        interceptors = _tcp_auth(args)
    except ValueError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    metrics = DaemonMetrics(daemon)
    server = build_server(daemon, metrics, interceptors=interceptors)
    _prepare_socket(args.socket)
    server.add_port(f"unix:{args.socket}")
    if args.listen:
        server.add_port(args.listen)
    server.start()
    os.chmod(args.socket, 0o600)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="127.0.0.1", registry=metrics.registry)
    log.info(
        "kvd serving",
        extra={"socket": args.socket, "tcp": args.listen or None, "metrics_port": args.metrics_port or None},
    )
    return _serve_until_signal(daemon, server)


def _tcp_auth(args: SimpleNamespace) -> tuple:
    """The token check of the TCP listener (none without one: the socket is 0600)."""
    from kvd.common.auth import TokenAuth, read_token

    if not args.listen:
        return ()
    if not args.token_file:
        raise ValueError("--listen needs --token-file: the TCP listener accepts only callers with the token")
    admin = read_token(args.admin_token_file, "admin token") if args.admin_token_file else None
    return (TokenAuth(read_token(args.token_file, "token"), admin),)


def _serve_until_signal(daemon, server) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    daemon.start()
    stop.wait()
    log.info("kvd stopping")
    server.stop(grace_s=2)
    daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
