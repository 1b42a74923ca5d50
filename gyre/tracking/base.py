"""The one interface every metrics sink implements, and a fan-out over several.

A *series* is a family of metrics that share an x axis: ``learning`` and ``trainer`` are indexed
by the trainer step (weight version produced minus one), ``devices`` by the interval number of
the scheduler's snapshots. A sink names a metric ``<series>/<name>`` and records the step next to
it, so every format plots each series against its own axis.

Guarantees: ``log`` never reorders within a series (points are written in call order); non-finite
values are dropped (every backend either refuses them or draws them as gaps anyway), so a reader
finds exactly the finite points that were logged; ``close`` flushes everything and is idempotent.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

SERIES = ("learning", "trainer", "devices")


def finite_values(values: Mapping[str, float]) -> dict[str, float]:
    """The finite entries of `values`, as floats (NaN and infinities left out)."""
    out: dict[str, float] = {}
    for name, value in values.items():
        x = float(value)
        if math.isfinite(x):
            out[name] = x
    return out


class MetricsSink(ABC):
    """Where scalar metrics go: a TensorBoard log, a W&B run, an MLflow run, a JSON-lines file."""

    name: ClassVar[str]

    @abstractmethod
    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        """Record `values` (metric name -> value) at `step` of `series` (names without the series)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release the backend; a second call does nothing."""


class FanOut(MetricsSink):
    """Every point to every sink, in the order given (several trackers at once)."""

    name = "fanout"

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        clean = finite_values(values)
        if not clean:
            return
        for sink in self.sinks:
            sink.log(series, step, clean)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
