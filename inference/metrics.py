"""Prometheus metrics of the engine, read from its step timings at scrape time.

``kvd-engine --metrics-port P`` serves them on 127.0.0.1:P. The loop only
adds floats (``inference.step_timings``); the families are built here when
scraped, so the hot path pays nothing for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from inference.step_timings import KINDS, PHASES, StepTimings


class StepTimingsCollector:
    def __init__(self, timings: StepTimings) -> None:
        self.timings = timings

    def collect(self):
        t = self.timings
        seconds = CounterMetricFamily(
            "kvd_engine_step_seconds",
            "Engine loop seconds by kind of step (decode, mixed, none) and phase (inference/step_timings.py)",
            labels=["kind", "phase"],
        )
        steps = CounterMetricFamily("kvd_engine_steps", "Engine steps by kind", labels=["kind"])
        tokens = CounterMetricFamily("kvd_engine_step_tokens", "Tokens the forwards computed, by kind", labels=["kind"])
        for kind in KINDS:
            for phase in PHASES:
                seconds.add_metric([kind, phase], t.seconds[kind][phase])
            steps.add_metric([kind], t.steps[kind])
            tokens.add_metric([kind], t.tokens[kind])
        yield from (seconds, steps, tokens)
        yield CounterMetricFamily("kvd_engine_idle_seconds", "Engine loop seconds waiting for work", t.idle_s)
        yield CounterMetricFamily(
            "kvd_engine_stream_seconds", "Stream-thread seconds turning sampled tokens into messages", t.stream_s
        )


def engine_registry(timings: StepTimings) -> CollectorRegistry:
    """The registry served on the engine's metrics port."""
    registry = CollectorRegistry()
    registry.register(StepTimingsCollector(timings))
    return registry
