"""Weights & Biases sink: an offline W&B run under `<run_dir>/tracking/wandb/` by default.

Offline (`mode="offline"`, the default) needs no network and no account: the run is written to
`<run_dir>/tracking/wandb/wandb/offline-run-*/` and can be uploaded later with `wandb sync`.
`mode="online"` logs to the server the environment configures (WANDB_API_KEY, WANDB_BASE_URL).

Each series gets its own x axis (`define_metric`): `<series>/step` is logged next to the values,
and every `<series>/*` metric is plotted against it, so points of one series never force the step
of another (W&B's own `_step` only counts log calls).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.tracking.base import SERIES, MetricsSink, finite_values

MODES = ("offline", "online", "disabled")


class WandbSink(MetricsSink):
    name = "wandb"

    def __init__(
        self,
        directory: Path,
        *,
        project: str,
        run_name: str,
        mode: str = "offline",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        import wandb

        if mode not in MODES:
            raise ValueError(f"wandb mode {mode!r}: use one of {', '.join(MODES)}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._run: Any = wandb.init(
            project=project,
            name=run_name,
            dir=str(directory),
            mode=mode,  # type: ignore[arg-type]
            config=dict(config or {}),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            reinit="create_new",
        )
        for series in SERIES:
            self._run.define_metric(f"{series}/step")
            self._run.define_metric(f"{series}/*", step_metric=f"{series}/step")

    @property
    def run_dir(self) -> Path:
        """The W&B run's own directory (offline-run-*/ in offline mode)."""
        return Path(self._run.dir).parent

    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        if self._run is None:
            raise ValueError("the W&B run is finished")
        row = {f"{series}/{name}": value for name, value in finite_values(values).items()}
        row[f"{series}/step"] = int(step)
        self._run.log(row)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
