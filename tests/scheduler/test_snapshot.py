"""`pool_snapshot` (services/scheduler/snapshot.py): the one function that turns leases and load
reports into the policy's input, live and in the simulator. Pure: no NATS, Postgres or gRPC."""

from __future__ import annotations

from gyre.v1 import scheduler_pb2
from services.scheduler.policies import DeviceState, Role
from services.scheduler.snapshot import pool_snapshot


def _rollout_load(*engines: tuple[str, int, int, int]) -> scheduler_pb2.WorkerLoad:
    return scheduler_pb2.WorkerLoad(
        live_executions=sum(e[1] for e in engines),
        engine_capacity=4,
        engines=[
            scheduler_pb2.EngineLoad(device_id=d, executions=n, generating=g, context_tokens=c)
            for d, n, g, c in engines
        ],
    )


def test_pool_snapshot_copies_each_engine_load_onto_its_device_and_ignores_unknown_devices() -> None:
    devices = [
        DeviceState("d0", Role.ROLLOUT),
        DeviceState("d1", Role.ROLLOUT),
        DeviceState("d2", Role.ROLLOUT, moving=True),  # its engine is not running: no report names it
        DeviceState("d3", Role.TRAIN),
    ]
    rollout = [
        _rollout_load(("d0", 3, 2, 12_000), ("gone", 9, 9, 99_999)),  # "gone": not a device of the pool
        _rollout_load(("d1", 1, 0, 500)),  # a second rollout worker
    ]
    trainer = [scheduler_pb2.WorkerLoad(trainer_backlog_batches=1)]
    snap = pool_snapshot(devices, rollout, trainer, default_engine_capacity=8, staleness_bound=1)
    assert snap.devices == (
        DeviceState("d0", Role.ROLLOUT, executions=3, generating=2, context_tokens=12_000),
        DeviceState("d1", Role.ROLLOUT, executions=1, generating=0, context_tokens=500),
        DeviceState("d2", Role.ROLLOUT, moving=True),
        DeviceState("d3", Role.TRAIN),
    )
    # The per-worker sums are unchanged by the per-engine entries.
    assert (snap.live_executions, snap.engine_capacity, snap.trainer_backlog) == (13, 4, 1)


def test_pool_snapshot_without_engine_reports_keeps_the_devices_as_the_leases_give_them() -> None:
    devices = [DeviceState("d0", Role.ROLLOUT), DeviceState("d1", Role.TRAIN)]
    snap = pool_snapshot(
        devices,
        [scheduler_pb2.WorkerLoad(live_executions=2)],
        [],
        default_engine_capacity=8,
        staleness_bound=1,
    )
    assert snap.devices == tuple(devices)
