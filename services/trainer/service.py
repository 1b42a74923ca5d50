"""The trainer service: the step loop, gRPC Trainer (GetStatus, SaveCheckpoint), weights events, leases.

Leases: a GRANTED LeaseEvent whose target holder is this worker is acquired through the scheduler
(`Acquire` with the event's epoch) and raises the data-parallel target to the number of devices
held; the loop grows the group at the first step boundary after the new worker is ready. A
REASSIGN of a held device waits for the step in flight, shrinks the group at once (the leaving
worker has exited), and only then `Release`s the device. GetStatus reports the devices held and
the group's size now (it lags the devices while a new worker boots). A stale epoch is refused by
the scheduler and logged; the event stream may redeliver events, and Acquire/Release are
idempotent on (device, epoch) at the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import gyre.rpc
from gyre.bus import Bus, subjects
from gyre.config import CommonConfig
from gyre.service import Runtime, Service
from gyre.v1 import common_pb2, events_pb2, scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
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
            device_ids=sorted(self.service.devices),
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


class TrainerService(Service):
    name = "trainer"

    def __init__(self, common: CommonConfig, cfg: TrainerConfig) -> None:
        self.common, self.cfg = common, cfg
        self.devices: dict[str, int] = {}  # device_id -> epoch held
        self.state = common_pb2.SERVICE_STATE_STARTING
        self.trainer: Trainer

    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        source = TrajectoryBatchSource(
            self.cfg.trajectory_address,
            self.common.run_id,
            self.cfg.worker_id,
            self.cfg.batch_max_tokens,
            self.cfg.pull_wait_s,
        )

        async def sink(weights: common_pb2.WeightVersion, metrics: dict[str, float]) -> None:
            await publish_weights_event(rt.bus, self.common.run_id, weights, metrics)

        self.trainer = await asyncio.to_thread(
            Trainer, self.cfg, self.common.run_dir, source, sink, self.common.seed
        )
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(self), rt.server)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(gyre.rpc.channel(self.cfg.scheduler_address))
        self.leases = await rt.bus.consume(
            subjects.leases(self.common.run_id, "*"),
            events_pb2.LeaseEvent,
            self.on_leases,
            durable=f"trainer-leases-{self.cfg.worker_id}",
        )
        rt.spawn(self.trainer.run(), "train-loop")
        self.state = common_pb2.SERVICE_STATE_SERVING

    async def on_leases(self, events: list[events_pb2.LeaseEvent]) -> None:
        me = self.cfg.worker_id
        for ev in events:
            lease = ev.lease
            if ev.kind == events_pb2.LeaseEvent.KIND_GRANTED and lease.target_holder == me:
                await self.scheduler.Acquire(
                    scheduler_pb2.AcquireRequest(worker_id=me, device_id=lease.device_id, epoch=lease.epoch)
                )
                self.devices[lease.device_id] = lease.epoch
                self.trainer.request_dp_size(len(self.devices))  # grows at a step boundary
            elif ev.kind == events_pb2.LeaseEvent.KIND_REASSIGN and lease.device_id in self.devices:
                async with self.trainer.step_lock:  # the step in flight finishes first
                    self.trainer.request_dp_size(len(self.devices) - 1)
                    await asyncio.to_thread(self.trainer.apply_dp_size)  # the leaving rank has exited
                    await self.scheduler.Release(
                        scheduler_pb2.ReleaseRequest(
                            worker_id=me, device_id=lease.device_id, epoch=lease.epoch
                        )
                    )
                    self.devices.pop(lease.device_id, None)

    async def stop(self) -> None:
        self.state = common_pb2.SERVICE_STATE_DRAINING
        self.trainer.stopping = True
        await self.leases.stop()
        async with self.trainer.step_lock:
            await asyncio.to_thread(self.trainer.save_checkpoint)
            await self.trainer.ack_covered()
            await asyncio.to_thread(self.trainer.close)  # data-parallel workers exit
        self.state = common_pb2.SERVICE_STATE_STOPPED


def build(common: CommonConfig, cfg: Any) -> Service:
    return TrainerService(common, cfg)
