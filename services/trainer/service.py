"""The trainer service: the step loop, gRPC Trainer (GetStatus, SaveCheckpoint), weights events, leases.

    start:  Trainer (restore) -> gRPC Trainer -> with a scheduler: a worker of the pool
            (gyre.lease_client.LeaseClient: RegisterWorker, gyre.leases.<run>.*, Heartbeat, ReportLoad)
            -> the step loop
    stop:   the loop stops at its next boundary -> checkpoint -> ack -> data-parallel workers exit

The trainer trains only on devices it holds a TRAIN lease for: one data-parallel rank per device,
none held = the loop waits at a micro-batch boundary and trains nothing (services.trainer.loop).
A GRANTED lease is acquired (with the event's epoch) and its rank joins at the next micro-batch
boundary; a REASSIGN of a held device makes its rank leave at the next micro-batch boundary, and
only then is the device released. ReportLoad tells the scheduler the trainer's demand: scored
groups waiting in the trajectory service (GetStats), the step in progress and its remaining
device-seconds, the last step time, the weight version and the ranks training now.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import grpc

import gyre.rpc
from gyre.bus import Bus, subjects
from gyre.config import CommonConfig
from gyre.lease_client import LeaseClient
from gyre.pacing import Pacer
from gyre.service import Runtime, Service
from gyre.v1 import (
    common_pb2,
    events_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    trajectory_pb2,
    trajectory_pb2_grpc,
    waits_pb2,
)
from gyre.waits import wait
from services.trainer.config import TrainerConfig
from services.trainer.data import TrajectoryBatchSource
from services.trainer.loop import Trainer

log = logging.getLogger(__name__)


async def publish_weights_event(
    bus: Bus, run_id: str, weights: common_pb2.WeightVersion, metrics: dict[str, float]
) -> None:
    """Announce a weight version on gyre.weights.<run_id> (msg id = event id: redelivery-safe)."""
    event_id = f"weights.{run_id}.{weights.version}"
    event = events_pb2.WeightsPublishedEvent(
        event_id=event_id, run_id=run_id, weights=weights, metrics=metrics
    )
    await bus.publish(subjects.weights(run_id), event, msg_id=event_id)


async def publish_step_metrics(
    bus: Bus, run_id: str, weights: common_pb2.WeightVersion, metrics: dict[str, float]
) -> None:
    """The step's scalars as a MetricsEvent on gyre.metrics.<run_id>.trainer, for any tap and the
    experiment trackers: the weights event's metrics plus `train_step` (the step that produced
    version v is v - 1, as the report counts steps) and `weight_version`. Published after the weights
    event; its id is the version's, so a redelivered or repeated publication is stored once."""
    event_id = f"metrics.{run_id}.trainer.{weights.version}"
    values = {**metrics, "train_step": float(weights.version - 1), "weight_version": float(weights.version)}
    event = events_pb2.MetricsEvent(
        event_id=event_id, run_id=run_id, service="trainer", values=values, created_unix_s=time.time()
    )
    await bus.publish(subjects.metrics(run_id, "trainer"), event, msg_id=event_id)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    @gyre.rpc.error_boundary
    async def GetStatus(self, request: Any, context: Any) -> trainer_pb2.TrainerStatusResponse:
        t = self.service.trainer
        return trainer_pb2.TrainerStatusResponse(
            step=t.state.step,
            latest_weights=t.latest_weights,
            dp_size=t.dp.size,
            device_ids=sorted(self.service.devices.held),
            last_metrics=t.last_metrics,
            state=self.service.state,
        )

    @gyre.rpc.error_boundary
    async def SaveCheckpoint(self, request: Any, context: Any) -> trainer_pb2.SaveCheckpointResponse:
        t = self.service.trainer
        async with self.service.trainer.step_lock:
            path = await asyncio.to_thread(t.save_checkpoint)
            await t.ack_covered()
        return trainer_pb2.SaveCheckpointResponse(path=str(path or ""), step=t.state.step)


class TrainDevices:
    """The trainer's part of the lease protocol (a gyre.lease_client.DeviceUser): one rank per device."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.held: set[str] = set()
        self.pool: dict[str, int] = {}  # device of the pool -> its index on its node (from GetPool)

    def knows(self, device_id: str) -> bool:
        return device_id in self.pool

    def using(self, device_id: str) -> bool:
        return device_id in self.held

    async def start_using(self, device_id: str) -> None:
        """The device's rank joins at the next micro-batch boundary (returns at once)."""
        self.held.add(device_id)
        self.trainer.device_index[device_id] = self.pool.get(device_id, 0)
        self.trainer.set_devices(sorted(self.held))
        await self.trainer.wake()

    async def stop_using(self, device_id: str) -> None:
        """Returns once the device's rank has left the group (at a micro-batch boundary)."""
        self.held.discard(device_id)
        self.trainer.set_devices(sorted(self.held))
        await self.trainer.wake()
        await self.trainer.wait_devices_applied()
        # paced: the device changes role (back to rollout) before it is released
        pacer = self.trainer.pacer
        await pacer.wait("role_change", pacer.clock(), lambda: pacer.role_change_s("rollout"))


class TrainerService(Service):
    name = "trainer"

    def __init__(self, common: CommonConfig, cfg: TrainerConfig) -> None:
        self.common, self.cfg = common, cfg
        self.state = common_pb2.SERVICE_STATE_STARTING
        self.trainer: Trainer
        self.devices: TrainDevices
        self.backlog_groups = 0
        self.backlog_ready_batches = 0  # batches built, not handed out yet (the trajectory's poll loop)

    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        source = TrajectoryBatchSource(
            self.cfg.trajectory_address,
            self.common.run_id,
            self.cfg.worker_id,
            self.cfg.batch_max_tokens,
            self.cfg.pull_wait_s,
            vocab_size=self.cfg.model.vocab_size,  # a batch the model cannot embed is quarantined
            quarantine_path=self.common.run_dir / "trainer" / "quarantine.jsonl",
        )

        async def sink(weights: common_pb2.WeightVersion, metrics: dict[str, float]) -> None:
            await publish_weights_event(rt.bus, self.common.run_id, weights, metrics)
            await publish_step_metrics(rt.bus, self.common.run_id, weights, metrics)

        self.trainer = await asyncio.to_thread(
            Trainer, self.cfg, self.common.run_dir, source, sink, self.common.seed
        )
        self.trainer.pacer = Pacer(
            self.common.devices.pacing,
            busy_log_path=self.common.run_dir / "pacing" / f"{self.cfg.worker_id}.jsonl",
        )
        self.devices = TrainDevices(self.trainer)
        await self._adopt_unreceived_batches(rt.bus, source)
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(self), rt.server)
        if self.cfg.scheduler_address is not None:
            await self._join_pool(rt)
        rt.spawn(self.trainer.run(), "train-loop")
        self.state = common_pb2.SERVICE_STATE_SERVING

    async def _adopt_unreceived_batches(self, bus: Bus, source: TrajectoryBatchSource) -> None:
        """Replay, after the journal, every batch the trajectory service announced that this trainer
        has neither trained (checkpoint), journaled nor quarantined: a predecessor killed between
        the hand-out of a batch and its journal write would otherwise leave it delivered and never
        trained. Each is pulled again by id (one that is another consumer's is skipped)."""
        subject = subjects.paths_batch(self.common.run_id)
        announced = [
            events_pb2.BatchReadyEvent.FromString(stored.data).batch_id
            async for stored in bus.replay(subject)
        ]
        if not announced:
            return
        known = {
            *self.trainer.state.trained_batch_ids,
            *self.trainer.journal.pulled_batch_ids,
            *self.trainer.replay,
            *source.quarantined,
        }
        adopted = [b for b in dict.fromkeys(announced) if b not in known]
        if adopted:
            log.warning("replaying %d batches handed out but never journaled: %s", len(adopted), adopted)
            self.trainer.replay += adopted

    async def _join_pool(self, rt: Runtime) -> None:
        """Become a worker of the pool: no device until the scheduler grants one."""
        assert self.cfg.scheduler_address is not None
        self.trainer.set_devices([])
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(gyre.rpc.channel(self.cfg.scheduler_address))
        self.trajectory = trajectory_pb2_grpc.TrajectoryStub(gyre.rpc.channel(self.cfg.trajectory_address))
        self.leases = LeaseClient(
            self.cfg.worker_id,
            "trainer",
            self.scheduler,
            self.devices,
            self.load,
            address=f"127.0.0.1:{rt.port}",
            spawn=rt.spawn,
        )
        await self.refresh_pool()
        await self.leases.register()
        self.consumer = await rt.bus.consume(
            subjects.leases(self.common.run_id, "*"),
            events_pb2.LeaseEvent,
            self.leases.on_events,
            durable=f"trainer-leases-{self.cfg.worker_id}",
        )
        rt.spawn(self.leases.heartbeat_forever(), "heartbeat")
        rt.spawn(self._watch_backlog(), "watch-backlog")
        rt.spawn(self.leases.report_load_forever(self.cfg.report_load_interval_s), "report-load")

    async def refresh_pool(self) -> None:
        """The pool's devices and their node indices (what `trainer.device: cuda` maps to cuda:N)."""
        pool = await self.scheduler.GetPool(scheduler_pb2.GetPoolRequest())
        self.devices.pool = {d.device_id: d.index for d in pool.devices}

    async def _watch_backlog(self) -> None:
        """Keep the scored groups waiting in the trajectory service, and the pool's devices, fresh."""
        while True:
            try:
                stats = await self.trajectory.GetStats(
                    trajectory_pb2.GetStatsRequest(run_id=self.common.run_id)
                )
                self.backlog_groups = stats.stats.groups_scored
                self.backlog_ready_batches = stats.stats.batches_ready
                await self.refresh_pool()
            except grpc.aio.AioRpcError as exc:  # a peer briefly away: the last figures stand
                self.rt.count_error("watch_backlog", exc)
            await asyncio.sleep(self.cfg.report_load_interval_s)

    def load(self) -> scheduler_pb2.WorkerLoad:
        """The trainer's demand as the scheduler's policies read it. Backlog batches: the waiting
        scored groups in batches the size of the last one pulled, plus the batches already built and
        waiting to be pulled, plus the step in progress (its batch is not trained yet), so a trainer
        mid-step, or with a built batch and no device, still asks for devices."""
        t = self.trainer
        per_batch = t.last_batch_groups or 1
        return scheduler_pb2.WorkerLoad(
            trainer_backlog_batches=math.ceil(self.backlog_groups / per_batch)
            + self.backlog_ready_batches
            + int(t.step_in_progress),
            trainer_step_s=t.last_metrics.get("step_interval_s", 0.0),  # cadence, as the simulator reports it
            weight_version=t.state.version,
            trainer_backlog_groups=self.backlog_groups,
            trainer_step_in_progress=t.step_in_progress,
            trainer_remaining_work_device_s=t.remaining_work_device_s(),
            trainer_dp_size=t.dp.size,
            busy_device_s=t.busy_device_s,
        )

    def waits(self) -> list[waits_pb2.Wait]:
        """The step loop's phase (pulling a batch, training, publishing) and a missing device."""
        t = self.trainer
        out = []
        if t.parked:
            out.append(wait("devices", "a TRAIN device: none held (the scheduler lends one)"))
        if t.phase is not None:
            loop, what, since = t.phase
            out.append(wait(loop, what, since))
        return out

    async def stop(self) -> None:
        self.state = common_pb2.SERVICE_STATE_DRAINING
        self.trainer.stopping = True
        await self.trainer.wake()
        if self.cfg.scheduler_address is not None:
            await self.consumer.stop()
        async with self.trainer.step_lock:
            await asyncio.to_thread(self.trainer.save_checkpoint)
            await self.trainer.ack_covered()
            await asyncio.to_thread(self.trainer.close)  # data-parallel workers exit
        self.state = common_pb2.SERVICE_STATE_STOPPED


def build(common: CommonConfig, cfg: Any) -> Service:
    return TrainerService(common, cfg)
