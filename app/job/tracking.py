"""A run's metrics in the experiment trackers chosen by `job.tracking` (gyre/tracking/ sinks).

Three series, each on its own x axis:

* ``trainer`` (x: trainer step) — live, from the trainer's `MetricsEvent` of each optimizer step
  (loss, entropy, KL to the behaviour policy, clip fraction, tokens, step seconds ...), as the
  event log records it.
* ``devices`` (x: the scheduler's snapshot number) — live, from the scheduler's interval
  `MetricsEvent` (devices leased per role, busy fraction per role), plus the generation
  throughput over the same interval (`tokens_per_s`: completion tokens of the step events
  recorded since the previous snapshot, over the seconds between the two snapshots).
* ``learning`` (x: trainer step) — at the end of the run, the report's own per-step rows
  (`learning_rows`): reward with partial progress, the scored reward the trainer trained on,
  zero-variance groups, dedup counts, batch tokens, tree ratio, staleness and the trainer's health
  metrics. They are the report's numbers because they come from the same `RunAnalysis`; they are
  logged once the run is over because a step's row is final only after the events that land in
  it have arrived.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from pathlib import Path
from typing import Any

from app.job.analysis import RunAnalysis, event_time
from gyre.tracking import FanOut, open_sinks

log = logging.getLogger("app.job.tracking")

Record = dict[str, Any]

# learning-series name -> trainer metric of the weights event (the report's health table)
TRAINER_HEALTH = {"entropy": "entropy", "kl_behaviour": "kl_behaviour", "clip_fraction": "clip_fraction"}


def _nan_mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def staleness_by_step(analysis: RunAnalysis, records: list[Record]) -> dict[int, int]:
    """Largest batch staleness per trainer step: trainer version when the batch was announced minus
    the oldest policy version of its tokens (the report's definition; batches with tokens only)."""
    starts = [analysis.start_unix_s + row.start_s for row in analysis.steps]
    out: dict[int, int] = {}
    for r in records:
        if r["type"] != "BatchReadyEvent":
            continue
        ev = r["event"]
        if int(float(ev.get("num_tokens", 0) or 0)) <= 0:
            continue
        step = max(0, bisect.bisect_right(starts, event_time(r)) - 1)
        staleness = step - int(float(ev.get("min_policy_version", 0) or 0))
        out[step] = max(out.get(step, staleness), staleness)
    return out


def learning_rows(analysis: RunAnalysis, records: list[Record]) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) for every trainer step of the report, in step order (NaN where a step has none)."""
    staleness = staleness_by_step(analysis, records)
    rows: list[tuple[int, dict[str, float]]] = []
    for row in analysis.steps:
        values = {
            "reward": row.reward_mean,
            "scored_reward": _nan_mean(row.scored_samples),
            "progress": row.progress_mean,
            "oracle_reward": row.oracle_mean,
            "num_groups": float(row.num_groups),
            "zero_variance_groups": float(row.num_zero_variance_groups),
            "zero_variance_fraction": row.zero_variance_fraction,
            "num_exact_merged": float(row.num_exact_merged),
            "num_near_duplicates": float(row.num_near_duplicates),
            "batch_tokens": float(row.batch_tokens),
            "batch_flat_tokens": float(row.batch_flat_tokens),
            "tree_token_ratio": row.tree_token_ratio,
            "staleness_max": float(staleness[row.step]) if row.step in staleness else math.nan,
        }
        for name, key in TRAINER_HEALTH.items():
            values[name] = row.trainer_metrics.get(key, math.nan)
        rows.append((row.step, values))
    return rows


class TrackingRecorder:
    """Feeds the sinks from the event log records as the collector writes them (see module doc).

    `on_record` runs in the collector's task for every new record (duplicates never reach it);
    a sink that fails is logged and the recording goes on, so a tracker can never stop a run.
    """

    def __init__(self, sinks: FanOut) -> None:
        self.sinks = sinks
        self._tokens_since = 0
        self._last_snapshot_s: float | None = None
        self.num_points = 0

    @classmethod
    def open(
        cls,
        names: list[str],
        run_dir: Path,
        *,
        run_name: str,
        project: str,
        wandb_mode: str,
        params: dict[str, Any] | None = None,
    ) -> TrackingRecorder:
        return cls(
            open_sinks(
                names, run_dir, run_name=run_name, project=project, wandb_mode=wandb_mode, params=params
            )
        )

    def _log(self, series: str, step: int, values: dict[str, float]) -> None:
        try:
            self.sinks.log(series, step, values)
            self.num_points += 1
        except Exception:
            log.exception("metrics sink failed on %s step %d", series, step)

    def on_record(self, record: Record) -> None:
        kind = record["type"]
        ev = record["event"]
        if kind == "StepEvent":
            self._tokens_since += int(float(ev.get("num_completion_tokens", 0) or 0))
        elif kind == "MetricsEvent":
            values = {k: float(v) for k, v in (ev.get("values") or {}).items()}
            service = ev.get("service", "")
            if service == "trainer" and "train_step" in values:
                self._log("trainer", int(values.pop("train_step")), values)
            elif service == "scheduler" and "interval" in values:
                t = float(ev.get("created_unix_s", 0.0) or 0.0)
                if self._last_snapshot_s is not None and t > self._last_snapshot_s:
                    values["tokens_per_s"] = self._tokens_since / (t - self._last_snapshot_s)
                self._tokens_since, self._last_snapshot_s = 0, t
                self._log("devices", int(values.pop("interval")), values)

    def log_learning(self, analysis: RunAnalysis, records: list[Record]) -> None:
        """The report's per-step rows as the `learning` series (call once, after the report)."""
        for step, values in learning_rows(analysis, records):
            self._log("learning", step, values)

    def close(self) -> None:
        try:
            self.sinks.close()
        except Exception:
            log.exception("closing the metrics sinks failed")


def open_for_job(job: Any, run_id: str, run_dir: Path, params: dict[str, Any]) -> TrackingRecorder | None:
    """The recorder of a `gyre run` (None when `job.tracking` is empty); prints where each sink writes."""
    if not job.tracking:
        return None
    recorder = TrackingRecorder.open(
        list(job.tracking),
        run_dir,
        run_name=run_id,
        project=job.tracking_project,
        wandb_mode=job.wandb_mode,
        params=params,
    )
    print(f"tracking: {', '.join(job.tracking)} under {run_dir / 'tracking'}", flush=True)
    return recorder


def finish_for_job(recorder: TrackingRecorder | None, analysis: RunAnalysis | None, run_dir: Path) -> None:
    """Log the report's learning series (when there is a report) and close every sink."""
    if recorder is None:
        return
    try:
        if analysis is not None:
            from app.job.eventlog import EVENT_LOG_NAME, read_events

            recorder.log_learning(analysis, read_events(run_dir / EVENT_LOG_NAME))
    finally:
        recorder.close()
