"""MLflow sink: one MLflow run in a local store under `<run_dir>/tracking/mlflow/`.

The store is SQLite (`mlflow.db`, MLflow's recommended local backend since its plain-file store
went into maintenance mode), artifacts beside it; `mlflow ui --backend-store-uri
sqlite:///<run_dir>/tracking/mlflow/mlflow.db` shows it, and `MlflowClient(tracking_uri)` reads
each metric's history back (`<series>/<name>`, with the step). Works with `mlflow-skinny`; no
server, no network.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gyre.tracking.base import MetricsSink, finite_values

DB_NAME = "mlflow.db"


def tracking_uri(directory: Path) -> str:
    """The MLflow tracking URI of the store in `directory`."""
    return f"sqlite:///{(directory / DB_NAME).resolve()}"


class MlflowSink(MetricsSink):
    name = "mlflow"

    def __init__(
        self,
        directory: Path,
        *,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        directory.mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(directory)
        self._client: Any = MlflowClient(tracking_uri=self.uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self._client.create_experiment(
                experiment, artifact_location=(directory / "artifacts").resolve().as_uri()
            )
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in (params or {}).items():
            self._client.log_param(self.run_id, key, str(value)[:500])
        self._open = True

    def log(self, series: str, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if not self._open:
            raise ValueError(f"MLflow run {self.run_id} is closed")
        now_ms = int(time.time() * 1000)
        metrics = [
            Metric(key=f"{series}/{name}", value=value, timestamp=now_ms, step=int(step))
            for name, value in finite_values(values).items()
        ]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self._open:
            self._client.set_terminated(self.run_id)
            self._open = False
