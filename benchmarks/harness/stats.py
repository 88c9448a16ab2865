"""Statistics of the benchmarks' measurements: medians, percentiles, ratios, rounding for the JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def median(values: Sequence[float]) -> float:
    """The median; ``nan`` for no values."""
    return percentile(values, 50.0)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated; ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when it is undefined."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    if math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


def rounded(value: Any, digits: int = 4) -> Any:
    """Rounds floats (recursively) to ``digits`` significant digits for readable JSON."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value == 0:
            return value
        return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value
