"""Integration: a real scheduler process (python -m services.scheduler) with real NATS and Postgres
runs a full handoff between two workers and is restarted in the middle of it.

The two workers are test code speaking the real gRPC API (the outermost edge): a rollout worker
that brings two devices, and a trainer. The elastic policy, told that one live execution fits on
one device and that the trainer has a batch waiting, lends one device to training.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gyre import rpc
from gyre.bus import Bus, subjects
from gyre.lease_client import LeaseAction, LeaseClient
from gyre.v1 import common_pb2, events_pb2, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "schedtest"


class SchedulerProcess:
    def __init__(self, config: Path) -> None:
        self.config = config
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.scheduler",
            "--config",
            str(self.config),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ},
        )
        assert self.proc.stdout is not None
        lines = []
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
            lines.append(line)
            if not line:
                raise AssertionError("scheduler exited before GYRE_READY:\n" + "".join(lines))
            if line.startswith("GYRE_READY scheduler"):
                self.port = int(line.split()[2])
                break
        asyncio.get_running_loop().create_task(self._drain_output())

    async def _drain_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while await self.proc.stdout.readline():
            pass

    async def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 30)


@contextlib.asynccontextmanager
async def stub(port: int) -> AsyncIterator[scheduler_pb2_grpc.SchedulerStub]:
    channel = rpc.channel(f"127.0.0.1:{port}")
    try:
        yield scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await channel.close()


async def report_loads(s: scheduler_pb2_grpc.SchedulerStub) -> None:
    await s.ReportLoad(
        scheduler_pb2.ReportLoadRequest(
            worker_id="rollout-0", load=scheduler_pb2.WorkerLoad(live_executions=1, engine_capacity=4)
        )
    )
    await s.ReportLoad(
        scheduler_pb2.ReportLoadRequest(
            worker_id="trainer-0", load=scheduler_pb2.WorkerLoad(trainer_backlog_batches=1)
        )
    )


def assert_one_holder_each(pool: scheduler_pb2.GetPoolResponse) -> None:
    ids = [x.device_id for x in pool.leases]
    assert len(ids) == len(set(ids)) == 2
    for lease in pool.leases:
        if lease.holder:
            assert lease.state in (common_pb2.LEASE_STATE_ACTIVE, common_pb2.LEASE_STATE_DRAINING)


@pytest.mark.slow
async def test_handoff_survives_a_scheduler_restart_without_a_double_holder(
    nats_url: str, database_url: str, run_dir: Path
) -> None:
    config = run_dir / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_id": RUN_ID,
                "run_dir": str(run_dir),
                "nats_url": nats_url,
                "database_url": database_url,
                "scheduler": {
                    "policy": "elastic",
                    "plan_interval_s": 0.2,
                    "worker_timeout_s": 60,
                    "drain_timeout_s": 120,
                    "grant_timeout_s": 120,
                },
            }
        )
    )
    bus = await Bus.connect(nats_url, name="test-observer")
    await bus.ensure_streams()
    events: list[events_pb2.LeaseEvent] = []

    async def collect() -> None:
        async for ev in bus.tail(subjects.leases(RUN_ID, "*"), events_pb2.LeaseEvent, from_start=True):
            events.append(ev)

    collector = asyncio.create_task(collect())
    scheduler = SchedulerProcess(config)
    await scheduler.start()
    try:
        async with stub(scheduler.port) as s:
            devices = [
                common_pb2.Device(device_id=f"gpu0-{i}", node="gpu0", index=i, kind="cpu") for i in range(2)
            ]
            await s.RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id="rollout-0", service="rollout", devices=devices)
            )
            await s.RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker_id="trainer-0", service="trainer")
            )
            await report_loads(s)
            reassign = await wait_for_event(events, events_pb2.LeaseEvent.KIND_REASSIGN)
            moving = reassign.lease.device_id
            assert reassign.lease.target_holder == "trainer-0" and reassign.policy == "elastic"
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            assert_one_holder_each(pool)

        assert await scheduler.stop() == 0  # restart in the middle of the handoff
        await scheduler.start()
        async with stub(scheduler.port) as s:
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            lease = next(x for x in pool.leases if x.device_id == moving)
            assert (lease.state, lease.holder, lease.epoch) == (
                common_pb2.LEASE_STATE_DRAINING,
                "rollout-0",
                reassign.lease.epoch,
            )
            await s.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="rollout-0"))
            await s.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="trainer-0"))

            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await s.Release(
                    scheduler_pb2.ReleaseRequest(
                        worker_id="rollout-0", device_id=moving, epoch=lease.epoch - 1
                    )
                )
            assert (
                stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                and "stale epoch" in stale.value.details()
            )
            with pytest.raises(grpc.aio.AioRpcError) as early:
                await s.Acquire(
                    scheduler_pb2.AcquireRequest(worker_id="trainer-0", device_id=moving, epoch=lease.epoch)
                )
            assert early.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            released = await s.Release(
                scheduler_pb2.ReleaseRequest(worker_id="rollout-0", device_id=moving, epoch=lease.epoch)
            )
            assert released.lease.state == common_pb2.LEASE_STATE_GRANTED and released.lease.holder == ""
            await report_loads(s)
            acquired = await s.Acquire(
                scheduler_pb2.AcquireRequest(worker_id="trainer-0", device_id=moving, epoch=lease.epoch)
            )
            assert (
                acquired.lease.holder == "trainer-0" and acquired.lease.role == common_pb2.DEVICE_ROLE_TRAIN
            )
            await wait_for_event(events, events_pb2.LeaseEvent.KIND_ACQUIRED)
            await asyncio.sleep(1.0)  # a few plan rounds: the pool is where the policy wants it
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            assert_one_holder_each(pool)
            assert sorted(x.holder for x in pool.leases) == ["rollout-0", "trainer-0"]
    finally:
        await scheduler.stop()
        collector.cancel()
        await bus.close()

    # The event history of the moved device: one handoff, one epoch, the holder never doubled.
    history = [e for e in events if e.lease.device_id == moving]
    kinds = [e.kind for e in history]
    K = events_pb2.LeaseEvent
    assert kinds == [K.KIND_REGISTERED, K.KIND_REASSIGN, K.KIND_RELEASED, K.KIND_GRANTED, K.KIND_ACQUIRED]
    assert [e.lease.holder for e in history] == ["rollout-0", "rollout-0", "", "", "trainer-0"]
    assert {e.lease.epoch for e in history[1:]} == {reassign.lease.epoch}


async def wait_for_event(
    events: list[events_pb2.LeaseEvent], kind: int, timeout_s: float = 30
) -> events_pb2.LeaseEvent:
    async with asyncio.timeout(timeout_s):
        while True:
            for ev in events:
                if ev.kind == kind:
                    return ev
            await asyncio.sleep(0.05)


class RecordingDevices:
    """The role-specific edge of a worker (engines / data-parallel ranks), reduced to a record of
    which device is in use by whom; `shared` is the same dict for every worker of the test, so a
    device used by two workers at once is caught the moment it happens."""

    def __init__(self, worker_id: str, known: set[str], shared: dict[str, str]) -> None:
        self.worker_id, self.known, self.shared = worker_id, known, shared
        self.mine: set[str] = set()
        self.double_use: list[str] = []

    def knows(self, device_id: str) -> bool:
        return device_id in self.known

    def using(self, device_id: str) -> bool:
        return device_id in self.mine

    async def start_using(self, device_id: str) -> None:
        if self.shared.get(device_id, self.worker_id) != self.worker_id:
            self.double_use.append(device_id)
        self.shared[device_id] = self.worker_id
        self.mine.add(device_id)

    async def stop_using(self, device_id: str) -> None:
        self.mine.discard(device_id)
        if self.shared.get(device_id) == self.worker_id:
            del self.shared[device_id]


async def wait_until(predicate: Any, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_lease_clients_move_a_device_both_ways_and_count_what_they_ignore(
    nats_url: str, database_url: str, run_dir: Path
) -> None:
    run_id = "leaseclient"
    config = run_dir / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_id": run_id,
                "run_dir": str(run_dir),
                "nats_url": nats_url,
                "database_url": database_url,
                "scheduler": {"policy": "elastic", "plan_interval_s": 0.2, "heartbeat_interval_s": 0.5},
            }
        )
    )
    devices = {"gpu0-0", "gpu0-1"}
    shared: dict[str, str] = {}
    loads = {
        "rollout-0": scheduler_pb2.WorkerLoad(live_executions=1, engine_capacity=4),
        "trainer-0": scheduler_pb2.WorkerLoad(trainer_backlog_batches=1, trainer_step_in_progress=True),
    }
    bus = await Bus.connect(nats_url, name="lease-client-test")
    await bus.ensure_streams()
    scheduler = SchedulerProcess(config)
    await scheduler.start()
    tasks: list[asyncio.Task[Any]] = []
    consumers: list[Any] = []
    try:
        async with stub(scheduler.port) as s:
            users, clients = {}, {}
            for worker, service, brings in (
                ("trainer-0", "trainer", []),
                ("rollout-0", "rollout", sorted(devices)),
            ):
                users[worker] = RecordingDevices(worker, devices, shared)
                clients[worker] = LeaseClient(
                    worker,
                    service,
                    s,
                    users[worker],
                    lambda w=worker: loads[w],
                    devices=[
                        common_pb2.Device(device_id=d, node="gpu0", index=i) for i, d in enumerate(brings)
                    ],
                )
                await clients[worker].register()
                consumers.append(
                    await bus.consume(
                        subjects.leases(run_id, "*"),
                        events_pb2.LeaseEvent,
                        clients[worker].on_events,
                        durable=f"test-{worker}",
                    )
                )
                tasks.append(asyncio.create_task(clients[worker].heartbeat_forever()))
                tasks.append(asyncio.create_task(clients[worker].report_load_forever(0.2)))
            rollout, trainer = users["rollout-0"], users["trainer-0"]

            # the trainer has work and one live execution fits on one device: one device is lent
            await wait_until(lambda: len(trainer.mine) == 1 and len(rollout.mine) == 1)
            lent = next(iter(trainer.mine))
            # the grant that lent it, applied again (a redelivered event, a late heartbeat reply):
            # no second Acquire is sent and the repeat is counted apart
            t = clients["trainer-0"]
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            granted = common_pb2.Lease()
            granted.CopyFrom(next(x for x in pool.leases if x.device_id == lent))
            assert granted.state == common_pb2.LEASE_STATE_ACTIVE and granted.holder == "trainer-0"
            granted.state, granted.target_holder = common_pb2.LEASE_STATE_GRANTED, "trainer-0"
            granted.target_role = common_pb2.DEVICE_ROLE_TRAIN
            assert await t.apply(granted) is LeaseAction.NONE
            assert t.num_acquired == 1 and t.counters()["ignored_redelivered"] == 1
            # executions wait again and the trainer has nothing to do: the device comes back
            loads["rollout-0"] = scheduler_pb2.WorkerLoad(live_executions=8, engine_capacity=4)
            loads["trainer-0"] = scheduler_pb2.WorkerLoad()
            await wait_until(lambda: rollout.mine == devices and not trainer.mine)
            assert rollout.double_use == trainer.double_use == []
            assert clients["trainer-0"].num_acquired == 1 and clients["trainer-0"].num_released == 1
            # the drain that took it back, applied again: no second Release, counted apart
            draining = common_pb2.Lease()
            draining.CopyFrom(granted)
            draining.state, draining.holder, draining.epoch = (
                common_pb2.LEASE_STATE_DRAINING, "trainer-0", t.released_at[lent],
            )  # fmt: skip
            t.epochs[lent] = draining.epoch  # as if no newer lease of it had reached the trainer yet
            assert await t.apply(draining) is LeaseAction.NONE
            assert t.num_released == 1 and t.counters()["ignored_redelivered"] == 2

            # leases a worker must not act on are ignored and counted, never raised
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            lease = next(x for x in pool.leases if x.device_id == lent)
            t = clients["trainer-0"]
            before = t.counters()
            forged = common_pb2.Lease()
            forged.CopyFrom(lease)
            forged.state, forged.holder = common_pb2.LEASE_STATE_GRANTED, ""
            forged.target_holder, forged.target_role = "trainer-0", common_pb2.DEVICE_ROLE_TRAIN
            forged.epoch = lease.epoch + 5  # never issued: the scheduler refuses the Acquire
            assert await t.apply(forged) is LeaseAction.NONE
            assert t.epochs[lent] == lease.epoch  # a refused epoch does not fence out the real ones
            unknown = common_pb2.Lease()
            unknown.CopyFrom(forged)
            unknown.device_id = "gpu9-0"
            assert await t.apply(unknown) is LeaseAction.NONE
            stale = common_pb2.Lease()
            stale.CopyFrom(forged)
            stale.epoch = 1
            assert await t.apply(stale) is LeaseAction.NONE
            other = common_pb2.Lease()
            other.CopyFrom(lease)  # held by rollout-0: nothing for the trainer to do
            assert await t.apply(other) is LeaseAction.NONE
            after = t.counters()
            assert after["refused_by_scheduler"] == before["refused_by_scheduler"] + 1
            assert after["ignored_unknown_device"] == before["ignored_unknown_device"] + 1
            assert after["ignored_stale_epoch"] == before["ignored_stale_epoch"] + 1
            assert after["ignored_other_worker"] >= before["ignored_other_worker"] + 1
            assert not trainer.mine and rollout.mine == devices  # nothing moved
            pool = await s.GetPool(scheduler_pb2.GetPoolRequest())
            assert sorted(x.holder for x in pool.leases) == ["rollout-0", "rollout-0"]
    finally:
        for task in tasks:
            task.cancel()
        for consumer in consumers:
            await consumer.stop()
        await scheduler.stop()
        await bus.close()
