"""JSON-lines sink: one line per logged point, `{"series", "step", "values", "unix_s"}`.

The file is `<run_dir>/tracking/metrics.jsonl`; each line is flushed when written, so a crashed
run keeps every point logged before it stopped. Needs no extra package.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from gyre.tracking.base import MetricsSink, finite_values

FILE_NAME = "metrics.jsonl"


class JsonlSink(MetricsSink):
    name = "jsonl"

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / FILE_NAME
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")

    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        line = {"series": series, "step": int(step), "values": finite_values(values), "unix_s": time.time()}
        self._file.write(json.dumps(line, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_points(path: Path) -> list[dict[str, object]]:
    """Every point of a metrics.jsonl, in the order written (a truncated last line is skipped)."""
    out: list[dict[str, object]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
