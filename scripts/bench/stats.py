"""The statistics every benchmark reports: medians with their min–max spread over rounds, and
per-round ratios of two sides measured side by side (what to read on a shared machine)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import TypedDict


class Spread(TypedDict):
    """Median and range of one quantity over the rounds (the JSON shape every page reads)."""

    median: float
    min: float
    max: float


def median(values: Sequence[float]) -> float:
    """The median, NaN when nothing was measured (a part that did not run)."""
    return statistics.median(values) if len(values) else math.nan


def spread(values: Sequence[float]) -> Spread | None:
    """Median, min and max of per-round values; None when there are none."""
    if not len(values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios num / den of two sides timed in the same rounds (zero times skipped)."""
    return [a / b for a, b in zip(num, den, strict=True) if b > 0]


def ratio_of_medians(num: Sequence[float], den: Sequence[float]) -> float:
    """median(num) / median(den): the headline ratio of two sides' pooled samples."""
    return median(num) / median(den)
