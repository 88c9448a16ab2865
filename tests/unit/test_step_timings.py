"""The engine loop's stopwatch and the Prometheus families it is read through."""

from __future__ import annotations

from prometheus_client import generate_latest

from inference.metrics import engine_registry
from inference.step_timings import StepTimings


def test_laps_are_charged_to_their_phase_and_kind():
    t = StepTimings()
    t.begin()
    t.lap("step_rpc")
    t.add("attention", 0.25)
    t.end("decode", tokens=16)
    t.begin()
    t.add("forward", 1.0)
    t.end("mixed", tokens=300)
    assert t.steps == {"decode": 1, "mixed": 1, "none": 0}
    assert t.tokens["decode"] == 16 and t.tokens["mixed"] == 300
    assert t.seconds["decode"]["attention"] == 0.25 and t.seconds["mixed"]["attention"] == 0.0
    assert t.seconds["mixed"]["forward"] == 1.0 and t.seconds["decode"]["forward"] == 0.0
    assert t.seconds["decode"]["step_rpc"] >= 0.0


def test_the_metrics_port_exports_the_sums():
    t = StepTimings()
    t.begin()
    t.add("forward", 0.5)
    t.end("decode", tokens=4)
    t.idle_s, t.stream_s = 2.0, 0.125
    text = generate_latest(engine_registry(t)).decode()
    assert 'kvd_engine_step_seconds_total{kind="decode",phase="forward"} 0.5' in text
    assert 'kvd_engine_steps_total{kind="decode"} 1.0' in text
    assert 'kvd_engine_step_tokens_total{kind="decode"} 4.0' in text
    assert "kvd_engine_idle_seconds_total 2.0" in text
    assert "kvd_engine_stream_seconds_total 0.125" in text


def test_a_step_cut_short_charges_nothing_to_the_next():
    t = StepTimings()
    t.begin()
    t.add("step_rpc", 5.0)  # the Step call raised: no end()
    t.begin()
    t.add("forward", 0.5)
    t.end("decode", tokens=1)
    assert t.seconds["decode"]["step_rpc"] == 0.0 and t.seconds["decode"]["forward"] == 0.5
