"""`kvd-gateway`: runs the public gateway, gRPC and HTTP (and manages its API keys).

    kvd-gateway [flags]                       serve
    kvd-gateway add-key --tenant T --scopes generate,templates:write
                                              make a key, store it in Redis, print it

Its settings are declared once, on the fields of ``GatewaySettings``
(``gateway/config.py``) where their values live, and add-key's own in
``ADD_KEY``: each flag with the environment variable that sets it (for
containers), read here, once, and nowhere deeper.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
import threading
from pathlib import Path

from gateway.config import GatewaySettings
from kvd.common import logs
from kvd.common.config_fields import config_from, setting_of, settings_of
from kvd.common.settings import Setting, SettingsCommand, log_level, parse

log = logging.getLogger("gateway")

COMMAND = SettingsCommand(
    "kvd-gateway",
    help="The public gRPC API of kvd: generation and named prefix templates in Redis. "
    "'kvd-gateway add-key --help': the command that makes an API key.",
    params=[*settings_of(GatewaySettings), log_level()],
)

ADD_KEY = SettingsCommand(
    "kvd-gateway add-key",
    help="Creates an API key kept in Redis and prints it (once).",
    params=[
        *(setting_of(GatewaySettings, name) for name in ("redis_url", "data_dir", "redis_prefix")),
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["add-key"]:
        return add_key(argv[1:])
    args = parse(COMMAND, argv)
    logs.configure(args.log_level)
    from gateway.app import GatewayApp

    try:
        settings = config_from(GatewaySettings, args)
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
