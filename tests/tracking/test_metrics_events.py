"""MetricsEvents on a real nats-server (the `nats_url` fixture): the trainer's per step and the
scheduler's per interval, as the services build and publish them, read by the event collector and
fed to the metrics sinks, so every tap reads the same numbers as the trackers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from app.job.collector import EventCollector
from app.job.eventlog import read_events
from app.job.tracking import TrackingRecorder
from gyre.bus import Bus, subjects
from gyre.tracking import open_sinks, sink_dir
from gyre.tracking.jsonl_sink import FILE_NAME, read_points
from gyre.v1 import common_pb2, scheduler_pb2
from services.scheduler.policies import DeviceState, Role
from services.scheduler.pool_metrics import PoolMetrics, metrics_event
from services.scheduler.snapshot import pool_snapshot
from services.trainer.service import publish_step_metrics

pytestmark = pytest.mark.integration


def _snapshot(rollout_busy_s: float, trainer_busy_s: float, *, generating: int) -> object:
    devices = [
        DeviceState("cpu0-0", Role.ROLLOUT),
        DeviceState("cpu0-1", Role.ROLLOUT),
        DeviceState("cpu0-2", Role.TRAIN),
        DeviceState("cpu0-3", Role.TRAIN, moving=True),
    ]
    rollout = scheduler_pb2.WorkerLoad(
        live_executions=5,
        busy_device_s=rollout_busy_s,
        engines=[scheduler_pb2.EngineLoad(device_id="cpu0-0", generating=generating)],
    )
    trainer = scheduler_pb2.WorkerLoad(busy_device_s=trainer_busy_s, trainer_remaining_work_device_s=0.0)
    return pool_snapshot(devices, [rollout], [trainer], default_engine_capacity=8, staleness_bound=2)


def test_pool_metrics_count_leases_and_divide_busy_growth_by_leased_device_seconds() -> None:
    metrics = PoolMetrics()
    first = metrics.sample(_snapshot(10.0, 1.0, generating=2), 100.0)  # type: ignore[arg-type]
    second = metrics.sample(_snapshot(13.0, 1.5, generating=0), 102.0)  # type: ignore[arg-type]
    assert (first["interval"], second["interval"]) == (0.0, 1.0)
    assert first["devices_rollout"] == 2 and first["devices_train"] == 1 and first["devices_moving"] == 1
    assert "rollout_busy_fraction" not in first  # nothing to difference yet
    assert second["rollout_busy_fraction"] == pytest.approx(
        3.0 / (2.0 * 2)
    )  # 3 device-s over 2 devices x 2 s
    assert second["train_busy_fraction"] == pytest.approx(0.5 / (2.0 * 1))
    assert first["busy.cpu0-0"] == 1.0 and second["busy.cpu0-0"] == 0.0
    assert first["busy.cpu0-3"] == 0.0  # a device in a handoff computes for nobody


async def test_trainer_and_scheduler_metrics_reach_the_collector_and_the_sinks_unchanged(
    nats_url: str, tmp_path: Path
) -> None:
    run_id = f"m{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="test-metrics")
    await bus.ensure_streams()
    recorder = TrackingRecorder(open_sinks(["jsonl"], tmp_path, run_name=run_id))
    pool = PoolMetrics()
    try:
        collector = EventCollector(bus, run_id, tmp_path)
        collector.on_event(recorder.on_record)
        await collector.start()
        step_metrics = {"loss": -0.15, "entropy": 4.79, "kl_behaviour": 0.0, "clip_fraction": 0.25}
        for version in (1, 2):
            weights = common_pb2.WeightVersion(version=version)
            await publish_step_metrics(bus, run_id, weights, {**step_metrics, "step": float(version)})
        await publish_step_metrics(bus, run_id, common_pb2.WeightVersion(version=2), step_metrics)  # repeat
        for t, busy in ((100.0, 10.0), (102.0, 13.0)):
            event = metrics_event(run_id, "p1", pool.sample(_snapshot(busy, 0.0, generating=1), t))  # type: ignore[arg-type]
            await bus.publish(subjects.metrics(run_id, "scheduler"), event, msg_id=event.event_id)
        for _ in range(200):
            if len(read_points(sink_dir(tmp_path, "jsonl") / FILE_NAME)) >= 4:
                break
            await asyncio.sleep(0.05)
        await collector.stop()
    finally:
        recorder.close()
        await bus.close()

    records = [r for r in read_events(tmp_path / "events.jsonl") if r["type"] == "MetricsEvent"]
    assert sorted(r["subject"] for r in records) == sorted(
        [f"gyre.metrics.{run_id}.trainer"] * 2 + [f"gyre.metrics.{run_id}.scheduler"] * 2
    )  # the repeated version-2 event is stored once
    points = read_points(sink_dir(tmp_path, "jsonl") / FILE_NAME)
    trainer = [p for p in points if p["series"] == "trainer"]
    assert [p["step"] for p in trainer] == [0, 1]  # version v was produced by step v - 1
    for p in trainer:
        values = p["values"]
        assert {k: values[k] for k in step_metrics} == step_metrics  # type: ignore[index]
    devices = [p for p in points if p["series"] == "devices"]
    assert [p["step"] for p in devices] == [0, 1]
    assert devices[1]["values"]["rollout_busy_fraction"] == pytest.approx(0.75)  # type: ignore[index]
    assert devices[1]["values"]["devices_rollout"] == 2  # type: ignore[index]


async def test_a_scheduler_process_publishes_pool_metrics_from_the_loads_workers_report(
    nats_url: str, database_url: str, run_dir: Path
) -> None:
    """A real scheduler process (python -m services.scheduler) with real NATS and Postgres; the
    workers are test code speaking the real gRPC API (the outermost edge)."""
    import yaml

    from gyre.v1 import events_pb2
    from tests.scheduler.test_scheduler_service import SchedulerProcess, stub

    run_id = f"pm{uuid.uuid4().hex[:6]}"
    config = run_dir / "run.yaml"
    scheduler_cfg = {
        "policy": "async",
        "async_rollout_devices": 2,
        "plan_interval_s": 0.2,
        "metrics_interval_s": 0.2,
    }
    config.write_text(
        yaml.safe_dump(
            {
                "run_id": run_id,
                "run_dir": str(run_dir),
                "nats_url": nats_url,
                "database_url": database_url,
                "scheduler": scheduler_cfg,
            }
        )
    )
    bus = await Bus.connect(nats_url, name="test-pool-metrics")
    await bus.ensure_streams()
    scheduler = SchedulerProcess(config)
    await scheduler.start()
    seen: list[events_pb2.MetricsEvent] = []
    try:
        async with stub(scheduler.port) as s:
            devices = [
                common_pb2.Device(device_id=f"cpu9-{i}", node="cpu9", index=i, kind="cpu") for i in range(2)
            ]
            await s.RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id="rollout-0", service="rollout", devices=devices)
            )
            await s.RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id="trainer-0", service="trainer")
            )
            for busy in (1.0, 2.0, 3.0, 4.0):
                load = scheduler_pb2.WorkerLoad(
                    live_executions=2,
                    engine_capacity=4,
                    busy_device_s=busy,
                    engines=[scheduler_pb2.EngineLoad(device_id="cpu9-0", generating=1)],
                )
                await s.ReportLoad(scheduler_pb2.ReportLoadRequest(worker_id="rollout-0", load=load))
                await s.ReportLoad(
                    scheduler_pb2.ReportLoadRequest(worker_id="trainer-0", load=scheduler_pb2.WorkerLoad())
                )
                await asyncio.sleep(0.5)

        async def collect() -> None:
            async for ev in bus.tail(
                subjects.metrics(run_id, "scheduler"), events_pb2.MetricsEvent, from_start=True
            ):
                seen.append(ev)
                if len(seen) >= 3:
                    return

        await asyncio.wait_for(collect(), 30)
    finally:
        assert await scheduler.stop() == 0
        await bus.close()
    last = seen[-1].values
    assert [int(e.values["interval"]) for e in seen] == list(range(len(seen)))
    assert (
        last["devices_rollout"] + last["devices_train"] + last["devices_idle"] + last["devices_moving"] == 2
    )
    assert last["rollout_busy_device_s"] >= 1.0
    assert last["busy.cpu9-0"] == 1.0 or last["devices_moving"] > 0
    assert all(e.service == "scheduler" and e.run_id == run_id for e in seen)
