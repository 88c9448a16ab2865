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
        yield GaugeMetricFamily("kvd_sessions", "Attached engine sessions", s.num_sessions)
        yield GaugeMetricFamily("kvd_requests", "Requests holding blocks", s.num_requests)


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
