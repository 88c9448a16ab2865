"""`kvd-gateway`: runs the public gRPC gateway (and manages its API keys).

    kvd-gateway [flags]                       serve
    kvd-gateway add-key --tenant T --scopes generate,templates:write
                                              make a key, store it in Redis, print it

Every flag can also be set by an environment variable (for containers); the
variables are read here, once, and nowhere deeper.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import threading
from pathlib import Path

from gateway.router import POLICIES
from kvd import logs
from kvd.cli import env_default

log = logging.getLogger("gateway")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-url",
        default=env_default("KVD_REDIS_URL", ""),
        help="redis://HOST:PORT/DB; empty: an embedded Redis in --data-dir (KVD_REDIS_URL)",
    )
    p.add_argument(
        "--data-dir",
        default=env_default("KVD_DATA_DIR", ""),
        help="where the embedded Redis keeps its files; default ~/.local/share/kvd (KVD_DATA_DIR)",
    )
    p.add_argument(
        "--redis-prefix",
        default=env_default("KVD_REDIS_PREFIX", "kvd:"),
        help="prefix of every Redis key (KVD_REDIS_PREFIX)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd-gateway",
        description="The public gRPC API of kvd: generation and named prefix templates in Redis.",
        epilog="Each flag's environment variable is named in its help; a flag given on the command line wins.",
    )
    p.add_argument("--listen", default=env_default("KVD_GATEWAY_ADDR", "127.0.0.1:50051"), help="(KVD_GATEWAY_ADDR)")
    p.add_argument(
        "--engines",
        "--engine",
        dest="engines",
        default=env_default("KVD_ENGINES", "127.0.0.1:50052"),
        help="engine replicas, comma-separated HOST:PORT; dns:NAME:PORT stands for every address NAME resolves to"
        " (KVD_ENGINES)",
    )
    _common(p)
    p.add_argument(
        "--api-keys",
        default=env_default("KVD_API_KEYS", ""),
        help="a JSON keys file, or 'redis'; empty: single-user mode, no keys (KVD_API_KEYS)",
    )
    p.add_argument("--tls-cert", default=env_default("KVD_TLS_CERT", ""), help="PEM certificate chain (KVD_TLS_CERT)")
    p.add_argument("--tls-key", default=env_default("KVD_TLS_KEY", ""), help="PEM private key (KVD_TLS_KEY)")
    p.add_argument(
        "--keeper-interval-s",
        type=float,
        default=float(env_default("KVD_KEEPER_INTERVAL_S", 1.0)),
        help="how often expired templates are unpinned and templates placed again on replicas whose cache is new"
        " or that left (KVD_KEEPER_INTERVAL_S)",
    )
    p.add_argument(
        "--routing",
        choices=POLICIES,
        default=env_default("KVD_ROUTING", "cost"),
        help="how a request picks a replica: cost (the least estimated time to first token, from the blocks each"
        " replica holds and the prefill work queued there), affinity (its template, else its prompt's leading"
        " blocks, bounded by load) or round-robin (KVD_ROUTING)",
    )
    p.add_argument(
        "--route-work-weight",
        type=float,
        default=float(env_default("KVD_ROUTE_WORK_WEIGHT", 4.0)),
        help="cost routing: the least the request's own uncached tokens weigh against work queued on a replica"
        " (1: the plain TTFT estimate; more keeps conversations on their replica; long queues fleet-wide raise"
        " it) (KVD_ROUTE_WORK_WEIGHT)",
    )
    p.add_argument(
        "--route-load-factor",
        type=float,
        default=float(env_default("KVD_ROUTE_LOAD_FACTOR", 1.5)),
        help="an affinity target running more than FACTOR x the mean load + SLACK requests spills to the least"
        " loaded replica (KVD_ROUTE_LOAD_FACTOR)",
    )
    p.add_argument(
        "--route-load-slack",
        type=float,
        default=float(env_default("KVD_ROUTE_LOAD_SLACK", 2.0)),
        help="see --route-load-factor (KVD_ROUTE_LOAD_SLACK)",
    )
    p.add_argument(
        "--health-interval-s",
        type=float,
        default=float(env_default("KVD_HEALTH_INTERVAL_S", 0.5)),
        help="how often each replica's gRPC health is checked (KVD_HEALTH_INTERVAL_S)",
    )
    p.add_argument(
        "--dns-interval-s",
        type=float,
        default=float(env_default("KVD_DNS_INTERVAL_S", 5.0)),
        help="how often dns: entries of --engines are resolved again (KVD_DNS_INTERVAL_S)",
    )
    limits = p.add_argument_group("per-tenant limits (0: none; past one, RESOURCE_EXHAUSTED naming it)")
    for flag, env, what in (
        ("--max-concurrent-requests", "KVD_MAX_CONCURRENT_REQUESTS", "requests a tenant runs at once, per gateway"),
        ("--max-templates", "KVD_MAX_TEMPLATES", "templates a tenant keeps"),
        ("--max-pinned-blocks", "KVD_MAX_PINNED_BLOCKS", "cache blocks a tenant's templates pin"),
    ):
        limits.add_argument(flag, type=int, default=int(env_default(env, 0)), help=f"{what} ({env})")
    p.add_argument("--log-level", default=env_default("KVD_LOG_LEVEL", "info"), help="(KVD_LOG_LEVEL)")
    return p


def build_key_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd-gateway add-key", description="Creates an API key kept in Redis.")
    _common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("--scopes", default="generate,templates:write", help="comma-separated")
    return p


def add_key(argv: list[str]) -> int:
    from gateway import redis_conn
    from gateway.app import default_data_dir
    from gateway.tenants import RedisKeys

    args = build_key_parser().parse_args(argv)
    client, embedded = redis_conn.connect(args.redis_url, Path(args.data_dir) if args.data_dir else default_data_dir())
    key = "kvd-" + secrets.token_urlsafe(24)
    try:
        RedisKeys(client, args.redis_prefix).add(key, args.tenant, [s for s in args.scopes.split(",") if s])
    except ValueError as exc:
        print(f"kvd-gateway: {exc}", file=sys.stderr)
        return 2
    finally:
        if embedded is not None:
            embedded.stop()
    print(key)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["add-key"]:
        return add_key(argv[1:])
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    from gateway.app import GatewayApp, GatewaySettings
    from gateway.router import RouterConfig
    from gateway.tenants import TenantLimits

    try:
        settings = GatewaySettings(
            listen=args.listen,
            engines=[e.strip() for e in args.engines.split(",") if e.strip()],
            redis_url=args.redis_url,
            data_dir=Path(args.data_dir) if args.data_dir else None,
            redis_prefix=args.redis_prefix,
            api_keys=args.api_keys,
            tls_cert=Path(args.tls_cert) if args.tls_cert else None,
            tls_key=Path(args.tls_key) if args.tls_key else None,
            keeper_interval_s=args.keeper_interval_s,
            routing=RouterConfig(
                args.routing, args.route_load_factor, args.route_load_slack, work_weight=args.route_work_weight
            ),
            health_interval_s=args.health_interval_s,
            dns_interval_s=args.dns_interval_s,
            limits=TenantLimits(args.max_concurrent_requests, args.max_templates, args.max_pinned_blocks),
        )
        app = GatewayApp(settings)
    except (ValueError, OSError) as exc:
        print(f"kvd-gateway: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    app.start()
    while not stop.wait(0.5):
        pass
    log.info("gateway stopping")
    app.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
