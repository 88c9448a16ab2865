"""`kvd-gateway`: runs the public gateway, gRPC and HTTP (and manages its API keys).

    kvd-gateway [flags]                       serve
    kvd-gateway add-key --tenant T --scopes generate,templates:write
                                              make a key, store it in Redis, print it

Its settings are declared once, in ``COMMAND`` and ``ADD_KEY`` (see
``kvd.common.settings``): each flag with the environment variable that sets it (for
containers), read here, once, into ``GatewaySettings``, and nowhere deeper.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import click

from gateway.router import POLICIES
from kvd.common import logs
from kvd.common.settings import Setting, SettingsCommand, log_level, parse

log = logging.getLogger("gateway")

_ROUTING = "routing across replicas"
_LIMITS = "per-tenant limits (0: none; past one, RESOURCE_EXHAUSTED naming it)"

#: Where templates and keys are kept: the server's and add-key's.
REDIS = (
    Setting("--redis-url", env="KVD_REDIS_URL", help="redis://HOST:PORT/DB; empty: an embedded Redis in --data-dir"),
    Setting(
        "--data-dir", env="KVD_DATA_DIR", help="where the embedded Redis keeps its files; empty: ~/.local/share/kvd"
    ),
    Setting("--redis-prefix", env="KVD_REDIS_PREFIX", default="kvd:", help="prefix of every Redis key"),
)

#: The HTTP API's address: the server's and kvd-serve's (which passes it on and prints it).
HTTP_LISTEN = Setting(
    "--http-listen",
    env="KVD_HTTP_LISTEN",
    default="127.0.0.1:8000",
    help="the OpenAI-compatible HTTP API's address (docs/gateway.md); empty: no HTTP API",
)

COMMAND = SettingsCommand(
    "kvd-gateway",
    help="The public gRPC API of kvd: generation and named prefix templates in Redis. "
    "'kvd-gateway add-key --help': the command that makes an API key.",
    params=[
        Setting("--listen", env="KVD_GATEWAY_ADDR", default="127.0.0.1:50051", help="gRPC address"),
        HTTP_LISTEN,
        Setting(
            "--max-open-requests",
            env="KVD_GATEWAY_MAX_OPEN_REQUESTS",
            type=click.INT,
            default=512,
            help="generations the gateway holds at once (gRPC Generate and Complete, HTTP completions), all"
            " tenants together; past it one is refused with RESOURCE_EXHAUSTED (HTTP 429)",
        ),
        Setting(
            "--engines",
            "--engine",
            "engines",
            env="KVD_ENGINES",
            default="127.0.0.1:50052",
            help="engine replicas, comma-separated HOST:PORT; dns:NAME:PORT stands for every address NAME resolves to",
        ),
        *REDIS,
        Setting(
            "--api-keys", env="KVD_API_KEYS", help="a JSON keys file, or 'redis'; empty: single-user mode, no keys"
        ),
        Setting("--tls-cert", env="KVD_TLS_CERT", help="PEM certificate chain (with --tls-key)"),
        Setting("--tls-key", env="KVD_TLS_KEY", help="PEM private key (with --tls-cert)"),
        Setting(
            "--keeper-interval-s",
            env="KVD_KEEPER_INTERVAL_S",
            type=click.FLOAT,
            default=1.0,
            help="how often expired templates are unpinned and templates placed again on replicas whose cache is new"
            " or that left",
        ),
        Setting(
            "--routing",
            env="KVD_ROUTING",
            type=click.Choice(POLICIES),
            default="cost",
            section=_ROUTING,
            help="how a request picks a replica: cost (the least estimated time to first token, from the blocks each"
            " replica holds and the prefill work queued there), affinity (its template, else its prompt's leading"
            " blocks, bounded by load) or round-robin",
        ),
        Setting(
            "--route-work-weight",
            env="KVD_ROUTE_WORK_WEIGHT",
            type=click.FLOAT,
            default=4.0,
            section=_ROUTING,
            help="cost routing: the least the request's own uncached tokens weigh against work queued on a replica"
            " (1: the plain TTFT estimate; more keeps conversations on their replica; long queues fleet-wide raise"
            " it)",
        ),
        Setting(
            "--route-load-factor",
            env="KVD_ROUTE_LOAD_FACTOR",
            type=click.FLOAT,
            default=1.5,
            section=_ROUTING,
            help="affinity routing: a target running more than FACTOR x the mean load + SLACK requests spills to the"
            " least loaded replica",
        ),
        Setting(
            "--route-load-slack",
            env="KVD_ROUTE_LOAD_SLACK",
            type=click.FLOAT,
            default=2.0,
            section=_ROUTING,
            help="see --route-load-factor",
        ),
        Setting(
            "--health-interval-s",
            env="KVD_HEALTH_INTERVAL_S",
            type=click.FLOAT,
            default=0.5,
            section=_ROUTING,
            help="how often each replica's gRPC health is checked",
        ),
        Setting(
            "--replica-wait-s",
            env="KVD_REPLICA_WAIT_S",
            type=click.FLOAT,
            default=30.0,
            section=_ROUTING,
            help="how long a request waits for a replica to serve when none does (or every one refused it before"
            " its first token) but one served in the last SECONDS: a drain or a restart under way; never past the"
            " request's deadline; 0: no wait",
        ),
        Setting(
            "--dns-interval-s",
            env="KVD_DNS_INTERVAL_S",
            type=click.FLOAT,
            default=5.0,
            section=_ROUTING,
            help="how often dns: entries of --engines are resolved again",
        ),
        Setting(
            "--max-concurrent-requests",
            env="KVD_MAX_CONCURRENT_REQUESTS",
            type=click.INT,
            default=0,
            section=_LIMITS,
            help="requests a tenant runs at once, per gateway",
        ),
        Setting(
            "--max-templates",
            env="KVD_MAX_TEMPLATES",
            type=click.INT,
            default=0,
            section=_LIMITS,
            help="templates a tenant keeps",
        ),
        Setting(
            "--max-pinned-blocks",
            env="KVD_MAX_PINNED_BLOCKS",
            type=click.INT,
            default=0,
            section=_LIMITS,
            help="cache blocks a tenant's templates pin (a template pins token_count // block_size blocks)",
        ),
        log_level(),
    ],
)

ADD_KEY = SettingsCommand(
    "kvd-gateway add-key",
    help="Creates an API key kept in Redis and prints it (once).",
    params=[
        *REDIS,
        Setting("--tenant", required=True, help="the tenant the key acts for"),
        Setting("--scopes", default="generate,templates:write", help="comma-separated"),
    ],
)


def add_key(argv: list[str]) -> int:
    from gateway import redis_conn
    from gateway.app import default_data_dir
    from gateway.tenants import RedisKeys

    args = parse(ADD_KEY, argv)
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


def config_from(args: SimpleNamespace):
    """The gateway's settings from its flags' values (ValueError: invalid)."""
    from gateway.app import GatewaySettings
    from gateway.router import RouterConfig
    from gateway.tenants import TenantLimits

    return GatewaySettings(
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
        replica_wait_s=args.replica_wait_s,
        limits=TenantLimits(args.max_concurrent_requests, args.max_templates, args.max_pinned_blocks),
        http_listen=args.http_listen,
        max_open_requests=args.max_open_requests,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["add-key"]:
        return add_key(argv[1:])
    args = parse(COMMAND, argv)
    logs.configure(args.log_level)
    from gateway.app import GatewayApp

    try:
        settings = config_from(args)
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
