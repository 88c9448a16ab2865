"""`kvd`: runs the KV-cache daemon.

Its settings are declared once, in ``COMMAND`` (see ``kvd.common.settings``): each
flag with the environment variable that sets it (for containers), read here,
once, into a ``DaemonConfig``, and nowhere deeper.
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
from kvd.common.settings import (
    SIZE,
    SOCKET,
    Setting,
    SettingsCommand,
    log_level,
    parse,
    refuse_retired_variables,
)

log = logging.getLogger("kvd")

_LISTENING = "listening"
_CACHE = "cache"
_HOST_TIER = "host tier (offload to host memory; off by default)"
_DISK_TIER = "disk tier (blocks kept on disk across restarts; off by default, needs the host tier)"
_LAYOUT = "layout (optional: otherwise the first engine's model decides)"

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
        Setting(
            "--block-size", env="KVD_BLOCK_SIZE", type=click.INT, default=16, section=_CACHE, help="tokens per block"
        ),
        Setting(
            "--num-blocks",
            env="KVD_NUM_BLOCKS",
            type=click.INT,
            default=0,
            section=_CACHE,
            help="blocks in the cache; 0: fill the memory budget",
        ),
        Setting(
            "--memory-budget",
            env="KVD_MEMORY_BUDGET",
            type=SIZE,
            default="1GiB",
            section=_CACHE,
            help="cache size when --num-blocks is 0 (on CPU a file in --shm-dir, which must have room for it)",
        ),
        Setting(
            "--device",
            env="KVD_DEVICE",
            default="auto",
            section=_CACHE,
            help="auto, cpu (a shared-memory file) or cuda[:N] (one allocation exported by CUDA IPC handle); "
            "auto picks cuda if present",
        ),
        Setting("--shm-dir", env="KVD_SHM_DIR", default="/dev/shm", section=_CACHE, help="shared-memory folder"),
        Setting(
            "--max-pinned-fraction",
            env="KVD_MAX_PINNED_FRACTION",
            type=click.FLOAT,
            default=0.5,
            section=_CACHE,
            help="share of blocks pins may hold (past it, RESOURCE_EXHAUSTED)",
        ),
        Setting(
            "--lease-s",
            env="KVD_LEASE_S",
            type=click.FLOAT,
            default=5.0,
            section=_CACHE,
            help="release a session not heard from for this long",
        ),
        Setting(
            "--quarantine-s",
            env="KVD_QUARANTINE_S",
            type=click.FLOAT,
            default=30.0,
            section=_CACHE,
            help="keep a lapsed session's blocks out of reuse this long when its engine's process "
            "cannot be seen from here (another container or host)",
        ),
        Setting(
            "--no-prefix-caching",
            env="KVD_NO_PREFIX_CACHING",
            is_flag=True,
            default=False,
            section=_CACHE,
            help="never serve cache hits",
        ),
        Setting(
            "--host-num-blocks",
            env="KVD_HOST_NUM_BLOCKS",
            type=click.INT,
            default=0,
            section=_HOST_TIER,
            help="blocks in the host tier; 0: as many as --host-memory-budget holds",
        ),
        Setting(
            "--host-memory-budget",
            env="KVD_HOST_MEMORY_BUDGET",
            type=SIZE,
            default="0",
            section=_HOST_TIER,
            help="host tier size when --host-num-blocks is 0, e.g. 8GiB; 0: no host tier",
        ),
        Setting(
            "--disk-path",
            env="KVD_DISK_PATH",
            section=_DISK_TIER,
            help="the disk tier's folder: blocks entering the host tier are written here and served again after "
            "a restart, under a folder per model and layout; empty: no disk tier",
        ),
        Setting(
            "--disk-budget",
            env="KVD_DISK_BUDGET",
            type=SIZE,
            default="8GiB",
            section=_DISK_TIER,
            help="what the disk tier's files may take together (least recently used evicted first, other "
            "models' and layouts' before any)",
        ),
        Setting(
            "--disk-remove-others",
            env="KVD_DISK_REMOVE_OTHERS",
            is_flag=True,
            default=False,
            section=_DISK_TIER,
            help="at start, delete the blocks of other models, layouts and formats under --disk-path",
        ),
        Setting(
            "--num-layers",
            env="KVD_NUM_LAYERS",
            type=click.INT,
            default=0,
            section=_LAYOUT,
            help="create the cache at start with this many layers (and the three below); 0: at the first attach",
        ),
        Setting("--num-kv-heads", env="KVD_NUM_KV_HEADS", type=click.INT, default=0, section=_LAYOUT, help="KV heads"),
        Setting("--head-dim", env="KVD_HEAD_DIM", type=click.INT, default=0, section=_LAYOUT, help="head dimension"),
        Setting(
            "--cache-dtype",
            env="KVD_CACHE_DTYPE",
            default="float32",
            section=_LAYOUT,
            help="the cache's dtype with --num-layers; otherwise the first engine's model dtype",
        ),
        log_level(),
    ],
)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def config_from(args: SimpleNamespace):
    """The daemon's config from its settings' values (ValueError: an invalid combination)."""
    from kvd.common.layout import CacheLayout
    from kvd.config import DaemonConfig

    layout = None
    if args.num_layers or args.num_kv_heads or args.head_dim:
        layout = CacheLayout(args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.cache_dtype)
    return DaemonConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        memory_budget_bytes=args.memory_budget,
        device=_resolve_device(args.device),
        shm_dir=args.shm_dir,
        max_pinned_fraction=args.max_pinned_fraction,
        lease_s=args.lease_s,
        quarantine_s=args.quarantine_s,
        enable_caching=not args.no_prefix_caching,
        model_layout=layout,
        host_num_blocks=args.host_num_blocks,
        host_memory_budget_bytes=args.host_memory_budget,
        disk_path=args.disk_path,
        disk_budget_bytes=args.disk_budget,
        disk_remove_others=args.disk_remove_others,
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
        daemon = Daemon(config_from(args))
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
