"""The gateway's Redis: a server by URL, or an embedded one in the data directory."""

from __future__ import annotations

from pathlib import Path

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from gateway.embedded_redis import EmbeddedRedis

# Short timeouts: a Redis that is down must turn into UNAVAILABLE quickly,
# not into a client-side deadline.
SOCKET_TIMEOUT_S = 2.0


def restart_bridge() -> Retry:
    """Retries of a command whose connection was refused or cut, for ~1.8 s in
    all: a Redis restarting (from its AOF, in well under a second) costs a
    templated request a short wait, not an UNAVAILABLE. A Redis that does not
    answer (a timeout) is not retried: that would hold requests for seconds."""
    return Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=6, supported_errors=(redis.ConnectionError,))


def connect(url: str, data_dir: Path) -> tuple[redis.Redis, EmbeddedRedis | None]:
    """A client of ``url``; without one, of an embedded real Redis persisting to
    ``data_dir`` (see ``gateway.embedded_redis``), returned too: the caller stops it.
    """
    if url:
        client = redis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S, retry=restart_bridge()
        )
        return client, None
    embedded = EmbeddedRedis(data_dir)
    return embedded.start(), embedded


def describe(client: redis.Redis) -> str:
    """Where a client points, for logs (never with a password)."""
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
