"""Prometheus metrics of the daemon, read from its state at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvd.daemon import Daemon


class DaemonCollector:
    """Exports the pool's counters when scraped, so the hot path pays nothing."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self):
        s = self.daemon.stats()
        blocks = GaugeMetricFamily("kvd_blocks", "KV-cache blocks by state", labels=["state"])
        for state, value in (
            ("total", s.num_blocks),
            ("free", s.num_free_blocks),
            ("used", s.num_used_blocks),
            ("pinned", s.num_pinned_blocks),
            ("cached", s.num_cached_blocks),
        ):
            blocks.add_metric([state], value)
        yield blocks
        yield CounterMetricFamily(
            "kvd_prefix_cache_query_tokens", "Prompt tokens looked up at admission", s.query_tokens
        )
        yield CounterMetricFamily("kvd_prefix_cache_hit_tokens", "Prompt tokens served by the cache", s.hit_tokens)
        yield CounterMetricFamily("kvd_evictions", "Cached blocks evicted for reuse", s.evictions)
        yield from self._tiers(s)
        yield GaugeMetricFamily("kvd_sessions", "Attached engine sessions", s.num_sessions)
        yield GaugeMetricFamily("kvd_requests", "Requests holding blocks", s.num_requests)
        yield GaugeMetricFamily("kvd_pins", "Pins, named (templates) and expiring (cache marks)", s.num_pins)
        marks = CounterMetricFamily("kvd_cache_marks", "Cache marks reported, by outcome", labels=["outcome"])
        for outcome, value in zip(("pinned", "refused"), self.daemon.mark_counts(), strict=True):
            marks.add_metric([outcome], value)
        yield marks

    @staticmethod
    def _tiers(s):
        hits = CounterMetricFamily("kvd_tier_hit_tokens", "Prompt tokens served by the cache, by tier", labels=["tier"])
        hits.add_metric(["device"], s.hit_tokens - s.host_hit_tokens)
        hits.add_metric(["host"], s.host_hit_tokens - s.disk_hit_tokens)
        hits.add_metric(["disk"], s.disk_hit_tokens)
        yield hits
        host = GaugeMetricFamily("kvd_host_blocks", "Host-tier blocks by state", labels=["state"])
        for state, value in (
            ("total", s.num_host_blocks),
            ("free", s.num_host_free_blocks),
            ("cached", s.num_host_cached_blocks),
            ("being_read", s.num_host_blocks_read),
        ):
            host.add_metric([state], value)
        yield host
        yield GaugeMetricFamily(
            "kvd_copying_blocks", "Device blocks an outgoing copy still reads", s.num_copying_blocks
        )
        yield CounterMetricFamily("kvd_host_evictions", "Host-tier blocks evicted for reuse", s.host_evictions)
        copied = CounterMetricFamily("kvd_tier_copied_bytes", "Bytes copied between tiers", labels=["direction"])
        seconds = CounterMetricFamily(
            "kvd_tier_copy_seconds", "Submit-to-finish time of tier copy batches, summed", labels=["direction"]
        )
        batches = CounterMetricFamily("kvd_tier_copy_batches", "Tier copy batches finished", labels=["direction"])
        for direction, nbytes, secs, count in (
            ("to_host", s.bytes_to_host, s.copy_to_host_seconds, s.copy_batches_to_host),
            ("from_host", s.bytes_from_host, s.copy_from_host_seconds, s.copy_batches_from_host),
        ):
            copied.add_metric([direction], nbytes)
            seconds.add_metric([direction], secs)
            batches.add_metric([direction], count)
        copied.add_metric(["to_disk"], s.bytes_to_disk)
        copied.add_metric(["from_disk"], s.bytes_from_disk)
        seconds.add_metric(["from_disk"], s.disk_read_seconds)
        yield from (copied, seconds, batches)
        yield from _disk(s)


def _disk(s):
    """The disk tier's gauges and counters (zeros while it is off)."""
    yield GaugeMetricFamily("kvd_disk_blocks", "Disk-tier blocks of this cache's model and layout", s.num_disk_blocks)
    space = GaugeMetricFamily("kvd_disk_bytes", "Disk-tier bytes", labels=["kind"])
    space.add_metric(["used"], s.disk_used_bytes)
    space.add_metric(["budget"], s.disk_budget_bytes)
    yield space
    yield GaugeMetricFamily(
        "kvd_disk_writes_enabled", "1 while the disk tier writes; 0 after a write failed (or when off)",
        int(s.disk_writes_enabled),
    )  # fmt: skip
    for name, text, value in (
        ("kvd_disk_evictions", "Disk-tier blocks evicted for room", s.disk_evictions),
        ("kvd_disk_writes", "Blocks written to the disk tier", s.disk_writes),
        ("kvd_disk_writes_skipped", "Blocks not written: the writer's queue full or writes off", s.disk_writes_skipped),
        ("kvd_disk_write_errors", "Disk-tier writes that failed (disk full, I/O error)", s.disk_write_errors),
        ("kvd_disk_loads", "Blocks read back from the disk tier", s.disk_loads),
        ("kvd_disk_corrupt_blocks", "Torn or corrupt disk-tier files dropped (recomputed)", s.disk_corrupt_blocks),
    ):
        yield CounterMetricFamily(name, text, value)


class DaemonMetrics:
    """The registry served on the metrics port."""

    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(DaemonCollector(daemon))
        self.step_seconds = Histogram(
            "kvd_step_seconds",
            "Time to apply one Step (inside the daemon)",
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1),
            registry=self.registry,
        )
