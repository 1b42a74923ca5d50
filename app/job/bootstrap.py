"""Means with percentile-bootstrap 95% intervals: the statistics behind a run report's learning
verdict (app/job/analysis.py). Pure functions; deterministic for a given seed."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.stats

CONFIDENCE = 0.95
NUM_BOOTSTRAP = 5000


@dataclass(frozen=True)
class Interval:
    """A mean with its 95% confidence interval over `n` samples (nan bounds when n < 2)."""

    mean: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}] (n={self.n})"


def bootstrap_mean(samples: list[float], *, seed: int = 0, num_resamples: int = NUM_BOOTSTRAP) -> Interval:
    """Mean with a percentile-bootstrap 95% interval (scipy.stats.bootstrap; deterministic for a
    given seed)."""
    if not samples:
        return Interval(math.nan, math.nan, math.nan, 0)
    x = np.asarray(samples, dtype=np.float64)
    if len(x) < 2:
        return Interval(float(x.mean()), math.nan, math.nan, len(x))
    ci = _percentile_bootstrap((x,), _mean, seed, num_resamples)
    return Interval(float(x.mean()), ci[0], ci[1], len(x))


def bootstrap_difference(
    first: list[float], last: list[float], *, seed: int = 0, num_resamples: int = NUM_BOOTSTRAP
) -> Interval:
    """mean(last) - mean(first) with a 95% percentile-bootstrap interval, the two samples resampled
    independently (scipy.stats.bootstrap, unpaired)."""
    if len(first) < 2 or len(last) < 2:
        mean = statistics.fmean(last) - statistics.fmean(first) if first and last else math.nan
        return Interval(mean, math.nan, math.nan, min(len(first), len(last)))
    a = np.asarray(first, dtype=np.float64)
    b = np.asarray(last, dtype=np.float64)
    ci = _percentile_bootstrap((a, b), _mean_difference, seed + 1, num_resamples)
    return Interval(float(b.mean() - a.mean()), ci[0], ci[1], min(len(a), len(b)))


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis)


def _mean_difference(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(b, axis=axis) - np.mean(a, axis=axis)


def _percentile_bootstrap(
    data: tuple[np.ndarray, ...], statistic: Any, seed: int, num_resamples: int
) -> tuple[float, float]:
    """(low, high) of the CONFIDENCE percentile interval of `statistic` over `data`."""
    res = scipy.stats.bootstrap(
        data,
        statistic,
        n_resamples=num_resamples,
        confidence_level=CONFIDENCE,
        method="percentile",
        paired=False,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
