"""`kvd`: runs the KV-cache daemon.

Every flag can also be set by an environment variable (for containers); the
variables are read here, once, and nowhere deeper.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

from kvd import logs

log = logging.getLogger("kvd")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '4096' -> 4096."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def default_socket() -> str:
    return f"/tmp/kvd-{os.getuid()}/kvd.sock"


def env_default(name: str, default):
    """A flag's default: its environment variable when set (read once, here)."""
    return os.environ.get(name, default)


# Variables no longer read, and what replaced them: a container started with
# one is refused rather than silently run with a default.
RETIRED_VARIABLES = {
    "KVD_DTYPE": (
        "KVD_DTYPE is no longer read: it meant the daemon's cache dtype and the engine's model dtype at once. "
        "Set KVD_CACHE_DTYPE (the daemon, with --num-layers) or KVD_MODEL_DTYPE (the engine) instead."
    ),
}


def refuse_retired_variables(prog: str) -> None:
    """Exits with status 2 and a message naming the replacement when a retired variable is set."""
    for name, message in RETIRED_VARIABLES.items():
        if name in os.environ:
            raise SystemExit(f"{prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd",
        description="The KV-cache daemon: owns the paged KV memory, block metadata and prefix hashes.",
        epilog="Each flag's environment variable is named in its help; a flag given on the command line wins.",
    )
    net = p.add_argument_group("listening")
    net.add_argument(
        "--socket", default=env_default("KVD_SOCKET", default_socket()), help="unix socket path (KVD_SOCKET)"
    )
    net.add_argument(
        "--listen",
        default=env_default("KVD_LISTEN", ""),
        help="also listen on TCP HOST:PORT, e.g. 0.0.0.0:50061 (KVD_LISTEN)",
    )
    net.add_argument(
        "--token-file",
        default=env_default("KVD_TOKEN_FILE", ""),
        help="a file with the token TCP callers must send (needed with --listen) (KVD_TOKEN_FILE)",
    )
    net.add_argument(
        "--admin-token-file",
        default=env_default("KVD_ADMIN_TOKEN_FILE", ""),
        help="a file with the token of Reset and InspectBlock on TCP; without it they are unix-socket only "
        "(KVD_ADMIN_TOKEN_FILE)",
    )
    net.add_argument(
        "--metrics-port",
        type=int,
        default=int(env_default("KVD_METRICS_PORT", 9401)),
        help="Prometheus metrics HTTP port, 0 for none (KVD_METRICS_PORT)",
    )
    cache = p.add_argument_group("cache")
    cache.add_argument(
        "--block-size", type=int, default=int(env_default("KVD_BLOCK_SIZE", 16)), help="(KVD_BLOCK_SIZE)"
    )
    cache.add_argument(
        "--num-blocks",
        type=int,
        default=int(env_default("KVD_NUM_BLOCKS", 0)),
        help="0: fill the memory budget (KVD_NUM_BLOCKS)",
    )
    cache.add_argument(
        "--memory-budget",
        type=parse_size,
        default=parse_size(env_default("KVD_MEMORY_BUDGET", "1GiB")),
        help="cache size when --num-blocks is 0 (KVD_MEMORY_BUDGET)",
    )
    cache.add_argument(
        "--device",
        default=env_default("KVD_DEVICE", "auto"),
        help="auto, cpu or cuda[:N] (KVD_DEVICE); auto picks cuda if present",
    )
    cache.add_argument(
        "--shm-dir", default=env_default("KVD_SHM_DIR", "/dev/shm"), help="shared-memory folder (KVD_SHM_DIR)"
    )
    cache.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=float(env_default("KVD_MAX_PINNED_FRACTION", 0.5)),
        help="share of blocks pins may hold (KVD_MAX_PINNED_FRACTION)",
    )
    cache.add_argument(
        "--lease-s",
        type=float,
        default=float(env_default("KVD_LEASE_S", 5.0)),
        help="release a session not heard from for this long (KVD_LEASE_S)",
    )
    cache.add_argument(
        "--quarantine-s",
        type=float,
        default=float(env_default("KVD_QUARANTINE_S", 30.0)),
        help="keep a lapsed session's blocks out of reuse this long when its engine's process "
        "cannot be seen from here (another container or host) (KVD_QUARANTINE_S)",
    )
    cache.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env_default("KVD_NO_PREFIX_CACHING", "") not in ("", "0"),
        help="never serve cache hits (KVD_NO_PREFIX_CACHING=1)",
    )
    tier = p.add_argument_group("host tier (offload to host memory; off by default)")
    tier.add_argument(
        "--host-num-blocks",
        type=int,
        default=int(env_default("KVD_HOST_NUM_BLOCKS", 0)),
        help="blocks in the host tier; 0: as many as --host-memory-budget holds (KVD_HOST_NUM_BLOCKS)",
    )
    tier.add_argument(
        "--host-memory-budget",
        type=parse_size,
        default=parse_size(env_default("KVD_HOST_MEMORY_BUDGET", "0")),
        help="host tier size when --host-num-blocks is 0, e.g. 8GiB; 0: no host tier (KVD_HOST_MEMORY_BUDGET)",
    )
    model = p.add_argument_group("layout (optional: otherwise the first engine's model decides)")
    model.add_argument("--num-layers", type=int, default=int(env_default("KVD_NUM_LAYERS", 0)), help="(KVD_NUM_LAYERS)")
    model.add_argument(
        "--num-kv-heads", type=int, default=int(env_default("KVD_NUM_KV_HEADS", 0)), help="(KVD_NUM_KV_HEADS)"
    )
    model.add_argument("--head-dim", type=int, default=int(env_default("KVD_HEAD_DIM", 0)), help="(KVD_HEAD_DIM)")
    model.add_argument(
        "--cache-dtype",
        default=env_default("KVD_CACHE_DTYPE", "float32"),
        help="the cache's dtype with --num-layers (KVD_CACHE_DTYPE); otherwise the first engine's model dtype",
    )
    p.add_argument("--log-level", default=env_default("KVD_LOG_LEVEL", "info"), help="(KVD_LOG_LEVEL)")
    return p


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _config_from_args(args: argparse.Namespace):
    from kvd.config import DaemonConfig
    from kvd.layout import CacheLayout

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


def main(argv: list[str] | None = None) -> int:
    refuse_retired_variables("kvd")
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    if args.device.startswith("cuda") or args.device == "auto":
        # NOTE: the exported cache must be its own cudaMalloc segment so its IPC
        # handle covers exactly it; expandable segments would map it differently.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    from prometheus_client import start_http_server

    from kvd.daemon import Daemon
    from kvd.metrics import DaemonMetrics
    from kvd.service import build_server

    try:
        daemon = Daemon(_config_from_args(args))
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


def _tcp_auth(args: argparse.Namespace) -> tuple:
    """The token check of the TCP listener (none without one: the socket is 0600)."""
    from kvd.auth import TokenAuth, read_token

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
