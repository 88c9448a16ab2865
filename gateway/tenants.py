"""Tenants: who is calling (API keys), what they may do (scopes) and how much
(limits), and the cache salt that keeps their blocks apart.

API keys travel in the gRPC metadata, or the HTTP header, as
``authorization: Bearer <key>``. Only their SHA-256 is kept, in one of two
stores:

- a JSON file (``--api-keys FILE``)::

      {"keys": [{"key_sha256": "9f86d0...", "tenant": "acme",
                 "scopes": ["generate", "templates:write"]},
                {"key": "dev-secret", "tenant": "dev", "scopes": ["generate"]}]}

  (``key`` in clear is accepted for development; it is hashed on load);
- Redis (``--api-keys redis``): a hash ``{prefix}apikey:{sha256 hex}`` with the
  fields ``tenant`` and ``scopes`` (comma-separated); ``kvd-gateway add-key``
  writes one.

NOTE: a key is never compared with a stored key: it is hashed and the digest
looked up, so how long a lookup takes depends on the digest, never on how much
of a guessed key matches (no timing oracle), and no key is ever logged.

Without a store the gateway runs in single-user mode: every call is the
tenant ``default`` with every scope.

Limits (``TenantLimits``): requests running at once, templates, pinned
blocks. Past a limit a call fails with RESOURCE_EXHAUSTED naming it
(``LimitExceeded``). 0 turns a limit off. Requests are counted by each
gateway (a tenant may run ``max_concurrent_requests`` on each); templates and
their pinned blocks are counted in Redis, by the create script, so the limits
hold across gateways.

NOTE: a template pins its block-aligned prefix on one replica; its pinned
blocks are ``token_count // block_size``. A per-tenant cap on them below the
daemons' pin cap keeps one tenant from pinning the whole cap away from others.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import click
import grpc
import redis

from gateway.request_errors import RequestError
from kvd.common.config_fields import setting

SCOPE_GENERATE = "generate"
SCOPE_TEMPLATES_WRITE = "templates:write"
SCOPES = frozenset({SCOPE_GENERATE, SCOPE_TEMPLATES_WRITE})
DEFAULT_TENANT = "default"
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    tenant: str
    scopes: frozenset[str]


def make_principal(tenant: str, scopes: list[str] | tuple[str, ...]) -> Principal:
    """Raises ``ValueError`` for a bad tenant name or an unknown scope."""
    if not TENANT.match(tenant):
        raise ValueError(f"tenant {tenant!r} is not allowed: use [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
    unknown = set(scopes) - SCOPES
    if unknown:
        raise ValueError(f"unknown scopes {sorted(unknown)}; known: {sorted(SCOPES)}")
    return Principal(tenant, frozenset(scopes))


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore(Protocol):
    def lookup(self, digest: str) -> Principal | None: ...


class FileKeys:
    """Keys from a JSON file, read once at start."""

    def __init__(self, path: Path) -> None:
        try:
            entries = json.loads(path.read_text())["keys"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read API keys from {path}: {exc}") from exc
        self.principals: dict[str, Principal] = {}
        for i, entry in enumerate(entries):
            try:
                digest = entry.get("key_sha256") or key_digest(entry["key"])
                self.principals[digest.lower()] = make_principal(entry["tenant"], entry.get("scopes", []))
            except (KeyError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}: key entry {i} is invalid: {exc}") from exc

    def lookup(self, digest: str) -> Principal | None:
        return self.principals.get(digest)


class RedisKeys:
    """Keys in Redis, looked up per call (so adding or revoking one needs no restart)."""

    def __init__(self, client: redis.Redis, prefix: str = "kvd:") -> None:
        self.redis = client
        self.prefix = prefix

    def _key(self, digest: str) -> str:
        return f"{self.prefix}apikey:{digest}"

    def lookup(self, digest: str) -> Principal | None:
        fields = self.redis.hgetall(self._key(digest))
        if not fields:
            return None
        scopes = [s for s in fields.get(b"scopes", b"").decode().split(",") if s]
        return make_principal(fields[b"tenant"].decode(), scopes)

    def add(self, key: str, tenant: str, scopes: list[str]) -> None:
        make_principal(tenant, scopes)  # validates
        self.redis.hset(self._key(key_digest(key)), mapping={"tenant": tenant, "scopes": ",".join(scopes)})

    def revoke(self, key: str) -> bool:
        return bool(self.redis.delete(self._key(key_digest(key))))


class Authenticator:
    """Checks a call's key and scope; ``keys=None`` is single-user mode."""

    def __init__(self, keys: KeyStore | None) -> None:
        self.keys = keys

    @property
    def single_user(self) -> bool:
        return self.keys is None

    def authorize(self, key: str | None, scope: str | None) -> Principal:
        """The caller of ``key`` (its bearer key; None: none was sent).

        Raises:
            RequestError: UNAUTHENTICATED without a known key, PERMISSION_DENIED
                without ``scope`` (None: any valid key will do), UNAVAILABLE
                when the keys cannot be read.
        """
        if self.keys is None:
            return Principal(DEFAULT_TENANT, SCOPES)
        if key is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing API key: send 'authorization: Bearer <key>'")
        try:
            principal = self.keys.lookup(key_digest(key))
        except (redis.ConnectionError, redis.TimeoutError):
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "Redis is unreachable: cannot check the API key") from None
        if principal is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        if scope is not None and scope not in principal.scopes:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"this API key lacks the scope {scope!r}")
        return principal


def bearer_key(authorizations: Iterable[object]) -> str | None:
    """The key of the first ``Bearer <key>`` among a call's ``authorization`` values."""
    for value in authorizations:
        if isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def tenant_salt(tenant: str, request_salt: bytes = b"") -> bytes:
    """The cache salt of a tenant's requests: no tenant ever hits another's
    blocks; a request's own salt isolates it further within its tenant."""
    return hashlib.sha256(b"kvd-tenant\0" + tenant.encode() + b"\0" + request_salt).digest()


# ------------------------------------------------------------------ limits


class LimitExceeded(Exception):
    """A tenant's limit would be passed (RESOURCE_EXHAUSTED)."""


_LIMITS = "per-tenant limits (0: none; past one, RESOURCE_EXHAUSTED naming it)"


@dataclass(frozen=True)
class TenantLimits:
    """Each tenant's limits: ``kvd-gateway``'s settings of the same names."""

    max_concurrent_requests: int = setting(
        "--max-concurrent-requests",
        env="KVD_MAX_CONCURRENT_REQUESTS",
        type=click.INT,
        default=0,
        section=_LIMITS,
        help="requests a tenant runs at once, per gateway",
    )
    max_templates: int = setting(
        "--max-templates",
        env="KVD_MAX_TEMPLATES",
        type=click.INT,
        default=0,
        section=_LIMITS,
        help="templates a tenant keeps",
    )
    max_pinned_blocks: int = setting(
        "--max-pinned-blocks",
        env="KVD_MAX_PINNED_BLOCKS",
        type=click.INT,
        default=0,
        section=_LIMITS,
        help="cache blocks a tenant's templates pin (a template pins token_count // block_size blocks); its"
        " cache breakpoints may pin as many again in each daemon",
    )

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_templates", "max_pinned_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")


class RequestSlots:
    """Requests each tenant has running through this gateway."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str) -> None:
        with self._lock:
            running = self._running.get(tenant, 0)
            if self.limit and running >= self.limit:
                raise LimitExceeded(
                    f"max_concurrent_requests: tenant {tenant!r} already runs {running} requests (the limit)"
                )
            self._running[tenant] = running + 1

    def give_back(self, tenant: str) -> None:
        with self._lock:
            left = self._running[tenant] - 1
            if left:
                self._running[tenant] = left
            else:
                del self._running[tenant]

    def running(self, tenant: str) -> int:
        with self._lock:
            return self._running.get(tenant, 0)
