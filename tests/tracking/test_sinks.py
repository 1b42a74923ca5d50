"""Each metrics sink writes what a reader of its format reads back, with the report's own numbers.

The points come from the report's analysis of a SYNTHETIC event log (tests/job/conftest.py's
generator: real scheduler lease events, synthetic steps and scores); the readers are each
format's own: TensorBoard's EventAccumulator, the offline W&B run's transaction log (its records
are W&B's own protobuf), MLflow's client over the local store.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.job.analysis import analyse
from app.job.eventlog import read_events
from app.job.report import summary_of
from app.job.tracking import TrackingRecorder, learning_rows
from gyre.tracking import open_sinks, sink_dir
from gyre.tracking.jsonl_sink import FILE_NAME, read_points
from tests.job.conftest import write_synthetic_run


@pytest.fixture(scope="module")
def report_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float | None], list[dict]]:
    """A synthetic run directory, the report's reward curve and the event records."""
    run_dir = tmp_path_factory.mktemp("tracked")
    write_synthetic_run(run_dir, num_steps=6, reward_slope=0.05, seed=3)
    records = read_events(run_dir / "events.jsonl")
    analysis = analyse(records)
    return run_dir, summary_of(analysis)["reward_curve"], records


def _finite_curve(curve: list[float | None]) -> list[tuple[int, float]]:
    return [(step, x) for step, x in enumerate(curve) if x is not None and math.isfinite(x)]


def _log_report(run_dir: Path, names: list[str], records: list[dict]) -> TrackingRecorder:
    recorder = TrackingRecorder(open_sinks(names, run_dir, run_name="synthetic", project="gyre-test"))
    recorder.log_learning(analyse(records), records)
    recorder.close()
    return recorder


def test_learning_rows_carry_every_report_metric_and_the_reports_reward(report_run) -> None:
    run_dir, curve, records = report_run
    rows = learning_rows(analyse(records), records)
    assert [step for step, _ in rows] == list(range(len(curve)))
    expected = {
        "reward",
        "scored_reward",
        "entropy",
        "kl_behaviour",
        "clip_fraction",
        "zero_variance_groups",
        "staleness_max",
        "batch_tokens",
        "tree_token_ratio",
        "num_exact_merged",
        "num_near_duplicates",
    }
    assert expected <= set(rows[0][1])
    got = [(s, v["reward"]) for s, v in rows if math.isfinite(v["reward"])]
    assert got == _finite_curve(curve)
    assert any(v["batch_tokens"] > 0 for _, v in rows)


def test_tensorboard_event_file_reads_back_the_reward_series(report_run, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, curve, records = report_run
    _log_report(tmp_path, ["tensorboard"], records)
    acc = EventAccumulator(str(sink_dir(tmp_path, "tensorboard")))
    acc.Reload()
    assert "learning/tree_token_ratio" in acc.Tags()["scalars"]
    got = [(e.step, e.value) for e in acc.Scalars("learning/reward")]
    want = _finite_curve(curve)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32 summaries


def test_offline_wandb_run_reads_back_the_reward_series(
    report_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gyre.tracking.wandb_reader import complete_run_log, history_rows

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _, curve, records = report_run
    _log_report(tmp_path, ["wandb"], records)
    rows = history_rows(complete_run_log(sink_dir(tmp_path, "wandb")))
    got = [(r["learning/step"], r["learning/reward"]) for r in rows if "learning/reward" in r]
    assert got == _finite_curve(curve)


def test_mlflow_local_store_reads_back_the_reward_series(report_run, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from gyre.tracking.mlflow_sink import tracking_uri

    _, curve, records = report_run
    _log_report(tmp_path, ["mlflow"], records)
    client = MlflowClient(tracking_uri=tracking_uri(sink_dir(tmp_path, "mlflow")))
    experiment = client.get_experiment_by_name("gyre-test")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "synthetic"
    history = client.get_metric_history(run.info.run_id, "learning/reward")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == _finite_curve(curve)


def test_several_sinks_at_once_get_the_same_points(report_run, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, curve, records = report_run
    _log_report(tmp_path, ["jsonl", "tensorboard"], records)
    points = read_points(sink_dir(tmp_path, "jsonl") / FILE_NAME)
    jsonl = [(p["step"], p["values"]["reward"]) for p in points if "reward" in p["values"]]  # type: ignore[index]
    acc = EventAccumulator(str(sink_dir(tmp_path, "tensorboard")))
    acc.Reload()
    assert [s for s, _ in jsonl] == [e.step for e in acc.Scalars("learning/reward")]
    assert jsonl == _finite_curve(curve)
    assert all(json.dumps(p) for p in points)


def test_an_unknown_sink_name_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensorboard, wandb, mlflow, jsonl"):
        open_sinks(["neptune"], tmp_path, run_name="x")


def test_interval_metrics_get_throughput_from_the_step_events_between_snapshots(tmp_path: Path) -> None:
    recorder = TrackingRecorder(open_sinks(["jsonl"], tmp_path, run_name="x"))

    def snapshot(i: int, t: float) -> dict:
        values = {"interval": i, "devices_leased_rollout": 3.0, "devices_leased_train": 1.0}
        return {
            "type": "MetricsEvent",
            "event": {"service": "scheduler", "values": values, "created_unix_s": t},
        }

    recorder.on_record(snapshot(0, 100.0))
    for _ in range(4):
        recorder.on_record({"type": "StepEvent", "event": {"num_completion_tokens": 5}})
    recorder.on_record(snapshot(1, 102.0))
    recorder.on_record(
        {"type": "MetricsEvent", "event": {"service": "trainer", "values": {"train_step": 0, "loss": 0.5}}}
    )
    recorder.close()
    points = read_points(sink_dir(tmp_path, "jsonl") / FILE_NAME)
    devices = [p for p in points if p["series"] == "devices"]
    assert [p["step"] for p in devices] == [0, 1]
    assert "tokens_per_s" not in devices[0]["values"]  # type: ignore[operator]
    assert devices[1]["values"]["tokens_per_s"] == pytest.approx(10.0)  # type: ignore[index]
    assert [p["values"] for p in points if p["series"] == "trainer"] == [{"loss": 0.5}]
