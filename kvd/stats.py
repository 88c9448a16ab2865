"""The daemon's counters, gathered in one snapshot (``Stats`` RPC, metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.cache import KVCache
from kvd.quarantine import Quarantine
from kvd.session import SessionRegistry


@dataclass(frozen=True)
class Stats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_cached_blocks: int
    max_pinned_blocks: int
    evictions: int
    query_tokens: int
    hit_tokens: int
    num_sessions: int
    num_requests: int
    num_pins: int
    num_host_blocks: int = 0
    num_host_free_blocks: int = 0
    num_host_cached_blocks: int = 0
    num_copying_blocks: int = 0
    num_host_blocks_read: int = 0
    host_hit_tokens: int = 0
    host_evictions: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    copy_to_host_seconds: float = 0.0
    copy_from_host_seconds: float = 0.0
    copy_batches_to_host: int = 0
    copy_batches_from_host: int = 0
    num_quarantined_sessions: int = 0
    num_quarantined_blocks: int = 0
    num_disk_blocks: int = 0
    disk_used_bytes: int = 0
    disk_budget_bytes: int = 0
    disk_hit_tokens: int = 0
    disk_evictions: int = 0
    disk_writes: int = 0
    disk_writes_skipped: int = 0
    disk_write_errors: int = 0
    disk_writes_enabled: bool = False
    disk_loads: int = 0
    disk_corrupt_blocks: int = 0
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    disk_read_seconds: float = 0.0
    disk_index_rebuild_seconds: float = 0.0


def collect_stats(cache: KVCache | None, sessions: SessionRegistry, quarantine: Quarantine) -> Stats:
    """A snapshot of the cache (zeros before it exists) and the sessions. Under the daemon's lock."""
    sessions_part = {
        "num_sessions": len(sessions.sessions),
        "num_requests": sessions.num_requests,
        "num_quarantined_sessions": quarantine.num_sessions,
        "num_quarantined_blocks": quarantine.num_blocks,
    }
    if cache is None:
        return Stats(
            num_blocks=0, num_free_blocks=0, num_used_blocks=0, num_pinned_blocks=0, num_cached_blocks=0,
            max_pinned_blocks=0, evictions=0, query_tokens=0, hit_tokens=0, num_pins=0, **sessions_part,
        )  # fmt: skip
    pool, manager, pins = cache.pool, cache.manager, cache.pins
    return Stats(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free,
        num_used_blocks=pool.num_blocks - pool.num_free,
        num_pinned_blocks=pins.num_pinned_blocks,
        num_cached_blocks=len(pool.cached),
        max_pinned_blocks=pins.max_pinned_blocks,
        evictions=pool.num_evictions,
        query_tokens=manager.query_tokens,
        hit_tokens=manager.hit_tokens,
        num_pins=pins.num_pins,
        **sessions_part,
        **_tier_stats(cache),
        **_disk_stats(cache),
    )


def _tier_stats(cache: KVCache) -> dict[str, int | float]:
    host, copier = cache.host, cache.copier
    if host is None or copier is None:
        return {}
    c = copier.stats
    return {
        "num_host_blocks": host.num_slots,
        "num_host_free_blocks": host.num_free,
        "num_host_cached_blocks": len(host.cached),
        "num_copying_blocks": cache.pool.num_copying,
        "num_host_blocks_read": host.num_read,
        "host_hit_tokens": cache.manager.host_hit_tokens,
        "host_evictions": host.num_evictions,
        "bytes_to_host": c.bytes_to_host,
        "bytes_from_host": c.bytes_from_host,
        "copy_to_host_seconds": c.seconds_to_host,
        "copy_from_host_seconds": c.seconds_from_host,
        "copy_batches_to_host": c.batches_to_host,
        "copy_batches_from_host": c.batches_from_host,
    }


def _disk_stats(cache: KVCache) -> dict[str, int | float | bool]:
    disk = cache.disk
    if disk is None:
        return {}
    store, c = disk.store, disk.counters
    return {
        "num_disk_blocks": len(store),
        "disk_used_bytes": store.used_bytes,
        "disk_budget_bytes": store.budget_bytes,
        "disk_hit_tokens": cache.manager.disk_hit_tokens,
        "disk_evictions": store.num_evictions,
        "disk_writes": c.writes,
        "disk_writes_skipped": c.writes_skipped,
        "disk_write_errors": c.write_errors,
        "disk_writes_enabled": disk.writes_enabled,
        "disk_loads": c.loads,
        "disk_corrupt_blocks": store.num_corrupt,
        "bytes_to_disk": store.bytes_written,
        "bytes_from_disk": store.bytes_read,
        "disk_read_seconds": store.seconds_reading,
        "disk_index_rebuild_seconds": store.rebuild_seconds,
    }
