"""Where the engine loop's time goes, summed per kind of step and per phase.

The loop laps a stopwatch between its phases (a few ``perf_counter`` calls a
step, nothing allocated); ``inference.metrics`` exports the sums to
Prometheus at scrape time, and ``benchmarks/vs_vllm.py`` reads them around a
workload to say what one decode step costs, phase by phase.

A step's kind is its forward's: ``decode`` when every chunk is one token,
``mixed`` when a prefill chunk is in it, ``none`` when it launched no forward
(it only read the last one's results). Its phases:

- ``schedule``: the Step message built, the last unwaited forward waited for;
- ``step_rpc``: the daemon's Step call, round trip;
- ``apply``: its reply applied to the request table;
- ``sample``: the last forward's sampling (on a GPU it waits for that forward);
- ``results``: the sampled tokens appended, finished sequences ended, their
  entries handed to the stream thread;
- ``prepare``: the step's inputs built and copied to the device;
- ``forward``: the model run (on a GPU: its launch only);
- ``attention``: the part of ``forward`` spent in the paged attention calls
  (timed only where the forward is synchronous, the CPU).

Outside the steps: ``idle_s``, the loop waiting for work; ``stream_s``, the
stream thread's text work (detokenizing, stop strings), which competes with
the loop for the cores.
"""

from __future__ import annotations

import time

PHASES = ("schedule", "step_rpc", "apply", "sample", "results", "prepare", "forward", "attention")
KINDS = ("decode", "mixed", "none")
_NO_TIME = dict.fromkeys(PHASES, 0.0)


class StepTimings:
    """Seconds per kind of step and phase, steps per kind, and the loop's idle
    time. Written by the engine loop alone (the stream thread adds to
    ``stream_s`` only); read by a scrape, which may see a step half-added."""

    __slots__ = ("_lap_start", "_step", "idle_s", "seconds", "steps", "stream_s", "tokens")

    def __init__(self) -> None:
        self.seconds = {kind: dict.fromkeys(PHASES, 0.0) for kind in KINDS}
        self.steps = dict.fromkeys(KINDS, 0)
        self.tokens = dict.fromkeys(KINDS, 0)  # tokens the forwards computed
        self.idle_s = 0.0
        self.stream_s = 0.0
        self._step = dict.fromkeys(PHASES, 0.0)
        self._lap_start = 0.0

    def begin(self) -> None:
        """Starts a step's stopwatch (what a step cut short by an error lapped is dropped)."""
        self._step.update(_NO_TIME)  # zeroed in place: the loop allocates nothing a step
        self._lap_start = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charges the time since the last lap (or ``begin``) to ``phase``."""
        now = time.perf_counter()
        self._step[phase] += now - self._lap_start
        self._lap_start = now

    def add(self, phase: str, seconds: float) -> None:
        """Charges ``seconds`` timed elsewhere (the attention calls) to ``phase``."""
        self._step[phase] += seconds

    def end(self, kind: str, tokens: int = 0) -> None:
        """Adds the step's phases to its kind."""
        totals, step = self.seconds[kind], self._step
        for phase in PHASES:
            totals[phase] += step[phase]
        self.steps[kind] += 1
        self.tokens[kind] += tokens
