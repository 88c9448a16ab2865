"""Per-tenant limits: requests running at once, templates, pinned blocks.

Past a limit a call fails with RESOURCE_EXHAUSTED naming it (``LimitExceeded``).
0 turns a limit off. Requests are counted by each gateway (a tenant may run
``max_concurrent_requests`` on each); templates and their pinned blocks are
counted in Redis, by the create script, so the limits hold across gateways.

NOTE: a template pins its block-aligned prefix on one replica; its pinned
blocks are ``token_count // block_size``. A per-tenant cap on them below the
daemons' pin cap keeps one tenant from pinning the whole cap away from others.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class LimitExceeded(Exception):
    """A tenant's limit would be passed (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class TenantLimits:
    max_concurrent_requests: int = 0
    max_templates: int = 0
    max_pinned_blocks: int = 0

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
