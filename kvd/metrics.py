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

    @staticmethod
    def _tiers(s):
        hits = CounterMetricFamily("kvd_tier_hit_tokens", "Prompt tokens served by the cache, by tier", labels=["tier"])
        hits.add_metric(["device"], s.hit_tokens - s.host_hit_tokens)
        hits.add_metric(["host"], s.host_hit_tokens)
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
        yield from (copied, seconds, batches)


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
