"""Metrics sinks: the run's learning, trainer and device metrics in the trackers researchers use.

One interface (`MetricsSink`: `log(series, step, values)`, `close()`) and four implementations,
chosen by name (`job.tracking: [tensorboard, wandb, mlflow, jsonl]`, several at once). Each
writes under `<run_dir>/tracking/<name>/` and needs nothing but its package (the `tracking` extra):
no server and no network unless W&B is switched to online.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from gyre.tracking.base import SERIES, FanOut, MetricsSink, finite_values

SinkName = Literal["tensorboard", "wandb", "mlflow", "jsonl"]
SINK_NAMES: tuple[SinkName, ...] = ("tensorboard", "wandb", "mlflow", "jsonl")
TRACKING_DIR = "tracking"

__all__ = [
    "SERIES",
    "SINK_NAMES",
    "TRACKING_DIR",
    "FanOut",
    "MetricsSink",
    "SinkName",
    "finite_values",
    "open_sinks",
]


def sink_dir(run_dir: Path, name: str) -> Path:
    """Where sink `name` writes inside a run directory."""
    return run_dir / TRACKING_DIR / name


def open_sinks(
    names: Sequence[str],
    run_dir: Path,
    *,
    run_name: str,
    project: str = "gyre",
    wandb_mode: str = "offline",
    params: Mapping[str, Any] | None = None,
) -> FanOut:
    """The named sinks, opened under `run_dir/tracking/` (an empty list gives a sink that drops all).

    ValueError names an unknown sink; ImportError says which package (extra `tracking`) is missing.
    """
    sinks: list[MetricsSink] = []
    for name in dict.fromkeys(names):  # each once, in the order given
        if name == "jsonl":
            from gyre.tracking.jsonl_sink import JsonlSink

            sinks.append(JsonlSink(sink_dir(run_dir, name)))
        elif name == "tensorboard":
            from gyre.tracking.tensorboard_sink import TensorBoardSink

            sinks.append(TensorBoardSink(sink_dir(run_dir, name)))
        elif name == "wandb":
            from gyre.tracking.wandb_sink import WandbSink

            sinks.append(
                WandbSink(
                    sink_dir(run_dir, name),
                    project=project,
                    run_name=run_name,
                    mode=wandb_mode,
                    config=params,
                )
            )
        elif name == "mlflow":
            from gyre.tracking.mlflow_sink import MlflowSink

            sinks.append(
                MlflowSink(sink_dir(run_dir, name), experiment=project, run_name=run_name, params=params)
            )
        else:
            raise ValueError(f"unknown metrics sink {name!r}: use any of {', '.join(SINK_NAMES)}")
    return FanOut(sinks)
