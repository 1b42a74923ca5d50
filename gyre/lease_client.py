"""The worker side of the device pool: one lease client for every worker (rollout and trainer).

    RegisterWorker (devices it brings) -> apply every lease in the reply     (in the background)
    LeaseEvents on gyre.leases.<run>.*  -> apply            (at-least-once, any order across devices)
    Heartbeat every interval            -> apply every lease in the reply   (catch-up after a miss;
                                           in the background: a slow action never delays a beat)
    ReportLoad every interval           -> the worker's `load()` figures

What a lease means for this worker (`decide`, pure):
    DRAINING, held by me                          -> stop using the device, then Release(epoch)
    GRANTED to me for my role                     -> Acquire(epoch), then start using it
    ACTIVE, held by me in my role, not in use     -> start using it (after a restart or a missed event)
    in use by me, but the lease says otherwise    -> stop using it: "no longer mine" (fenced)

The role-specific part is a `DeviceUser` (start/stop an engine; grow/shrink data parallel):
`start_using` / `stop_using` are called at most once per change, under a per-device lock, and
`stop_using` returns only when the device is free (an engine drained, a rank left its group).

Guarantees
- Fencing: the client remembers the newest epoch seen per device. A lease with an older epoch is
  stale: ignored and counted (`num_stale`). Release/Acquire carry the lease's own epoch, so the
  scheduler refuses an outdated action (FAILED_PRECONDITION) even when the client could not tell;
  the epoch of a refused action is not remembered, so a never-issued epoch cannot fence out the
  real ones.
- Never a redelivery loop: a lease naming another worker (`num_other_worker`), an unknown device
  (`num_unknown_device`), or an action the scheduler refuses — stale or never-issued epoch,
  unknown device, scheduler unreachable (`num_refused`) — is counted and logged, never raised
  into the event consumer. A refused action is retried by the next event or heartbeat reply.
- Idempotent: the same lease applied twice (event + heartbeat reply, a redelivered event) starts
  or stops nothing twice. A Release or Acquire already done at that epoch is not sent again: it is
  counted once (`num_released`, `num_acquired`) and the repeat apart (`num_redelivered`). (The
  scheduler would answer a repeated Release/Acquire at the same epoch unchanged anyway.)
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import grpc

from gyre.v1 import common_pb2, events_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_ROLE = {"rollout": common_pb2.DEVICE_ROLE_ROLLOUT, "trainer": common_pb2.DEVICE_ROLE_TRAIN}


class LeaseAction(enum.StrEnum):
    NONE = "none"
    START = "start"  # begin using a device held (no scheduler call)
    RELEASE = "release"  # stop using it (if in use), then Release(epoch)
    ACQUIRE = "acquire"  # Acquire(epoch), then start using it
    FENCED = "fenced"  # in use, but no longer ours: stop using it (no scheduler call)


class DeviceUser(Protocol):
    """What a worker does with a device it gains or loses (the role-specific part)."""

    def knows(self, device_id: str) -> bool:
        """This worker can use `device_id` (an engine slot it brings; a device of the pool)."""

    def using(self, device_id: str) -> bool:
        """The device is in use now (an engine on it; a rank training on it, or joining)."""

    async def start_using(self, device_id: str) -> None:
        """Begin using a device now held (may return before the device is fully in use)."""

    async def stop_using(self, device_id: str) -> None:
        """Stop using a device; returns once it is free (nothing of ours runs on it)."""


def decide(lease: common_pb2.Lease, worker_id: str, role: int, using_since: int | None) -> LeaseAction:
    """What `worker_id` (serving `role`) must do about `lease`, given the epoch under which it
    started using that device (None: not in use). A lease of that same epoch cannot take the device
    away (every change of holder issues a new epoch): it is an older step of the handoff that
    gave it to us, redelivered."""
    using = using_since is not None
    S = common_pb2
    if lease.state == S.LEASE_STATE_DRAINING and lease.holder == worker_id:
        return LeaseAction.RELEASE
    if (
        lease.state == S.LEASE_STATE_GRANTED
        and lease.target_holder == worker_id
        and lease.target_role == role
    ):
        return LeaseAction.ACQUIRE
    mine = lease.state == S.LEASE_STATE_ACTIVE and lease.holder == worker_id and lease.role == role
    if mine and not using:
        return LeaseAction.START
    if using and not mine and using_since is not None and lease.epoch > using_since:
        return LeaseAction.FENCED
    return LeaseAction.NONE


class LeaseClient:
    """Registers a worker, follows its leases and reports its load. One per worker process."""

    def __init__(
        self,
        worker_id: str,
        service: str,
        stub: scheduler_pb2_grpc.SchedulerStub,
        user: DeviceUser,
        load: Callable[[], scheduler_pb2.WorkerLoad],
        *,
        devices: Sequence[common_pb2.Device] = (),
        address: str = "",
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any] | None = None,
    ) -> None:
        """`spawn(coro, name)` runs background work (pass `Runtime.spawn`: a task that raises takes
        the service down); default: a plain task whose exception is logged."""
        if service not in SERVICE_ROLE:
            raise ValueError(f"service must be one of {sorted(SERVICE_ROLE)}, got {service!r}")
        self.worker_id, self.service, self.role = worker_id, service, SERVICE_ROLE[service]
        self.stub, self.user, self.load = stub, user, load
        self.devices, self.address = list(devices), address
        self.spawn = spawn or self._spawn_logged
        self._tasks: set[asyncio.Task[Any]] = set()
        self.epochs: dict[str, int] = {}  # newest epoch seen per device
        self.using_since: dict[str, int] = {}  # device in use -> epoch it was started under
        self.released_at: dict[str, int] = {}  # device -> epoch of its last Release that succeeded
        self._locks: dict[str, asyncio.Lock] = {}
        self.heartbeat_interval_s = 1.0
        self.num_acquired = self.num_released = self.num_fenced = 0
        self.num_stale = self.num_other_worker = self.num_unknown_device = self.num_refused = 0
        self.num_redelivered = 0

    @property
    def held(self) -> list[str]:
        """Devices in use now, sorted."""
        return sorted(d for d in self.epochs if self.user.using(d))

    # -- protocol -----------------------------------------------------------------------------
    async def register(self) -> None:
        """RegisterWorker (idempotent), then act on every lease the reply names."""
        reply = await self.stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(
                worker_id=self.worker_id, service=self.service, devices=self.devices, address=self.address
            )
        )
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.catch_up(reply.leases)

    def catch_up(self, leases: Sequence[common_pb2.Lease]) -> None:
        """Apply the leases of a register / heartbeat reply in the background: starting an engine or
        waiting for a rank to leave can take longer than the worker timeout, and the heartbeat must
        not wait for it (per-device locks keep the actions in order). An error there (not a refusal,
        which `apply` counts) fails the service through `spawn`."""
        if leases:
            self.spawn(self._apply_all(list(leases)), "lease-catch-up")

    async def _apply_all(self, leases: list[common_pb2.Lease]) -> None:
        for lease in leases:
            await self.apply(lease)

    async def on_events(self, events: list[events_pb2.LeaseEvent]) -> None:
        """Bus handler for gyre.leases.<run>.*: never raises for a lease it cannot act on. Each
        device's events are applied in order; different devices concurrently (a whole-pool switch
        drains every engine at once, not one after the other)."""
        by_device: dict[str, list[common_pb2.Lease]] = {}
        for ev in events:
            by_device.setdefault(ev.lease.device_id, []).append(ev.lease)

        async def in_order(leases: list[common_pb2.Lease]) -> None:
            for lease in leases:
                await self.apply(lease)

        await asyncio.gather(*(in_order(leases) for leases in by_device.values()))

    async def apply(self, lease: common_pb2.Lease) -> LeaseAction:
        """Act on one lease (from an event or a reply); returns what was done."""
        device = lease.device_id
        if self.worker_id not in (lease.holder, lease.target_holder) and not self.user.using(device):
            self.num_other_worker += 1
            return LeaseAction.NONE
        if not self.user.knows(device):
            self.num_unknown_device += 1
            log.warning("lease names device %r, unknown to %s: ignored", device, self.worker_id)
            return LeaseAction.NONE
        async with self._locks.setdefault(device, asyncio.Lock()):
            if lease.epoch < self.epochs.get(device, 0):
                self.num_stale += 1
                return LeaseAction.NONE
            seen = self.epochs.get(device)
            self.epochs[device] = lease.epoch
            since = self.using_since.get(device) if self.user.using(device) else None
            action = decide(lease, self.worker_id, self.role, since)
            if self._done_already(action, device, lease.epoch, since):
                self.num_redelivered += 1
                return LeaseAction.NONE
            try:
                await self._act(action, lease)
            except grpc.aio.AioRpcError as exc:
                self.num_refused += 1
                if seen is None:  # an epoch the scheduler refused is not remembered (never issued?)
                    self.epochs.pop(device, None)
                else:
                    self.epochs[device] = seen
                log.info(
                    "%s of %s at epoch %d refused by the scheduler (%s: %s); a newer lease follows",
                    action,
                    device,
                    lease.epoch,
                    exc.code().name,
                    exc.details(),
                )
                return LeaseAction.NONE
            return action

    def _done_already(self, action: LeaseAction, device: str, epoch: int, since: int | None) -> bool:
        """A Release or Acquire this client already made at `epoch` (the lease redelivered, or named
        again by a heartbeat reply built before the action landed)."""
        if action is LeaseAction.RELEASE:
            return self.released_at.get(device) == epoch
        return action is LeaseAction.ACQUIRE and since == epoch

    async def _act(self, action: LeaseAction, lease: common_pb2.Lease) -> None:
        device, epoch = lease.device_id, lease.epoch
        if action is LeaseAction.RELEASE:
            if self.user.using(device):
                await self.user.stop_using(device)
            self.using_since.pop(device, None)
            await self.stub.Release(
                scheduler_pb2.ReleaseRequest(worker_id=self.worker_id, device_id=device, epoch=epoch)
            )
            self.num_released += 1
            self.released_at[device] = epoch
            log.info("%s released %s at epoch %d", self.worker_id, device, epoch)
        elif action is LeaseAction.ACQUIRE:
            await self.stub.Acquire(
                scheduler_pb2.AcquireRequest(worker_id=self.worker_id, device_id=device, epoch=epoch)
            )
            self.num_acquired += 1
            log.info("%s acquired %s at epoch %d", self.worker_id, device, epoch)
            await self._start(device, epoch)
        elif action is LeaseAction.START:
            await self._start(device, epoch)
        elif action is LeaseAction.FENCED:
            self.num_fenced += 1
            log.warning(
                "%s lost %s (epoch %d, holder %r): stopping", self.worker_id, device, epoch, lease.holder
            )
            await self.user.stop_using(device)
            self.using_since.pop(device, None)

    async def _start(self, device: str, epoch: int) -> None:
        if not self.user.using(device):
            await self.user.start_using(device)
        self.using_since[device] = epoch

    # -- loops (spawn them with Runtime.spawn: a loop that dies takes the service down) --------
    async def heartbeat_forever(self) -> None:
        """Heartbeat every interval and catch up on the leases in the reply; a missed beat is counted."""
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                reply = await self.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id))
            except grpc.aio.AioRpcError as exc:  # scheduler briefly away: keep working, try again
                self.num_refused += 1
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # a scheduler with a fresh store: join again
                    await self._register_quietly()
                continue
            self.catch_up(reply.leases)

    async def report_load_forever(self, interval_s: float) -> None:
        """ReportLoad every `interval_s` seconds (first report at once: the plan loop waits for it)."""
        while True:
            try:
                await self.stub.ReportLoad(
                    scheduler_pb2.ReportLoadRequest(worker_id=self.worker_id, load=self.load())
                )
            except grpc.aio.AioRpcError:
                self.num_refused += 1
            await asyncio.sleep(interval_s)

    def _spawn_logged(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed", name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def _register_quietly(self) -> None:
        try:
            await self.register()
        except grpc.aio.AioRpcError:
            self.num_refused += 1

    def counters(self) -> dict[str, int]:
        """What the client did and ignored, for status pages and tests."""
        return {
            "acquired": self.num_acquired,
            "released": self.num_released,
            "fenced": self.num_fenced,
            "ignored_stale_epoch": self.num_stale,
            "ignored_other_worker": self.num_other_worker,
            "ignored_unknown_device": self.num_unknown_device,
            "refused_by_scheduler": self.num_refused,
            "ignored_redelivered": self.num_redelivered,
        }
