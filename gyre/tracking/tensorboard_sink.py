"""TensorBoard sink: scalar summaries in an event file under `<run_dir>/tracking/tensorboard/`.

Written with TensorBoard's own event-file writer (package `tensorboard`, no TensorFlow and no
torch needed); `tensorboard --logdir <run_dir>/tracking/tensorboard` shows the run, and
`EventAccumulator` reads the scalars back as `<series>/<name>` tags with their steps.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from gyre.tracking.base import MetricsSink, finite_values


class TensorBoardSink(MetricsSink):
    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer: EventFileWriter | None = EventFileWriter(str(directory), flush_secs=5)

    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        if self._writer is None:
            raise ValueError(f"the TensorBoard writer of {self.directory} is closed")
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=f"{series}/{name}", simple_value=value)
                for name, value in finite_values(values).items()
            ]
        )
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
