"""Following the scheduler's leases: which device this worker serves, and the handoff steps.

    REASSIGN of our device (we hold it, it is DRAINING)  -> drain its engine (live migration) -> Release(epoch)
    GRANTED to us for rollout                             -> Acquire(epoch) -> start an engine on it
    ACTIVE, held by us for rollout, no engine yet         -> start an engine (after a restart / registration)

`decide` is the pure part; `LeaseFollower` applies it. Leases arrive both as LeaseEvents and in
Heartbeat/RegisterWorker replies, so the same lease may be seen twice: actions are idempotent
(an engine is started once per device; a repeated Release/Acquire at the same epoch is answered
unchanged by the scheduler; a stale epoch is refused and ignored here, since a newer event follows).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

import grpc

from gyre.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class LeaseAction(enum.StrEnum):
    NONE = "none"
    SERVE = "serve"  # start an engine (no scheduler call)
    DRAIN_AND_RELEASE = "drain_and_release"
    ACQUIRE_AND_SERVE = "acquire_and_serve"


def decide(lease: common_pb2.Lease, worker_id: str, serving: bool) -> LeaseAction:
    """What this worker must do about `lease`, given whether it runs an engine on that device."""
    S, R = common_pb2, common_pb2.DEVICE_ROLE_ROLLOUT
    if lease.state == S.LEASE_STATE_DRAINING and lease.holder == worker_id:
        return LeaseAction.DRAIN_AND_RELEASE
    if lease.state == S.LEASE_STATE_GRANTED and lease.target_holder == worker_id and lease.target_role == R:
        return LeaseAction.ACQUIRE_AND_SERVE
    if lease.state == S.LEASE_STATE_ACTIVE and lease.holder == worker_id and lease.role == R and not serving:
        return LeaseAction.SERVE
    return LeaseAction.NONE


class LeaseFollower:
    def __init__(
        self,
        worker_id: str,
        stub: scheduler_pb2_grpc.SchedulerStub,
        start_engine: Callable[[str], Awaitable[None]],
        stop_engine: Callable[[str], Awaitable[None]],
        serving: Callable[[str], bool],
    ) -> None:
        self.worker_id, self.stub = worker_id, stub
        self.start_engine, self.stop_engine, self.serving = start_engine, stop_engine, serving
        self._locks: dict[str, asyncio.Lock] = {}
        self.num_released = 0
        self.num_acquired = 0

    async def apply(self, lease: common_pb2.Lease) -> LeaseAction:
        async with self._locks.setdefault(lease.device_id, asyncio.Lock()):
            action = decide(lease, self.worker_id, self.serving(lease.device_id))
            try:
                if action is LeaseAction.DRAIN_AND_RELEASE:
                    if self.serving(lease.device_id):
                        await self.stop_engine(lease.device_id)  # drains: in-flight generations migrate
                    await self.stub.Release(
                        scheduler_pb2.ReleaseRequest(
                            worker_id=self.worker_id, device_id=lease.device_id, epoch=lease.epoch
                        )
                    )
                    self.num_released += 1
                elif action is LeaseAction.ACQUIRE_AND_SERVE:
                    await self.stub.Acquire(
                        scheduler_pb2.AcquireRequest(
                            worker_id=self.worker_id, device_id=lease.device_id, epoch=lease.epoch
                        )
                    )
                    self.num_acquired += 1
                    await self.start_engine(lease.device_id)
                elif action is LeaseAction.SERVE:
                    await self.start_engine(lease.device_id)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise
                log.info(
                    "lease action %s on %s refused (%s); a newer lease follows",
                    action,
                    lease.device_id,
                    exc.details(),
                )
            return action
