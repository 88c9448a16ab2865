"""The engine's load as routers want it: the prefill work queued here and the measured prefill rate.

The engine loop publishes a report after each step and when requests come or
go; the ``Load`` stream's RPC threads wait on the board for a change, so every
gateway sees the same numbers within a step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadReport:
    """Attributes:
    queued_tokens: prompt tokens still to compute: the uncached rest of each
        prefilling request, and the whole prompt of each waiting one (its hits
        are known only at admission).
    waiting, running: requests not yet admitted, and admitted ones.
    free_blocks: the daemon's free blocks after the last step.
    forward_s, token_s: the fitted time of one forward, ``forward_s + token_s * tokens``;
        both 0 until enough forwards of different sizes were seen (unknown).
    token_budget: the most tokens one forward computes.
    """

    queued_tokens: int = 0
    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    forward_s: float = 0.0
    token_s: float = 0.0
    token_budget: int = 0


class PrefillRate:
    """A forward's time as ``forward_s + token_s * tokens``, by exponentially
    weighted least squares over recent forwards (older ones fade with ``halflife``).

    Until forwards of different sizes are seen, the slope stays at its prior,
    and ``known`` is false: one long prefill alone would read as a huge fixed
    time, and make an idle replica look slower than one never measured.
    """

    def __init__(
        self, forward_s: float = 0.02, token_s: float = 1e-4, halflife: float = 64.0, min_forwards: int = 8
    ) -> None:
        self._decay = 0.5 ** (1.0 / halflife)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.forward_s, self.token_s = forward_s, token_s
        self._min_forwards = min_forwards
        self._forwards = 0
        self._sloped = False

    @property
    def known(self) -> bool:
        return self._sloped and self._forwards >= self._min_forwards

    def observe(self, tokens: int, seconds: float) -> None:
        d = self._decay
        self._forwards += 1
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        spread = self._w * self._xx - self._x * self._x
        if spread > 1e-9 * max(1.0, self._xx * self._w):
            slope = (self._w * self._xy - self._x * self._y) / spread
            if slope > 0:
                self.token_s, self._sloped = slope, True
        self.forward_s = max(0.0, (self._y - self.token_s * self._x) / self._w)


class LoadBoard:
    """The latest report and its version; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._report = LoadReport()
        self._version = 0

    def publish(self, report: LoadReport) -> None:
        with self._cond:
            if report != self._report:
                self._report = report
                self._version += 1
                self._cond.notify_all()

    def wait(self, seen: int, timeout_s: float) -> tuple[int, LoadReport]:
        """The report once its version is past ``seen`` (or the current one after ``timeout_s``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen, timeout_s)
            return self._version, self._report
